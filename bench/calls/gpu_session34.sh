#!/usr/bin/env bash
# Written in session 33 for session 34's first call (carry .ind: session 33's inductor and Triton caches for bench_2b's
# decode). A fresh per-kernel picture of bench_2b's decode step at batch 64 since PDL's removal (the trace, summed by
# bench/trace_summary.py: a step's kernels by kind and name), then the mismatch with the engine and the trainer
# compiled (gpu_session33b.sh's first step; ~300 s from a cold trainer-side compile).
source bench/calls/prelude.sh
step decode 200 python bench.py --what=decode --model=$B2 --seq=32 --batch=64 --new_tokens=1024 --dtype=bfloat16 \
    --compile=layers --no_peer --profile --trace=/tmp/decode.json
step summary 60 python bench/trace_summary.py /tmp/decode.json --per=4 --top=45
step mismatch_compiled 320 python bench.py --what=mismatch --model=$B2 --seq=64 --batch=16 --new_tokens=64 \
    --dtype=bfloat16 --compile=layers
cd $O && cat log.txt decode.txt summary.txt mismatch_compiled.txt > all.txt
grep -v "^ *-\+\|^ *aten::\|^ *void \|^ *cuda\|^ *$" all.txt | cut -c1-200 | tail -80
