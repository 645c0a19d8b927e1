#!/usr/bin/env bash
# Written in session 32 for session 33's first call: programmatic dependent launch for the decode kernels
# (kernels_triton.pdl, on with NANO_DSV4_PDL=1). The GPU tests with it on (test_pdl_decode_equals_plain_launches: bit
# for bit against plain launches under CUDA graphs; the kernels' own tests), then decode at batch 64 without and with
# it (the second run finds the first's compiled layers in inductor's cache). Output: all.txt, all.raw, and the caches
# (ind.txz.*) for the later calls: copy them into .ind/ and carry it.
source bench/calls/prelude.sh
step tests 200 env NANO_DSV4_PDL=1 python -m pytest -q -p no:cacheprovider -rf tests/test_kernels_engine.py \
    tests/test_decode_kernels.py tests/test_decode_attention.py tests/test_routing_kernels.py
D="python bench.py --what=decode --model=$B2 --seq=32 --batch=64 --new_tokens=1024 --dtype=bfloat16 --compile=layers --no_peer"
step off 250 $D
step pdl 130 env NANO_DSV4_PDL=1 $D
cd $O && cat log.txt tests.txt off.txt pdl.txt > all.txt && cat tests.raw off.raw pdl.raw > all.raw
rm -f log.txt tests.* off.* pdl.*
tar c -C /tmp/ind . | xz -T0 -3 | split -b 15M - $O/ind.txz.
ls -la $O; grep -v "^ *-\+\|^ *aten::\|^ *void \|^ *cuda\|^ *triton_\|^ *nvjet\|^ *$" all.txt | cut -c1-200 | tail -45
