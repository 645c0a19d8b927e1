#!/usr/bin/env bash
# The fourth H200 call of session 7 (2026-12-01): call 3 again after the fix of the compiled sampler (call 3: Triton
# refused an int32 index times a 64-bit constant in the Gumbel hash). The sampler test first; if it fails, the
# sampler's compile is taken out here (said in the log) so that the decode figures still come. Output: $OUT/log*.txt
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind/inductor TRITON_CACHE_DIR=/tmp/ind/triton
O=${OUT:-/tmp}
mkdir -p /tmp/ind && cat .ind/ind.txz.* | xz -d | tar x -C /tmp/ind
B2=config/models/bench_2b.json
drop() { grep -v "Loading weights" | grep -v -i "warn\|online softmax\|split the\|important use case\|softmax\.$\|^$\|originates\|rope_inv_freq\|^ *\^*$\|File \"/work\|^E1201"; }
{ nvidia-smi -L; git log -1 --oneline; git status --short | head
  date +%T; timeout 150 python -m pytest -q tests/test_compile.py -k sampler 2>&1 | grep -i "passed\|failed\|Error:" | head -5; } > $O/log.txt 2>&1
if ! grep -q "1 passed" $O/log.txt; then
  sed -i '/engine.sample_tokens = torch.compile/d' kernels_torch.py; echo "### sampler compile taken out for this run" >> $O/log.txt
fi
( date +%T; timeout 300 python -m pytest -q tests/test_compile.py -k decode 2>&1 | grep -i "passed\|failed\|Error:" | head -5; date +%T ) > $O/log_test.txt 2>&1 &
( date +%T; timeout 480 python bench.py --what=decode --model=$B2 --seq=32 --batch=64 --new_tokens=1024 --dtype=bfloat16 --compile=layers --profile 2>&1 | drop; date +%T ) > $O/log_decode.txt 2>&1
wait
cat $O/log.txt $O/log_test.txt; cut -c1-90,180-260 $O/log_decode.txt | head -c 7000
