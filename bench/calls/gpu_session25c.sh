#!/usr/bin/env bash
# Session 25, call 3: call 2's code against transformers' generate in the same run, batch 64 and 256; then the
# trainer/engine mismatch (the engine's projections fused and its sampler in Triton now).
source bench/calls/prelude.sh
step decode64 230 python bench.py --what=decode --model=$B2 --seq=32 --batch=64 --new_tokens=1024 --dtype=bfloat16 --compile=layers
step decode256 250 python bench.py --what=decode --model=$B2 --seq=32 --batch=256 --new_tokens=1024 --dtype=bfloat16 --compile=layers
step mismatch 105 python bench.py --what=mismatch --model=$B2 --seq=64 --batch=16 --new_tokens=64 --dtype=bfloat16
cd $O && cat log.txt decode64.txt decode256.txt mismatch.txt > results.txt; tar c *.raw | xz > logs.tar.xz && rm -f *.raw
grep -v "^ *$" results.txt | tail -40
