#!/usr/bin/env bash
# Session 30, call 4: the code kept (hc_pre's two programs a token; the decode attention's key loops ending at each
# sequence's last visible entry; call 3's router GEMM in the route kernel and the experts' in-kernel prefix sum
# dropped): decode at batch 64 against transformers, and at 256 (ours only).
source bench/calls/prelude.sh
step decode64 300 python bench.py --what=decode --model=$B2 --seq=32 --batch=64 --new_tokens=1024 --dtype=bfloat16 --compile=layers
step decode256 150 python bench.py --what=decode --model=$B2 --seq=32 --batch=256 --new_tokens=1024 --dtype=bfloat16 --compile=layers --no_peer
cd $O && cat log.txt decode64.txt decode256.txt > results.txt; tar c *.raw | xz > logs.tar.xz && rm -f *.raw
cut -c1-220 results.txt
