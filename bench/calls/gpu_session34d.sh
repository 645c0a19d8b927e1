#!/usr/bin/env bash
# Session 34 (carry .ind): the compiled mismatch again with inductor's emulate_precision_casts on (bf16 intermediates
# rounded where eager rounds them), set before bench.py runs; gpu_session34c.sh had 0.460 without it, eager 0.352
# (session 32).
source bench/calls/prelude.sh
EMU="import sys, runpy, torch._inductor.config as c; c.emulate_precision_casts = True; \
sys.argv = ['bench.py'] + sys.argv[1:]; runpy.run_path('bench.py', run_name='__main__')"
step mismatch_emulated 480 python -c "$EMU" --what=mismatch --model=$B2 --seq=64 --batch=16 --new_tokens=64 \
    --dtype=bfloat16 --compile=layers
cd $O && cat log.txt mismatch_emulated.txt > all.txt
