#!/usr/bin/env bash
# Session 20, call 2: the GRPO trainer on the toy task with parallel.head_loss compiled (the last stage's head and
# loss one graph; three of them: the format warm-up's loss, GRPO's, the old-policy logprobs), against session 19's
# run; then decode at batch 64 after the KV cache moved to kv_cache.py, against session 19's 5.48 ms a step.
# With session 19's caches (s19b). Output: $OUT/log.txt, results.txt, logs.tar.xz
source bench/calls/prelude.sh
nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader -l 20 > $O/mem.txt &
step grpo 280 python train_grpo.py config/h200.py --data=toy --eval_data=toy --max_steps=6 --max_new_tokens=64 \
    --n_prompts=8 --n_samples=8 --checkpoint_interval=0 --eval_interval=0 --out_dir=/tmp/grpo
kill %1
step decode 220 python bench.py --what=decode --model=$B2 --seq=32 --batch=64 --new_tokens=1024 --dtype=bfloat16 --compile=layers
cd $O && cat log.txt grpo.txt mem.txt decode.txt > results.txt && tar c *.raw | xz > logs.tar.xz && rm -f *.raw grpo.txt decode.txt
grep -v "^config:" results.txt | grep -v "^ *$" | tail -70
