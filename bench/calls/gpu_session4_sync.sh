#!/usr/bin/env bash
# The weight-sync rows on the one-GPU H200 machine (session 4), one device call of at most 300 s: the CUDA IPC test
# (a server subprocess on the same GPU), then bench.py --what=sync (disk and tensor; the distributed rows need a
# second GPU and are skipped with the reason printed). Output: $OUT/log.txt
export PYTHONUNBUFFERED=1
run() { echo "### $*"; timeout "$@" 2>&1 | grep -v "Loading weights"; }
{
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"
git log --oneline -1 2>/dev/null
run 80 python -m pytest -q -x --tb=short tests/test_tensor_sync.py -k cuda
run 200 python bench.py --what=sync --model=config/models/bench_2b.json --dtype=bfloat16 --layers=2
} > "${OUT:-/tmp}/log.txt" 2>&1
tail -c 11000 "${OUT:-/tmp}/log.txt"
