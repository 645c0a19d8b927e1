#!/usr/bin/env bash
# H200 call 4 of session 15 (2026-12-02), with call 3's compile caches (its test step ran out of time compiling): the
# GPU test of CUDA-graph training steps against compiled ones without graphs, and the stacked experts' tests, with
# the experts' stacks as the autograd leaves. Output: $OUT/log.txt, results.txt
source bench/calls/prelude.sh
step test 430 python -m pytest -q -x tests/test_compile.py::test_compile_graphs_equal_compiled_step_after_step \
    tests/test_kernels.py -k "graphs or stacked"
cd $O && cat log.txt test.txt > results.txt && rm -f *.raw test.txt
tail -30 results.txt
