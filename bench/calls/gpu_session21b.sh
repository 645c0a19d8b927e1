#!/usr/bin/env bash
# Session 21, call 2: mHC's write-back in Triton (kernels_triton.hc_post_triton) and MoE's combine as a gather and a
# fixed-order sum: the Triton tests on the GPU (inductor), the model's bf16 fast-path test, the combine alone
# (bench/probe_combine.py), then the training step at 2 x 4096 and 1 x 4096 (cold compile: the layers changed).
# Output: $OUT/log.txt, results.txt, logs.tar.xz
source bench/calls/prelude.sh
step tests 80 python -m pytest -q -p no:cacheprovider tests/test_triton.py tests/test_kernels.py::test_model_fast_bf16_as_accurate_as_reference_gpu
step combine 50 python bench/probe_combine.py
step train2 250 python bench.py --model=$B2 --seq=4096 --batch=2 --dtype=bfloat16 --steps=4 --warmup=2 --compile=graphs
step train1 190 python bench.py --model=$B2 --seq=4096 --batch=1 --dtype=bfloat16 --steps=6 --warmup=2 --compile=graphs --profile
cd $O && cat log.txt tests.txt combine.txt train2.txt train1.txt > results.txt && tar c *.raw | xz > logs.tar.xz && rm -f *.raw tests.txt combine.txt train2.txt train1.txt
grep -v "^ *$" results.txt | grep -v "^ *-\+" | head -120
