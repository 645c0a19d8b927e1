#!/usr/bin/env bash
# H200 call 4 of session 18 (2026-12-02), on the machine still warm from call 3 (its caches in /tmp/ind): decode at
# batch 64, 1024 new tokens, with the uint8 sort and the mixes' cast order (3f813f3), against session 14's figure.
# Output: $OUT/log.txt, results.txt, logs.tar.xz
source bench/calls/prelude.sh
step decode 400 python bench.py --what=decode --model=$B2 --seq=32 --batch=64 --new_tokens=1024 --dtype=bfloat16 --compile=layers
cd $O && cat log.txt decode.txt > results.txt && tar c *.raw | xz > logs.tar.xz && rm -f *.raw decode.txt
tail -30 results.txt
