#!/usr/bin/env bash
# The second H200 call behind bench/RESULTS.md (2026-11-29, session 3). Output: $OUT/log.txt
export PYTHONUNBUFFERED=1
B2=config/models/bench_2b.json
run() { echo "### $*"; timeout "$@" 2>&1 | grep -v "Loading weights" | grep -v -i "warn\|online softmax\|split the\|important use case\|softmax\.$\|^$"; }
{
run 120 python -m pytest -q -x --tb=short tests/test_kernels.py
run 200 python bench.py --what=decode --model=$B2 --seq=32 --batch=64 --new_tokens=1024 --dtype=bfloat16 --compile
run 200 python bench.py --what=decode --model=$B2 --seq=32 --batch=256 --new_tokens=1024 --dtype=bfloat16 --compile
} > "${OUT:-/tmp}/log.txt" 2>&1
tail -c 11000 "${OUT:-/tmp}/log.txt"
