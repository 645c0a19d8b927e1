#!/usr/bin/env bash
# Session 34, call 1 (carry .ind: session 33's inductor and Triton caches for bench_2b's decode): bench_2b's decode
# step at batch 64 profiled, its kernels by kind and name, and the first 130 kernels of a step in time order (the
# embedding and the first four layers: two window-only, a CSA and an HCA layer), to pick what to fuse.
source bench/calls/prelude.sh
step decode 240 python bench.py --what=decode --model=$B2 --seq=32 --batch=64 --new_tokens=1024 --dtype=bfloat16 \
    --compile=layers --no_peer --profile --trace=/tmp/decode.json
step summary 60 python bench/trace_summary.py /tmp/decode.json --per=4 --top=50 --order=0:130
step loop 60 python bench/trace_summary.py /tmp/decode.loop.json --per=8 --top=25
cd $O && cat log.txt decode.txt summary.txt loop.txt > all.txt
