#!/usr/bin/env bash
# The third call of session 32's plan: inductor's emulate_precision_casts (keep eager's bf16 roundings inside fused
# kernels, which inductor otherwise drops) on the compiled engine's and trainer's numerics. The mismatch and the
# prefill probe with it, to set beside gpu_session32b.sh's runs without it. (Inductor's C++ backend failed to build
# the tiny prefill on the dev CPU in session 31, so this was not tried there.)
source bench/calls/prelude.sh
export TORCHINDUCTOR_EMULATE_PRECISION_CASTS=1
step mismatch_emulated 330 python bench.py --what=mismatch --model=$B2 --seq=64 --batch=16 --new_tokens=64 --dtype=bfloat16 --compile=layers
step probe_prefill 240 python bench/probe_prefill.py --compile
cd $O && cat log.txt mismatch_emulated.txt probe_prefill.txt | grep -v "^ *$" | grep -v "^ *-\+\|^ *aten::\|^ *void \|^ *cuda\|^ *triton_\|^ *nvjet" | cut -c1-200 | head -40
