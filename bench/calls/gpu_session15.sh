#!/usr/bin/env bash
# H200 call 1 of session 15 (2026-12-02), with session 14's compile caches (.ind/new.txz.*): bench/probe_hc_fused.py
# (hc_pre's forward as one Triton kernel, its dx kernel and hc_post's one-pass backward, against the model's compiled
# code), then the training step with --profile (no trace): its top kernels and the device's idle time between kernels.
# Output: $OUT/log.txt, results.txt, logs.tar.xz, new.txz.*
source bench/calls/prelude.sh
python -c "import triton; print('triton', triton.__version__)" >> $O/log.txt
step fused 270 python bench/probe_hc_fused.py
step train 290 python bench.py --model=$B2 --seq=4096 --batch=1 --dtype=bfloat16 --steps=6 --warmup=2 \
    --compile=graphs --profile
(cd /tmp/ind && find . -type f -newer $O/log.txt | tar c -T - | xz -T0 -1 | split -b 15M - $O/new.txz.)
cd $O && cat log.txt fused.txt train.txt > results.txt && tar c *.raw fused.txt train.txt | xz > logs.tar.xz \
    && rm -f *.raw fused.txt train.txt
grep -v "^ *\(nvjet\|void\|_ZN\|sm80\|##\|aten\|cutlass\|at::\|Memcpy\|Memset\)" results.txt | tail -90
