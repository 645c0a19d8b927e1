#!/usr/bin/env bash
# The second H200 call of session 7 (2026-12-01): with call 1's inductor cache (.ind/, both calls' entries), the
# compiled decode at batch 64 after the sampling change (one Gumbel-noise kernel set for the batch instead of a
# generator call per request), with the profile of the model's step (the replayed CUDA graph); then the profile of
# one compiled training step. Output: $OUT/log*.txt
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind/inductor TRITON_CACHE_DIR=/tmp/ind/triton
O=${OUT:-/tmp}
mkdir -p /tmp/ind && cat .ind/ind.txz.* | xz -d | tar x -C /tmp/ind
B2=config/models/bench_2b.json
drop() { grep -v "Loading weights" | grep -v -i "warn\|online softmax\|split the\|important use case\|softmax\.$\|^$\|originates\|rope_inv_freq\|^ *\^*$\|File \"/work"; }
{ nvidia-smi -L; git log -1 --oneline; git status --short | head; } > $O/log.txt
( date +%T; timeout 330 python bench.py --what=decode --model=$B2 --seq=32 --batch=64 --new_tokens=1024 --dtype=bfloat16 --compile=layers --profile 2>&1 | drop; date +%T ) > $O/log_decode.txt 2>&1
( date +%T; timeout 200 python bench.py --model=$B2 --seq=4096 --batch=1 --dtype=bfloat16 --steps=3 --warmup=2 --compile=layers --profile 2>&1 | drop; date +%T ) > $O/log_train.txt 2>&1
cat $O/log.txt; head -c 5000 $O/log_decode.txt; head -c 5000 $O/log_train.txt
