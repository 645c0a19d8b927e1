#!/usr/bin/env bash
# H200 call 3 of session 15 (2026-12-02), with call 2's compile caches: the training step with the experts' stacks as
# the autograd leaves (call 2 read a stack's gradient that the next replay had overwritten: _owns now looks at the
# parameters first), against the code before (ab_old/: HEAD's modules, this bench.py) in the same call; then the
# GPU tests of CUDA graphs and of the stacked experts. Output: $OUT/log.txt, results.txt, logs.tar.xz, new.txz.*
source bench/calls/prelude.sh
step train 190 python bench.py --model=$B2 --seq=4096 --batch=1 --dtype=bfloat16 --steps=10 --warmup=3 --compile=graphs
step old 170 python ab_old/bench.py --model=$B2 --seq=4096 --batch=1 --dtype=bfloat16 --steps=10 --warmup=3 --compile=graphs
step test 200 python -m pytest -q tests/test_compile.py::test_compile_graphs_equal_compiled_step_after_step tests/test_kernels.py
(cd /tmp/ind && find . -type f -newer $O/log.txt | tar c -T - | xz -T0 -1 | split -b 15M - $O/new.txz.)
cd $O && cat log.txt train.txt old.txt test.txt > results.txt && tar c *.raw train.txt old.txt test.txt | xz > logs.tar.xz \
    && rm -f *.raw train.txt old.txt test.txt
tail -30 results.txt
