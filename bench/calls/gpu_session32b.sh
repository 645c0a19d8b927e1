#!/usr/bin/env bash
# The second call of session 32's plan: the mismatch with the engine compiled (prefill and decode, compile='layers'),
# to set beside gpu_session32.sh's eager one, and decode at batch 64 with the compiled prefill.
source bench/calls/prelude.sh
step mismatch_compiled 330 python bench.py --what=mismatch --model=$B2 --seq=64 --batch=16 --new_tokens=64 --dtype=bfloat16 --compile=layers
step decode64 240 python bench.py --what=decode --model=$B2 --seq=32 --batch=64 --new_tokens=1024 --dtype=bfloat16 --compile=layers --no_peer
cd $O && cat log.txt mismatch_compiled.txt decode64.txt | grep -v "^ *$" | grep -v "^ *-\+\|^ *aten::\|^ *void \|^ *cuda\|^ *triton_\|^ *nvjet" | cut -c1-200 | tail -40
