#!/usr/bin/env bash
# Session 20, call 1: the trainer's last stage as one compiled graph (parallel.head_loss: the head's GEMM and the
# loss, the logits' gradient cast to bf16 inside the loss's backward kernel) timed against session 19's 64 ms, with
# the step's top kernels; its GPU test (inductor, bf16); then the GPU tests of the engine's fast paths after the KV
# cache moved to kv_cache.py (CUDA graphs, stacked experts, compiled decode and warm-up).
# Output: $OUT/log.txt, results.txt, logs.tar.xz, new.txz.*
source bench/calls/prelude.sh
step train 230 python bench.py --model=$B2 --seq=4096 --batch=1 --dtype=bfloat16 --steps=6 --warmup=2 --compile=graphs --profile
step headloss 90 python -m pytest -q -p no:cacheprovider tests/test_compile.py::test_compiled_head_loss_equals_eager
step tests 200 python -m pytest -v -p no:cacheprovider tests/test_kernels_engine.py tests/test_compile_engine.py
(cd /tmp/ind && find . -type f -newer $O/log.txt | tar c -T - | xz -T0 -1 | split -b 15M - $O/new.txz.)
cd $O && cat log.txt train.txt headloss.txt tests.txt > results.txt && tar c *.raw | xz > logs.tar.xz && rm -f *.raw train.txt headloss.txt tests.txt
grep -v "^ *$" results.txt | tail -80
