#!/usr/bin/env bash
# The H200 runs behind bench/RESULTS.md (2026-11-29, session 3), in one device call. Output: $OUT/log.txt
export PYTHONUNBUFFERED=1
B2=config/models/bench_2b.json
run() { echo "### $*"; timeout "$@" 2>&1 | grep -v "Loading weights"; }
{
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
run 150 python -m pytest -q -x --tb=short tests/test_kernels.py
run 120 python bench.py --model=$B2 --seq=4096 --batch=1 --dtype=bfloat16 --steps=5
run 150 python bench.py --model=$B2 --seq=4096 --batch=1 --dtype=bfloat16 --steps=5 --compile
run 90 python bench.py --what=mismatch --model=$B2 --seq=64 --batch=16 --new_tokens=64 --dtype=bfloat16
run 90 python bench.py --what=decode --model=$B2 --seq=32 --batch=64 --new_tokens=16 --dtype=bfloat16 --profile
run 280 python bench.py --what=decode --model=$B2 --seq=32 --batch=256 --new_tokens=1024 --dtype=bfloat16
} > "${OUT:-/tmp}/log.txt" 2>&1
tail -c 11000 "${OUT:-/tmp}/log.txt"
