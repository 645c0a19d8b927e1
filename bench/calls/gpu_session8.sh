#!/usr/bin/env bash
# H200 call 1 of session 8 (2026-12-01): bench_2b training with --compile=graphs, the Sinkhorn's per-entry form
# now for compiled code without autograd only, from a cold inductor cache, with the profile of one step; the cache
# comes back as $OUT/ind.txz.* for the next calls. Output: $OUT/log*.txt
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind/inductor TRITON_CACHE_DIR=/tmp/ind/triton
O=${OUT:-/tmp}
mkdir -p /tmp/ind
B2=config/models/bench_2b.json
drop() { grep -v "Loading weights" | grep -v -i "warn\|online softmax\|split the\|important use case\|softmax\.$\|^$\|originates\|rope_inv_freq\|^ *\^*$\|File \"/work\|^E1201"; }
{ nvidia-smi -L; git log -1 --oneline; git status --short | head; } > $O/log.txt
( date +%T; timeout 530 python bench.py --model=$B2 --seq=4096 --batch=1 --dtype=bfloat16 --steps=10 --warmup=3 --compile=graphs --profile 2>&1 | drop; date +%T ) > $O/log_train.txt 2>&1
tar c -C /tmp/ind . | xz -2 -T16 | split -b 15M - $O/ind.txz.
cat $O/log.txt; cut -c1-100,190-270 $O/log_train.txt | head -c 9000; ls -la $O
