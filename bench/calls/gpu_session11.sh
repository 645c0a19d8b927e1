#!/usr/bin/env bash
# H200 call 1 of session 11 (2026-12-02): expert weights stacked in one copy (kernels_torch.grouped_experts). The kernel
# tests on the GPU; the training step of bench_2b with CUDA graphs, profiled, with its trace for a breakdown by layer
# (bench.py --trace); the compile caches written back for the next calls (.ind/). Output: $OUT/*.txt, all.raw,
# trace.json.gz, ind.txz.*
source bench/calls/prelude.sh
step test 100 python -m pytest -q tests/test_kernels.py
step train 420 python bench.py --model=$B2 --seq=4096 --batch=1 --dtype=bfloat16 --steps=10 --warmup=3 \
    --compile=graphs --profile --trace=/tmp/trace.json
gzip -c /tmp/trace.json > $O/trace.json.gz 2>/dev/null
cat $O/test.raw $O/train.raw > $O/all.raw && rm $O/test.raw $O/train.raw
tar c -C /tmp/ind . | xz -T0 -3 | split -b 15M - $O/ind.txz.
ls -la $O; cat $O/log.txt $O/test.txt $O/train.txt
