#!/usr/bin/env bash
# H200 call 3 of session 14 (2026-12-02), with call 2's compile caches (.ind/new.txz.*): the Triton Sinkhorn's backward
# now stores each step's input once (call 2 computed each again from the start: 83 us). The GPU tests of the kernel
# and of the model with it, bench/probe_mhc.py (now also profiling the CUDA-graph replays), then the training step
# alone on the GPU (no profile). Output: $OUT/log.txt, results.txt, logs.tar.xz
source bench/calls/prelude.sh
python -c "import triton; print('triton', triton.__version__)" >> $O/log.txt
step test 150 python -m pytest -q tests/test_triton.py tests/test_kernels.py::test_model_fast_bf16_as_accurate_as_reference_gpu \
    tests/test_kernels.py::test_engine_cuda_graphs_equal_eager_and_forward
step probe 200 python bench/probe_mhc.py
step train 220 python bench.py --model=$B2 --seq=4096 --batch=1 --dtype=bfloat16 --steps=10 --warmup=3 --compile=graphs
cd $O && cat log.txt test.txt probe.txt train.txt > results.txt && tar c *.raw test.txt probe.txt train.txt | xz > logs.tar.xz \
    && rm -f *.raw test.txt probe.txt train.txt
grep -v "^ *\(triton\|nvjet\|void\|_ZN\|sm80\|##\|aten\|cutlass\|at::\|Memcpy\|Memset\)" results.txt | tail -60
