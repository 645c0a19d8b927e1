#!/usr/bin/env bash
# Session 24, call 1: batch-64 decode with its traces (the replays' and the engine's loop, to find the ~0.6 ms of a
# step outside the model step), then bench/probe_moe_decode.py: Triton experts against aten's grouped GEMM at decode.
source bench/calls/prelude.sh
step decode64 290 python bench.py --what=decode --model=$B2 --seq=32 --batch=64 --new_tokens=1024 --dtype=bfloat16 --compile=layers --profile --trace=$O/dtrace.json
step summary 25 python bench/trace_summary.py $O/dtrace.json --top=12 --per=4
step loop 25 python bench/trace_summary.py $O/dtrace.loop.json --top=40 --per=8
step moe 200 python bench/probe_moe_decode.py --tokens 64 256
cd $O && cat log.txt decode64.txt summary.txt loop.txt moe.txt > results.txt && xz -T4 dtrace*.json; tar c *.raw | xz > logs.tar.xz && rm -f *.raw decode64.txt
grep -v "^ *$" results.txt | head -150
