#!/usr/bin/env bash
# The second H200 call of session 5 (2026-12-01): the path-invariant mode on the GPU (tests, then the mismatch
# bench with and without it), then the compiled training step's profile with the first call's inductor cache
# (carried in .ind/). Output: $OUT/log.txt
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind/inductor TRITON_CACHE_DIR=/tmp/ind/triton
mkdir -p /tmp/ind && { ls .ind/ind.tgz.* >/dev/null 2>&1 && cat .ind/ind.tgz.* | tar xz -C /tmp/ind; }
B2=config/models/bench_2b.json
run() { echo "### $*"; timeout "$@" 2>&1 | grep -v "Loading weights" | grep -v -i "warn\|online softmax\|split the\|important use case\|softmax\.$\|^$\|originates\|rope_inv_freq\|^ *\^*$\|File .*model_dsv4"; }
{
nvidia-smi -L; git log -1 --oneline; git status --short | head
run 120 python -m pytest -q --tb=short tests/test_kernels.py -k "invariant or graphs"
run 90 python bench.py --what=mismatch --model=$B2 --batch=16 --new_tokens=64 --dtype=bfloat16
run 200 python bench.py --what=mismatch --model=$B2 --batch=16 --new_tokens=64 --dtype=bfloat16 --invariant
run 260 python bench.py --model=$B2 --seq=4096 --batch=1 --dtype=bfloat16 --steps=3 --warmup=1 --compile=layers --profile
} > "${OUT:-/tmp}/log.txt" 2>&1
tail -c 6000 "${OUT:-/tmp}/log.txt"
