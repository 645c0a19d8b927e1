#!/usr/bin/env bash
# H200 call 3 of session 18 (2026-12-02), with call 2's compile cache (call 2 was cut 175 s after the embedded
# server's ready line, still compiling): the same GRPO run, to see its steps train.
# Output: $OUT/log.txt, results.txt, logs.tar.xz
source bench/calls/prelude.sh
nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader -l 20 > $O/mem.txt &
step grpo 490 python train_grpo.py config/h200.py --data=toy --eval_data=toy --max_steps=8 --max_new_tokens=64 \
    --n_prompts=8 --n_samples=8 --checkpoint_interval=0 --eval_interval=0 --out_dir=/tmp/grpo
kill %1
cd $O && cat log.txt grpo.txt mem.txt > results.txt && tar c *.raw | xz > logs.tar.xz && rm -f *.raw grpo.txt
grep -v "^config:" results.txt | tail -50
