#!/usr/bin/env bash
# The first H200 call of session 6 (2026-12-01): hc_post's stream mix as a sum over streams (probe, then the
# compiled training step from a cold cache), then the same step with the layers compiled in mode="reduce-overhead"
# (CUDA graphs of each layer's forward and backward, a trial by patching torch.compile), then the GPU tests of the
# alignment and kernels files. Inductor's cache comes back in $OUT/ind.tgz.* for the next call. Output: $OUT/log.txt
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind/inductor TRITON_CACHE_DIR=/tmp/ind/triton
mkdir -p /tmp/ind && { ls .ind/ind.tgz.* >/dev/null 2>&1 && cat .ind/ind.tgz.* | tar xz -C /tmp/ind; }
B2=config/models/bench_2b.json
run() { echo "### $*"; timeout "$@" 2>&1 | grep -v "Loading weights" | grep -v -i "warn\|online softmax\|split the\|important use case\|softmax\.$\|^$\|originates\|rope_inv_freq\|^ *\^*$\|File .*model_dsv4"; }
TRAIN="bench.py --model=$B2 --seq=4096 --batch=1 --dtype=bfloat16 --steps=8 --warmup=2 --compile=layers"
GRAPHS="import functools, runpy, sys, torch; torch.compile = functools.partial(torch.compile, mode='reduce-overhead'); sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
{
nvidia-smi -L; git log -1 --oneline; git status --short | head
date +%T; run 90 python bench/probe_hc_post.py
date +%T; run 290 python $TRAIN
date +%T; run 170 python -c "$GRAPHS" $TRAIN
date +%T; run 60 python -m pytest -q --tb=short -x tests/test_kernels.py "tests/test_alignment.py::test_path_invariant_engine_equals_trainer"
date +%T
} > "${OUT:-/tmp}/log.txt" 2>&1
tar cz -C /tmp/ind . | split -b 15M - "${OUT:-/tmp}/ind.tgz."
ls -la "${OUT:-/tmp}"
tail -c 8000 "${OUT:-/tmp}/log.txt"
