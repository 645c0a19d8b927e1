#!/usr/bin/env bash
# The third H200 call of session 6 (2026-12-01): with call 2's inductor cache (carried in .ind/), the compiled
# training step (--compile=layers, hc_post as a sum over streams) and the same with torch.compile's
# mode="reduce-overhead" (a trial by patching torch.compile; bench.py marks each step's start for it), alternated,
# two processes each. Output: $OUT/log.txt
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind/inductor TRITON_CACHE_DIR=/tmp/ind/triton
O=${OUT:-/tmp}
mkdir -p /tmp/ind && cat .ind/ind.txz.* | xz -d | tar x -C /tmp/ind
B2=config/models/bench_2b.json
TRAIN="bench.py --model=$B2 --seq=4096 --batch=1 --dtype=bfloat16 --steps=10 --warmup=3 --compile=layers"
GRAPHS="import functools, runpy, sys, torch; torch.compile = functools.partial(torch.compile, mode='reduce-overhead'); sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
keep() { grep -i "tokens/s\|ratio\|cudagraph\|error\|Traceback" | grep -v "^ *warnings.warn"; }
{
nvidia-smi -L; git log -1 --oneline; git status --short | head
for i in 1 2; do
  date +%T; echo "### layers"; timeout 140 python $TRAIN 2>&1 | keep
  date +%T; echo "### layers, reduce-overhead"; timeout 140 python -c "$GRAPHS" $TRAIN 2>&1 | keep
done; date +%T
} > $O/log.txt 2>&1
cat $O/log.txt
