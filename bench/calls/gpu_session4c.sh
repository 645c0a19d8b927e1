#!/usr/bin/env bash
# The third H200 call of session 4 (2026-12-01): compile_layers on the whole bench_2b (5 kinds of layer), then the
# GPU tests of kernels_torch.py (inductor). Output: $OUT/log.txt
export PYTHONUNBUFFERED=1
B2=config/models/bench_2b.json
run() { echo "### $*"; timeout "$@" 2>&1 | grep -v "Loading weights" | grep -v -i "warn\|online softmax\|split the\|important use case\|softmax\.$\|^$\|originates\|rope_inv_freq\|^ *\^*$"; }
{
run 430 python bench.py --model=$B2 --seq=4096 --batch=1 --dtype=bfloat16 --steps=3 --warmup=1 --compile=layers
run 130 python -m pytest -q -x --tb=short tests/test_kernels.py -k "gpu or compile or graphs"
} > "${OUT:-/tmp}/log.txt" 2>&1
tail -c 11000 "${OUT:-/tmp}/log.txt"
