#!/usr/bin/env bash
# The fourth H200 call of session 4 (2026-12-01): the GPU tests of kernels_torch.py and the tensor transport, then decode
# at batch 256 with compile_layers (the decode step of each kind of layer compiled, inside the CUDA graphs).
export PYTHONUNBUFFERED=1
B2=config/models/bench_2b.json
run() { echo "### $*"; timeout "$@" 2>&1 | grep -v "Loading weights" | grep -v -i "warn\|online softmax\|split the\|important use case\|softmax\.$\|^$\|originates\|rope_inv_freq\|^ *\^*$"; }
{
run 150 python -m pytest -q --tb=short tests/test_kernels.py -k "gpu or compile or graphs or stacked"
run 380 python bench.py --what=decode --model=$B2 --seq=32 --batch=256 --new_tokens=1024 --dtype=bfloat16 --compile=layers
} > "${OUT:-/tmp}/log.txt" 2>&1
tail -c 11000 "${OUT:-/tmp}/log.txt"
