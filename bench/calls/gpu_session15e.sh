#!/usr/bin/env bash
# H200 call 5 of session 15 (2026-12-02), with the compile caches of session 14 and of this session's call 2: the
# training step with the experts' stacks as the autograd leaves, profiled, with its trace (for where the device's
# 67 ms of kernels go now, and whether the host still makes the device wait). Output: $OUT/log.txt, results.txt,
# trace.json.gz
source bench/calls/prelude.sh
step train 330 python bench.py --model=$B2 --seq=4096 --batch=1 --dtype=bfloat16 --steps=6 --warmup=2 \
    --compile=graphs --profile --trace=$O/trace.json.gz
cd $O && cat log.txt train.txt > results.txt && rm -f *.raw train.txt
grep -v "^ *\(nvjet\|void\|_ZN\|sm80\|##\|aten\|cutlass\|at::\|Memcpy\|Memset\|triton\)" results.txt | tail -30
