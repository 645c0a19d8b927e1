#!/usr/bin/env bash
# The first H200 call of session 4 (2026-12-01): whole-layer compile (kernels_torch.compile_layers), train and decode,
# and the mismatch with cuBLAS's bf16 split-K on and off. Output: $OUT/log.txt
export PYTHONUNBUFFERED=1
B2=config/models/bench_2b.json
run() { echo "### $*"; timeout "$@" 2>&1 | grep -v "Loading weights" | grep -v -i "warn\|online softmax\|split the\|important use case\|softmax\.$\|^$\|originates\|rope_inv_freq\|^ *\^*$"; }
{
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; git log -1 --format=%h 2>/dev/null
run 230 python bench.py --model=$B2 --seq=4096 --batch=1 --dtype=bfloat16 --steps=5 --compile=layers --profile
run 250 python bench.py --what=decode --model=$B2 --seq=32 --batch=256 --new_tokens=1024 --dtype=bfloat16 --compile=layers
run 60 python bench.py --what=mismatch --model=$B2 --seq=64 --batch=16 --new_tokens=64 --dtype=bfloat16
} > "${OUT:-/tmp}/log.txt" 2>&1
tail -c 11000 "${OUT:-/tmp}/log.txt"
