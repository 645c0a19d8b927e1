#!/usr/bin/env bash
# Prepared in session 18 for the next H200 call (not yet run): the training step's profile and trace after session
# 17's changes (65 ms in session 18: where the time now goes, before more MFU work), then decode at batch 64 after
# the cheaper expert-stack check and the engine's uploads from pinned memory (session 18's "rest of a step" was 0.39
# ms against session 14's 0.19); first the engine's CUDA-graph test, which runs the pinned path.
# Cold compiles: ~190 s for the training step, ~75 s for the decode. Output: $OUT/log.txt, results.txt,
# logs.tar.xz, trace.json.gz, new.txz.*
source bench/calls/prelude.sh
step graphs 60 python -m pytest -v -x -p no:cacheprovider tests/test_kernels.py::test_engine_cuda_graphs_equal_eager_and_forward
step train 300 python bench.py --model=$B2 --seq=4096 --batch=1 --dtype=bfloat16 --steps=6 --warmup=2 \
    --compile=graphs --profile --trace=$O/trace.json.gz
step decode 200 python bench.py --what=decode --model=$B2 --seq=32 --batch=64 --new_tokens=1024 --dtype=bfloat16 --compile=layers
(cd /tmp/ind && find . -type f -newer $O/log.txt | tar c -T - | xz -T0 -1 | split -b 15M - $O/new.txz.)
cd $O && cat log.txt graphs.txt train.txt decode.txt > results.txt && tar c *.raw | xz > logs.tar.xz && rm -f *.raw graphs.txt train.txt decode.txt
grep -v "^ *\(nvjet\|void\|_ZN\|sm80\|##\|aten\|cutlass\|at::\|Memcpy\|Memset\|triton\)" results.txt | tail -60
