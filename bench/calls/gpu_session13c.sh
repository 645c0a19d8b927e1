#!/usr/bin/env bash
# H200 call 3 of session 13 (2026-12-02), with call 2's compile caches (.ind/new.txz.*): the training step of call 2's
# code again in a new process, no profile; then the compiled training layers' accuracy test under inductor (bf16
# mixes inside the layers) and the Sinkhorn forms' test. Output: $OUT/log.txt, results.txt
source bench/calls/prelude.sh
cat .ind/new.txz.* | xz -d | tar x -C /tmp/ind
step train 250 python bench.py --model=$B2 --seq=4096 --batch=1 --dtype=bfloat16 --steps=10 --warmup=3 --compile=graphs
step test 170 python -m pytest -q tests/test_compile.py::test_compile_layers_train_as_accurate_as_eager \
    tests/test_compile.py::test_compiled_sampler_and_sinkhorn_equal_eager
cd $O && cat log.txt train.txt test.txt > results.txt && rm -f *.raw train.txt test.txt
grep -v "^ *\(triton\|nvjet\|void\|_ZN\|sm80\|##\|aten\|cutlass\|at::\|Memcpy\|Memset\)" results.txt | tail -30
