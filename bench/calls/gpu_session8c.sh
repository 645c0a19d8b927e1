#!/usr/bin/env bash
# H200 call 3 of session 8 (2026-12-01): call 2 again (both runs were cut by their timeouts with nothing printed),
# with bench.py decode printing each side as it is measured; batch 64 first with the whole call's time, batch 256
# with what is left; SIGINT at the timeout, so a cut run shows where it was. Output: $OUT/log*.txt
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind/inductor TRITON_CACHE_DIR=/tmp/ind/triton
O=${OUT:-/tmp}
mkdir -p /tmp/ind && cat .ind/ind.txz.* | xz -d | tar x -C /tmp/ind
B2=config/models/bench_2b.json
drop() { grep -v "Loading weights" | grep -v -i "warn\|online softmax\|split the\|important use case\|softmax\.$\|^$\|originates\|rope_inv_freq\|^ *\^*$\|^E1201"; }
{ nvidia-smi -L; git log -1 --oneline; git status --short | head; } > $O/log.txt
end=$((SECONDS + 545))
for b in 64 256; do
  left=$((end - SECONDS)); [ $left -lt 60 ] && break
  ( date +%T; timeout -s INT $left python bench.py --what=decode --model=$B2 --seq=32 --batch=$b \
      --new_tokens=1024 --dtype=bfloat16 --compile=layers $([ $b = 64 ] && echo --profile) 2>&1 | drop; date +%T ) > $O/log_decode$b.txt 2>&1
done
cat $O/log.txt; for f in $O/log_decode*.txt; do echo "== $f"; cut -c1-110,190-250 $f | head -c 7000; done
