#!/usr/bin/env bash
# Written in session 32 for session 33's second call, with gpu_session33.sh's caches carried (.ind): the mismatch with
# the engine and the trainer compiled (session 32's two tries ran out of time compiling cold, at 270 and 330 s), then
# with inductor's emulate_precision_casts (eager's bf16 roundings kept inside fused kernels), and the prefill probe.
source bench/calls/prelude.sh
M="python bench.py --what=mismatch --model=$B2 --seq=64 --batch=16 --new_tokens=64 --dtype=bfloat16 --compile=layers"
step mismatch_compiled 300 $M
step mismatch_emulated 200 env TORCHINDUCTOR_EMULATE_PRECISION_CASTS=1 $M
cd $O && cat log.txt mismatch_compiled.txt mismatch_emulated.txt | grep -v "^ *$" | cut -c1-200 | tail -30
