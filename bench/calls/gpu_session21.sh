#!/usr/bin/env bash
# Session 21, call 1: the routed experts' grouped GEMMs alone (bench/probe_grouped.py: aten's kernel, inductor's
# Triton templates under max-autotune, a dense GEMM of the same FLOPs), then the training step's trace at 1 x 4096
# for offline analysis. Output: $OUT/log.txt, results.txt, logs.tar.xz, trace1.json.gz
source bench/calls/prelude.sh
step grouped 300 python bench/probe_grouped.py
step train 200 python bench.py --model=$B2 --seq=4096 --batch=1 --dtype=bfloat16 --steps=4 --warmup=2 --compile=graphs --profile --trace=$O/trace1.json.gz
cd $O && cat log.txt grouped.txt train.txt > results.txt && tar c *.raw | xz > logs.tar.xz && rm -f *.raw grouped.txt train.txt
grep -v "^ *$" results.txt | grep -v "^ *-\+$" | head -150
