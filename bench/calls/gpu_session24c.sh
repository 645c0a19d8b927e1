#!/usr/bin/env bash
# Session 24, call 3: the trainer/engine mismatch with the engine's experts on Triton (call 2's was cut by its limit
# while compiling), then a short GRPO run on the toy task (none since session 20) with this code.
source bench/calls/prelude.sh
step mismatch 150 python bench.py --what=mismatch --model=$B2 --seq=64 --batch=16 --new_tokens=64 --dtype=bfloat16
step grpo 330 python train_grpo.py config/h200.py --data=toy --eval_data=toy --max_steps=6 --max_new_tokens=64 --n_prompts=8 --n_samples=8 --checkpoint_interval=0 --eval_interval=0
cd $O && cat log.txt mismatch.txt grpo.txt > results.txt; tar c *.raw | xz > logs.tar.xz && rm -f *.raw
grep -v "^ *$" results.txt | tail -60
