#!/usr/bin/env bash
# H200 call 1 of session 17 (2026-12-02), with the compile caches of session 16's call 1 (bench_2b's training
# graphs) and session 15's small test models: the training step of cab2ba1, profiled, with its trace (where the
# device's time goes after session 15's four changes); then the GPU tests not run since session 15's changes and
# session 16's pickler: the CUDA IPC transport, tests/test_kernels.py, tests/test_triton.py.
# Output: $OUT/log.txt, results.txt, logs.tar.xz, trace.json.gz, new.txz.*
source bench/calls/prelude.sh
step train 300 python bench.py --model=$B2 --seq=4096 --batch=1 --dtype=bfloat16 --steps=6 --warmup=2 \
    --compile=graphs --profile --trace=$O/trace.json.gz
step test 170 python -m pytest -v -x -p no:cacheprovider tests/test_tensor_sync.py::test_cuda_ipc_into_a_server_on_this_gpu \
    tests/test_kernels.py tests/test_triton.py
(cd /tmp/ind && find . -type f -newer $O/log.txt | tar c -T - | xz -T0 -1 | split -b 15M - $O/new.txz.)
cd $O && cat log.txt train.txt test.txt > results.txt && tar c *.raw | xz > logs.tar.xz && rm -f *.raw train.txt test.txt
grep -v "^ *\(nvjet\|void\|_ZN\|sm80\|##\|aten\|cutlass\|at::\|Memcpy\|Memset\|triton\)" results.txt | tail -60
