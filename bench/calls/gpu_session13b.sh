#!/usr/bin/env bash
# H200 call 2 of session 13 (2026-12-02): the training step with mHC's mixes on bf16 tensor cores (the batched
# Sinkhorn loop as before), a cold compile with its profile and trace, in the background; bench/probe_mhc.py times
# the masked Sinkhorn form meanwhile. The compile caches written in this call come back for the next one.
# Output: $OUT/log.txt, results.txt, logs.tar.xz, trace.json.gz, new.txz.*
source bench/calls/prelude.sh
step train 555 python bench.py --model=$B2 --seq=4096 --batch=1 --dtype=bfloat16 --steps=6 --warmup=2 \
    --compile=graphs --profile --trace=$O/trace.json.gz &
step probe 300 python bench/probe_mhc.py
wait
(cd /tmp/ind && find . -type f -newer $O/log.txt | tar c -T - | xz -T0 -1 | split -b 15M - $O/new.txz.)
cd $O && cat log.txt probe.txt train.txt > results.txt && tar c *.raw probe.txt train.txt | xz > logs.tar.xz \
    && rm -f *.raw probe.txt train.txt
cat log.txt; grep -v "^ *\(triton\|nvjet\|void\|_ZN\|sm80\|##\|aten\|cutlass\|at::\|Memcpy\|Memset\)" results.txt | tail -50
