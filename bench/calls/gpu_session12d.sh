#!/usr/bin/env bash
# H200 call 4 of session 12 (2026-12-02), with call 2's compile caches (.ind/): the training step of call 3 again,
# in a new process (no profile), then the CPU test whose bound changed. Output: $OUT/*.txt, *.raw
source bench/calls/prelude.sh
step train 170 python bench.py --model=$B2 --seq=4096 --batch=1 --dtype=bfloat16 --steps=10 --warmup=3 --compile=graphs
step test 60 python -m pytest -q tests/test_kernels.py -k fast_equals_reference
cat $O/log.txt; grep "tokens/s\|ratio\|FLOP" $O/train.txt; tail -2 $O/test.txt
