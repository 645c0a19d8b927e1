#!/usr/bin/env bash
# Session 34, last call (carry .ind): probe_skinny.py again with small N allowed (call 2 stopped at the router's 64
# columns), then the mismatch with the engine and the trainer compiled (gpu_session34.sh's last step; ~320 s, the
# trainer's side from a cold cache).
source bench/calls/prelude.sh
step skinny 120 python bench/probe_skinny.py
step mismatch_compiled 420 python bench.py --what=mismatch --model=$B2 --seq=64 --batch=16 --new_tokens=64 \
    --dtype=bfloat16 --compile=layers
cd $O && cat log.txt skinny.txt mismatch_compiled.txt > all.txt
