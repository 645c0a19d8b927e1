#!/usr/bin/env bash
# H200 call 2 of session 12 (2026-12-02): window_attention's softmax in two parts (no concatenation) and the
# indexer's fused score, from call 1's probes. The GPU kernel tests and CUDA IPC into a server, then the training
# step with its profile and trace (a cold compile), then inductor's caches packed for the next call.
# Output: $OUT/*.txt, *.raw, trace.json.gz, ind.txz.*
source bench/calls/prelude.sh
step test 140 python -m pytest -q tests/test_kernels.py tests/test_tensor_sync.py::test_cuda_ipc_into_a_server_on_this_gpu
step train 400 python bench.py --model=$B2 --seq=4096 --batch=1 --dtype=bfloat16 --steps=6 --warmup=2 \
    --compile=graphs --profile --trace=$O/trace.json.gz
tar c -C /tmp/ind . | xz -T0 -1 | split -b 15M - $O/ind.txz.
cat $O/log.txt; tail -4 $O/test.txt; grep -v "^ *\(triton\|nvjet\|void\|_ZN\|sm80\|##\|aten\|cutlass\|at::\|Memcpy\|Memset\)" $O/train.txt | head -40
