#!/usr/bin/env bash
# The first H200 call of session 7 (2026-12-01): diagnosis. In parallel: the CUDA-graph compile test (SMALL, cold),
# the compiled decode at batch 64 with its profile and the model-step-alone time (cold decode compile), and the
# profile of one compiled training step of bench_2b (warm cache from session 6). New inductor cache entries come
# back as $OUT/ind2.txz.*. Output: $OUT/log*.txt
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind/inductor TRITON_CACHE_DIR=/tmp/ind/triton
O=${OUT:-/tmp}
mkdir -p /tmp/ind && cat .ind/ind.txz.* | xz -d | tar x -C /tmp/ind
touch /tmp/marker; sleep 1
B2=config/models/bench_2b.json
drop() { grep -v "Loading weights" | grep -v -i "warn\|online softmax\|split the\|important use case\|softmax\.$\|^$\|originates\|rope_inv_freq\|^ *\^*$"; }
{ nvidia-smi -L; git log -1 --oneline; git status --short | head; } > $O/log.txt
( date +%T; timeout 480 python -m pytest -x -q tests/test_compile.py -k graphs 2>&1 | tail -15; date +%T ) > $O/log_test.txt 2>&1 &
( date +%T; timeout 500 python bench.py --what=decode --model=$B2 --seq=32 --batch=64 --new_tokens=512 --dtype=bfloat16 --compile=layers --profile 2>&1 | drop; date +%T ) > $O/log_decode.txt 2>&1 &
( date +%T; timeout 300 python bench.py --model=$B2 --seq=4096 --batch=1 --dtype=bfloat16 --steps=3 --warmup=2 --compile=layers --profile 2>&1 | drop; date +%T ) > $O/log_train.txt 2>&1
wait
cd /tmp/ind && find . -type f -newer /tmp/marker | tar cf - -T - | xz -T16 -3 | split -b 15M - $O/ind2.txz.
ls -la $O >> $O/log.txt
cat $O/log.txt; tail -c 2500 $O/log_test.txt; tail -c 6000 $O/log_decode.txt
