#!/usr/bin/env bash
# Written in session 30 for the next session's first call (not run yet): the compiled prefill (KVCache.prefill_layer
# under compile_layers, prompts padded to a multiple of 128; Engine.warm_up prefills twice first). The prefill probe
# eager against compiled (64 prompts of 32 tokens: eager 115-122 ms in session 29), the compile tests on cuda
# (inductor), and decode at batch 64 (the rest of a step held 0.1-0.17 ms of eager prefill).
source bench/calls/prelude.sh
step probe_prefill 240 python bench/probe_prefill.py --compile
step tests 300 python -m pytest -q -p no:cacheprovider tests/test_compile_engine.py
step decode64 300 python bench.py --what=decode --model=$B2 --seq=32 --batch=64 --new_tokens=1024 --dtype=bfloat16 --compile=layers --no_peer
cd $O && cat log.txt probe_prefill.txt tests.txt decode64.txt > results.txt; tar c *.raw | xz > logs.tar.xz && rm -f *.raw
grep -v "^ *$" results.txt | grep -v "^ *-\+\|^ *aten::\|^ *void \|^ *cuda\|^ *Cuda\|^ *triton_\|^ *nvjet\|Memcpy\|Memset" | cut -c1-200 | head -80
