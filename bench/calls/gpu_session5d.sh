#!/usr/bin/env bash
# The fourth H200 call of session 5 (2026-12-01): the compiled training step with the first call's inductor cache
# (carried in .ind/), run twice in two processes: the figure from a warm cache and how much it moves.
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind/inductor TRITON_CACHE_DIR=/tmp/ind/triton
mkdir -p /tmp/ind && { ls .ind/ind.tgz.* >/dev/null 2>&1 && cat .ind/ind.tgz.* | tar xz -C /tmp/ind; }
B2=config/models/bench_2b.json
run() { echo "### $*"; timeout "$@" 2>&1 | grep -v "Loading weights" | grep -v -i "warn\|online softmax\|split the\|important use case\|softmax\.$\|^$\|originates\|rope_inv_freq\|^ *\^*$\|File .*model_dsv4"; }
{
nvidia-smi -L; git log -1 --oneline; git status --short | head
for i in 1 2; do
  date +%T; run 200 python bench.py --model=$B2 --seq=4096 --batch=1 --dtype=bfloat16 --steps=8 --warmup=2 --compile=layers
done; date +%T
} > "${OUT:-/tmp}/log.txt" 2>&1
cat "${OUT:-/tmp}/log.txt"
