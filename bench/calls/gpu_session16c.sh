#!/usr/bin/env bash
# H200 call 3 of session 16 (2026-12-02), with the compile caches of session 14 (bench_2b's decode layers) and of
# session 15's small test models: the GPU tests of compiled training (the compiled head, _TargetLogprob,
# top_k_mask under inductor), of the kernels and of Triton; the tensor transport after the C pickler and the
# multi-tensor copy (bench/probe_sync.py; call 2 had the code before); decode at batch 256, last run in session 4.
# Output: $OUT/log.txt, results.txt, logs.tar.xz
source bench/calls/prelude.sh
step test 230 python -m pytest -q -x tests/test_compile.py tests/test_kernels.py tests/test_triton.py -p no:cacheprovider
step sync 90 python bench/probe_sync.py --syncs 3
step decode 250 python bench.py --what=decode --model=$B2 --seq=32 --batch=256 --new_tokens=1024 --dtype=bfloat16 \
    --compile=layers
cd $O && cat log.txt test.txt sync.txt decode.txt > results.txt && tar c *.raw | xz > logs.tar.xz \
    && rm -f *.raw test.txt sync.txt decode.txt
grep -v "^ \+[0-9]\+ \+[0-9.]\+ \+[0-9.]\+ \+[0-9.]" results.txt | tail -60
