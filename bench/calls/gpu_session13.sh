#!/usr/bin/env bash
# H200 call 1 of session 13 (2026-12-02): mHC's mixes on bf16 tensor cores (kernels_torch.hc_mixes_bf16, fn in three exact
# bf16 parts) and the Sinkhorn loop with one tensor per row under compile (model_dsv4.sinkhorn_rows). The training
# step's cold compile with its profile and trace runs in the background (inductor's caches come back for the next
# call) while bench/probe_mhc.py times the forms alone and the GPU tests run.
# Output: $OUT/log.txt, results.txt, logs.tar.xz, trace.json.gz, ind.txz.*
source bench/calls/prelude.sh
step train 530 python bench.py --model=$B2 --seq=4096 --batch=1 --dtype=bfloat16 --steps=6 --warmup=2 \
    --compile=graphs --profile --trace=$O/trace.json.gz &
step probe 280 python bench/probe_mhc.py
step test 200 python -m pytest -q tests/test_kernels.py tests/test_compile.py::test_compiled_sampler_and_sinkhorn_equal_eager \
    tests/test_compile.py::test_compile_layers_train_as_accurate_as_eager
wait
tar c -C /tmp/ind . | xz -T0 -1 | split -b 15M - $O/ind.txz.
cd $O && cat log.txt probe.txt test.txt train.txt > results.txt && tar c *.raw probe.txt test.txt train.txt | xz > logs.tar.xz \
    && rm -f *.raw probe.txt test.txt train.txt
cat log.txt; grep -v "^ *\(triton\|nvjet\|void\|_ZN\|sm80\|##\|aten\|cutlass\|at::\|Memcpy\|Memset\)" results.txt | tail -60
