#!/usr/bin/env bash
# Written in session 29 for the next session's first call (not run yet): the --invariant fix on the GPU (session 29
# measured 0.079 there before it: the rope_angles op's cos and sin outside kernels.PathInvariant), the alignment
# tests on cuda, and decode at batch 64 as a baseline for the next change.
source bench/gpu_prelude.sh
step tests 200 python -m pytest -q -p no:cacheprovider tests/test_alignment.py -k "invariant"
step mismatch_inv 200 python bench.py --what=mismatch --model=$B2 --seq=64 --batch=16 --new_tokens=64 --dtype=bfloat16 --invariant
step decode64 300 python bench.py --what=decode --model=$B2 --seq=32 --batch=64 --new_tokens=1024 --dtype=bfloat16 --compile=layers --no_peer
cd $O && cat log.txt tests.txt mismatch_inv.txt decode64.txt > results.txt; tar c *.raw | xz > logs.tar.xz && rm -f *.raw
cut -c1-200 results.txt | head -60
