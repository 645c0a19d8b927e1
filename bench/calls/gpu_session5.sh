#!/usr/bin/env bash
# The first H200 call of session 5 (2026-12-01): where the time goes. Profiles of one training step of bench_2b
# (eager fast kernels, then compile_layers) and of eager decode steps at batch 64; inductor's cache comes back
# in $OUT (ind.tgz.*) for the next call. Output: $OUT/log.txt
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind/inductor TRITON_CACHE_DIR=/tmp/ind/triton
mkdir -p /tmp/ind && { ls .ind/ind.tgz.* >/dev/null 2>&1 && cat .ind/ind.tgz.* | tar xz -C /tmp/ind; }
B2=config/models/bench_2b.json
run() { echo "### $*"; timeout "$@" 2>&1 | grep -v "Loading weights" | grep -v -i "warn\|online softmax\|split the\|important use case\|softmax\.$\|^$\|originates\|rope_inv_freq\|^ *\^*$"; }
{
nvidia-smi -L; git log -1 --oneline
run 120 python bench.py --model=$B2 --seq=4096 --batch=1 --dtype=bfloat16 --steps=3 --warmup=1 --profile
run 100 python bench.py --what=decode --model=$B2 --seq=32 --batch=64 --new_tokens=64 --dtype=bfloat16 --profile
run 330 python bench.py --model=$B2 --seq=4096 --batch=1 --dtype=bfloat16 --steps=3 --warmup=1 --compile=layers --profile
} > "${OUT:-/tmp}/log.txt" 2>&1
tar czf - -C /tmp/ind . | split -b 15M - "${OUT:-/tmp}/ind.tgz."
ls -la "${OUT:-/tmp}"
tail -c 3000 "${OUT:-/tmp}/log.txt"
