#!/usr/bin/env bash
# The third H200 call of session 7 (2026-12-01): the decode after the Sinkhorn loop became per-entry pointwise work
# under compile (model_dsv4.sinkhorn_entries) and the sampler compiled (engine.sample_tokens): GPU tests of both
# (inductor), then the compiled decode at batch 64 with the profile of its step. Output: $OUT/log*.txt
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind/inductor TRITON_CACHE_DIR=/tmp/ind/triton
O=${OUT:-/tmp}
mkdir -p /tmp/ind && cat .ind/ind.txz.* | xz -d | tar x -C /tmp/ind
B2=config/models/bench_2b.json
drop() { grep -v "Loading weights" | grep -v -i "warn\|online softmax\|split the\|important use case\|softmax\.$\|^$\|originates\|rope_inv_freq\|^ *\^*$\|File \"/work"; }
{ nvidia-smi -L; git log -1 --oneline; git status --short | head; } > $O/log.txt
( date +%T; timeout 400 python -m pytest -q tests/test_compile.py -k "sampler or decode" 2>&1 | tail -4; date +%T ) > $O/log_test.txt 2>&1 &
( date +%T; timeout 540 python bench.py --what=decode --model=$B2 --seq=32 --batch=64 --new_tokens=1024 --dtype=bfloat16 --compile=layers --profile 2>&1 | drop; date +%T ) > $O/log_decode.txt 2>&1
wait
cat $O/log.txt $O/log_test.txt; cut -c1-90,180-260 $O/log_decode.txt | head -c 7000
