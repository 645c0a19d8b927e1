#!/usr/bin/env bash
# Written in session 26 for the next session's first call: hc_pre's mixes in tf32x3 on CUDA (kernels_triton.hc_dot,
# chosen from session 26's probe, not yet run inside the model): the kernels' GPU tests, the hc_pre probe, decode at
# batch 64 against transformers (the ratio) and at 256 (no peer: the floor ratio).
source bench/gpu_prelude.sh
step tests 160 python -m pytest -q -p no:cacheprovider tests/test_triton.py tests/test_decode_kernels.py tests/test_routing_kernels.py tests/test_kernels_engine.py
step hcpre 60 python bench/probe_hc_pre.py
step decode64 230 python bench.py --what=decode --model=$B2 --seq=32 --batch=64 --new_tokens=1024 --dtype=bfloat16 --compile=layers
step decode256 110 python bench.py --what=decode --model=$B2 --seq=32 --batch=256 --new_tokens=1024 --dtype=bfloat16 --compile=layers --no_peer
cd $O && cat log.txt tests.txt hcpre.txt decode64.txt decode256.txt > results.txt; tar c *.raw | xz > logs.tar.xz && rm -f *.raw
grep -v "^ *$" results.txt | head -120
