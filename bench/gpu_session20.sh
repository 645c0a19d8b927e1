#!/usr/bin/env bash
# Prepared in session 19 for the next H200 call (not yet run): after the engine's KV cache and its prefill/decode
# moved to kv_cache.py (KVCache.decode_layer now the compiled function), the GPU tests of the engine's fast paths
# (CUDA graphs, stacked experts, compiled decode and warm-up: inductor), then decode at batch 64 against session
# 19's 5.48 ms a step. Output: $OUT/log.txt, results.txt, logs.tar.xz, new.txz.*
source bench/gpu_prelude.sh
step tests 240 python -m pytest -v -p no:cacheprovider tests/test_kernels_engine.py tests/test_compile_engine.py
step decode 200 python bench.py --what=decode --model=$B2 --seq=32 --batch=64 --new_tokens=1024 --dtype=bfloat16 --compile=layers
(cd /tmp/ind && find . -type f -newer $O/log.txt | tar c -T - | xz -T0 -1 | split -b 15M - $O/new.txz.)
cd $O && cat log.txt tests.txt decode.txt > results.txt && tar c *.raw | xz > logs.tar.xz && rm -f *.raw tests.txt decode.txt
grep -v "^ *$" results.txt | tail -60
