#!/usr/bin/env bash
# The second H200 call of session 4 (2026-12-01): weight sync on one GPU (bench/calls/gpu_session4_sync.sh), the
# mismatch with cuBLAS's bf16 split-K on and off, and compile_layers on the first 3 layers of bench_2b (2 kinds of
# layer: the whole model's 5 kinds did not compile inside 230 s in the first call). Output: $OUT/log.txt
export PYTHONUNBUFFERED=1
B2=config/models/bench_2b.json
run() { echo "### $*"; timeout "$@" 2>&1 | grep -v "Loading weights" | grep -v -i "warn\|online softmax\|split the\|important use case\|softmax\.$\|^$\|originates\|rope_inv_freq\|^ *\^*$"; }
{
git log -1 --format=%h 2>/dev/null
run 80 python -m pytest -q -x --tb=short tests/test_tensor_sync.py -k cuda
run 200 python bench.py --what=sync --model=$B2 --dtype=bfloat16 --layers=2
run 140 python bench.py --what=mismatch --model=$B2 --seq=64 --batch=16 --new_tokens=64 --dtype=bfloat16
run 150 python bench.py --model=$B2 --layers=3 --seq=4096 --batch=1 --dtype=bfloat16 --steps=3 --warmup=1 --compile=layers
} > "${OUT:-/tmp}/log.txt" 2>&1
tail -c 11000 "${OUT:-/tmp}/log.txt"
