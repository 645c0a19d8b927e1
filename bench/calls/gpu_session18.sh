#!/usr/bin/env bash
# H200 call 1 of session 18 (2026-12-02), no compile cache (the checkout's caches were lost): the training step of
# 3f813f3, which has session 17's untimed changes (the streams' fp32 casts before the mixes' GEMM, so the backward
# recomputes them instead of reading saved copies; the MoE's sort on uint8 keys; the per-position FLOP count), with
# each side's peak memory; then bench/probe_sort.py (argsort by key width).
# Output: $OUT/log.txt, results.txt, logs.tar.xz, new.txz.*
source bench/calls/prelude.sh
step train 450 python bench.py --model=$B2 --seq=4096 --batch=1 --dtype=bfloat16 --steps=10 --warmup=3 --compile=graphs
step sort 40 python bench/probe_sort.py
(cd /tmp/ind && find . -type f -newer $O/log.txt | tar c -T - | xz -T0 -1 | split -b 15M - $O/new.txz.)
cd $O && cat log.txt train.txt sort.txt > results.txt && tar c *.raw | xz > logs.tar.xz && rm -f *.raw train.txt sort.txt
tail -45 results.txt
