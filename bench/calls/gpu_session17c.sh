#!/usr/bin/env bash
# H200 call 3 of session 17 (2026-12-02), with call 2's compile caches: the GRPO trainer with config/h200.py on the
# toy task as its header documents it (format warm-up of 30 steps, now printed every 5), bench_2b from scratch;
# if no step trained (no group with a reward spread), once more with trainable='io' (the toy default from scratch).
# Output: $OUT/log.txt, results.txt, logs.tar.xz
source bench/calls/prelude.sh
nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader -l 20 > $O/mem.txt &
run=(python train_grpo.py config/h200.py --data=toy --eval_data=toy --max_steps=8 --max_new_tokens=64 --n_prompts=8
     --n_samples=8 --checkpoint_interval=0 --eval_interval=0 --out_dir=/tmp/grpo)
step grpo 250 "${run[@]}"
grep -q "t_train [1-9]\|t_train 0\.[1-9]" $O/grpo.raw || step grpo_io 250 "${run[@]}" --trainable=io --out_dir=/tmp/grpo_io
kill %1
cd $O && cat log.txt grpo*.txt mem.txt > results.txt && tar c *.raw | xz > logs.tar.xz && rm -f *.raw grpo*.txt
grep -v "^config:" results.txt | tail -50
