#!/usr/bin/env bash
# H200 call 2 of session 16 (2026-12-02), with the compile caches of sessions 14-16: where the tensor transport's
# 0.46 s goes (bench/probe_sync.py: each call's round trip, the server's own time per bucket, a cProfile of the
# trainer's side); the loss probe after _TargetLogprob's in-place backward; then the GPU tests.
# Output: $OUT/log.txt, results.txt, logs.tar.xz
source bench/calls/prelude.sh
step sync 170 python bench/probe_sync.py --syncs 3
step loss 60 python bench/probe_loss.py
step test 300 python -m pytest -q -x tests/test_compile.py tests/test_kernels.py tests/test_triton.py \
    tests/test_tensor_sync.py tests/test_alignment.py -p no:cacheprovider
cd $O && cat log.txt sync.txt loss.txt test.txt > results.txt && tar c *.raw sync.txt loss.txt test.txt | xz > logs.tar.xz \
    && rm -f *.raw sync.txt loss.txt test.txt
tail -25 results.txt
