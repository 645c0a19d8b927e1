#!/usr/bin/env bash
# H200 call 3 of session 11 (2026-12-02), with call 1's compile caches (.ind/): the experts trained in place
# (Transformer.stack_experts, kernels_torch._StackedExperts), the head's weight gradient in its own layout
# (kernels_torch._MatmulF32), the bench's loss on every position. The kernel tests on the GPU, then the training step
# (a cold compile of the layers: their graphs changed). Output: $OUT/*.txt, *.raw
source bench/calls/prelude.sh
step test 45 python -m pytest -q tests/test_kernels.py
step train 370 python bench.py --model=$B2 --seq=4096 --batch=1 --dtype=bfloat16 --steps=6 --warmup=2 \
    --compile=graphs
cat $O/log.txt $O/test.txt; grep -v "^ *\(triton\|nvjet\|void\|_ZN\|sm80\|##\|aten\)" $O/train.txt | head -30
