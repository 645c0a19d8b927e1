#!/usr/bin/env bash
# Session 33, call 4: the decode floor with the experts the batch's tokens really pick (bench.py now counts them in an
# eager forward, where it assumed uniform routing): Flash's widths (6 layers) and bench_2b, both at batch 64.
source bench/calls/prelude.sh
A="--what=decode --seq=32 --batch=64 --new_tokens=1024 --dtype=bfloat16 --compile=layers --no_peer"
step b2 170 python bench.py --model=$B2 $A
step flash 300 python bench.py --model=config/models/flash.json --layers=6 $A
cd $O && cat log.txt b2.txt flash.txt > all.txt
cat all.txt | cut -c1-250 | tail -30
