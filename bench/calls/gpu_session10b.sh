#!/usr/bin/env bash
# H200 call 2 of session 10 (2026-12-02). Call 1's GRPO run failed while compiling: train_grpo.py's fp32 default
# takes the reference expert loop on a GPU, and inductor failed on its data-dependent slices (now run eagerly,
# MoE.loop_experts). Here: that test and the CUDA-IPC tests (the engine now looks up each name on its module); the
# sync benchmark again (the server no longer walks state_dict() per bucket); the GRPO run again. Output: $OUT/log*.txt
source bench/calls/prelude.sh
( date +%T; timeout 150 python -m pytest -q tests/test_compile.py tests/test_tensor_sync.py -k "loop or ipc" 2>&1 | tail -6; date +%T ) > $O/log_test.txt 2>&1
( date +%T; timeout 190 python bench.py --what=sync --model=$B2 --dtype=bfloat16 2>&1 | drop; date +%T ) > $O/log_sync.txt 2>&1
( date +%T; timeout 220 python train_grpo.py --out_dir=/tmp/g10 --compile=layers --weight_sync=tensor --max_steps=6 \
    --eval_interval=0 --checkpoint_interval=0 2>&1 | drop | cut -c1-220 > $O/log_grpo_full.txt; date +%T ) > $O/log_grpo.txt 2>&1
cat $O/log.txt $O/log_test.txt $O/log_sync.txt $O/log_grpo.txt; head -30 $O/log_grpo_full.txt; echo ...; tail -25 $O/log_grpo_full.txt
