#!/usr/bin/env bash
# H200 call 2 of session 8 (2026-12-01): decode with the overlapped step (engine.Engine.step) at batch 64 (with the
# profile of the replayed model step) and at batch 256, 1024 new tokens, transformers' generate in the same
# process each time; call 1's inductor cache unpacked first. Output: $OUT/log*.txt
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind/inductor TRITON_CACHE_DIR=/tmp/ind/triton
O=${OUT:-/tmp}
mkdir -p /tmp/ind && cat .ind/ind.txz.* | xz -d | tar x -C /tmp/ind
B2=config/models/bench_2b.json
drop() { grep -v "Loading weights" | grep -v -i "warn\|online softmax\|split the\|important use case\|softmax\.$\|^$\|originates\|rope_inv_freq\|^ *\^*$\|File \"/work\|^E1201"; }
{ nvidia-smi -L; git log -1 --oneline; git status --short | head; } > $O/log.txt
for b in 64 256; do
  p=$([ $b = 64 ] && echo --profile)
  ( date +%T; timeout $([ $b = 64 ] && echo 270 || echo 280) python bench.py --what=decode --model=$B2 --seq=32 --batch=$b \
      --new_tokens=1024 --dtype=bfloat16 --compile=layers $p 2>&1 | drop; date +%T ) > $O/log_decode$b.txt 2>&1
done
cat $O/log.txt; for f in $O/log_decode*.txt; do echo "== $f"; cut -c1-110,190-250 $f | head -c 6000; done
