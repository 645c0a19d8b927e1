#!/usr/bin/env bash
# The second H200 call of session 6 (2026-12-01). Call 1 showed a cold compile of bench_2b's layers takes more than
# 290 s there. This call fills inductor's cache for both modes at once: the compiled training step as it is
# (--compile=layers) and, started 40 s later in a second process, the same step with torch.compile's
# mode="reduce-overhead" (CUDA graphs of each layer's forward and backward; a trial, by patching torch.compile).
# The two processes share the GPU and the CPUs, so their figures are rough; call 3 measures with the cache warm.
# Inductor's cache comes back as $OUT/ind.txz.*. Output: $OUT/log.txt, $OUT/graphs.txt
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind/inductor TRITON_CACHE_DIR=/tmp/ind/triton
O=${OUT:-/tmp}
B2=config/models/bench_2b.json
TRAIN="bench.py --model=$B2 --seq=4096 --batch=1 --dtype=bfloat16 --steps=8 --warmup=2 --compile=layers"
GRAPHS="import functools, runpy, sys, torch; torch.compile = functools.partial(torch.compile, mode='reduce-overhead'); sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
quiet() { grep -v "Loading weights" | grep -v -i "online softmax\|split the\|important use case\|softmax\.$\|^$\|originates\|rope_inv_freq\|lru_cache\|^ *\^*$\|File .*model_dsv4"; }
{
nvidia-smi -L; git log -1 --oneline; git status --short | head
date +%T; timeout 60 python -m pytest -q --tb=short tests/test_kernels.py "tests/test_alignment.py::test_path_invariant_engine_equals_trainer" 2>&1 | tail -5
date +%T; echo "### $TRAIN"
( sleep 40; date +%T; timeout 480 python -c "$GRAPHS" $TRAIN 2>&1 | quiet > $O/graphs.txt; date +%T >> $O/graphs.txt ) &
timeout 500 python $TRAIN 2>&1 | quiet
date +%T; wait; echo "### reduce-overhead:"; cat $O/graphs.txt
} > $O/log.txt 2>&1
tar c -C /tmp/ind . | xz -T16 -2 | split -b 15M - $O/ind.txz.
ls -la $O; du -sh /tmp/ind
tail -c 9000 $O/log.txt
