#!/usr/bin/env bash
# The third H200 call of session 5 (2026-12-01): mHC's narrow fp32 GEMM split over K (probe, GPU test), then the
# compiled training step with it (inductor cache of the earlier calls carried in .ind/). Output: $OUT/log.txt
# The split-K change (kernels_torch.linear_split_k) was reverted after this call, and the probe made self-contained (the
# same GEMMs): bench/RESULTS.md says why.
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind/inductor TRITON_CACHE_DIR=/tmp/ind/triton
mkdir -p /tmp/ind && { ls .ind/ind.tgz.* >/dev/null 2>&1 && cat .ind/ind.tgz.* | tar xz -C /tmp/ind; }
B2=config/models/bench_2b.json
run() { echo "### $*"; timeout "$@" 2>&1 | grep -v "Loading weights" | grep -v -i "warn\|online softmax\|split the\|important use case\|softmax\.$\|^$\|originates\|rope_inv_freq\|^ *\^*$\|File .*model_dsv4"; }
{
nvidia-smi -L; git log -1 --oneline; git status --short | head
run 60 python bench/probe_hc_gemm.py
run 60 python -m pytest -q --tb=short tests/test_kernels.py -k "split_k"
run 420 python bench.py --model=$B2 --seq=4096 --batch=1 --dtype=bfloat16 --steps=5 --warmup=2 --compile=layers
} > "${OUT:-/tmp}/log.txt" 2>&1
tail -c 6000 "${OUT:-/tmp}/log.txt"
