#!/usr/bin/env bash
# Session 33, call 3: decode on DeepSeek-V4 Flash's own widths (hidden 4096, 256 experts of 2048, 64 heads), its first
# 6 layers (2 window-only, 2 CSA, 2 HCA; ~80 GB in bf16, which one H200 holds), randomly initialised, against the
# memory floor, at batch 64 and 256. bench_2b (hidden 1536, 64 experts of 512) is the small-model figure beside it.
source bench/calls/prelude.sh
F="python bench.py --what=decode --model=config/models/flash.json --layers=6 --seq=32 --new_tokens=1024 --dtype=bfloat16 --compile=layers --no_peer"
step flash64 330 $F --batch=64
step flash256 200 $F --batch=256
cd $O && cat log.txt flash64.txt flash256.txt > all.txt && nvidia-smi --query-gpu=memory.used --format=csv >> all.txt
cat all.txt | cut -c1-250 | tail -30
