#!/usr/bin/env bash
# H200 call 4 of session 14 (2026-12-02): the engine's CUDA-graph test with its parted-token check mended (call 3
# failed it on the logprob of the first token where the graphed and eager decodes part), then decode at batch 64
# with the Triton Sinkhorn in the engine's decode layers (a cold compile of them). Output: $OUT/log.txt, results.txt
source bench/calls/prelude.sh
step test 100 python -m pytest -q tests/test_kernels.py::test_engine_cuda_graphs_equal_eager_and_forward
step decode 450 python bench.py --what=decode --model=$B2 --seq=32 --batch=64 --new_tokens=1024 --dtype=bfloat16 \
    --compile=layers
cd $O && cat log.txt test.txt decode.txt > results.txt && rm -f *.raw test.txt decode.txt
tail -40 results.txt
