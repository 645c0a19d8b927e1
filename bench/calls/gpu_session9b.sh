#!/usr/bin/env bash
# H200 call 2 of session 9 (2026-12-01), with call 1's inductor cache (.ind): the probe of mHC's mixes and the
# vocabulary loss; the GPU tests of call 1 again (the mixes' test had asked the tensor cores for the FFMA's
# accuracy); then bench_2b decode at batch 64 (mHC's mixes on tensor cores there too). Output: $OUT/log*.txt
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind/inductor TRITON_CACHE_DIR=/tmp/ind/triton
O=${OUT:-/tmp}
mkdir -p /tmp/ind && cat .ind/ind.txz.* | xz -d | tar x -C /tmp/ind
B2=config/models/bench_2b.json
drop() { grep -v "Loading weights" | grep -v -i "warn\|online softmax\|split the\|important use case\|softmax\.$\|^$\|originates\|rope_inv_freq\|^ *\^*$\|File \"/work\|^E1201"; }
{ nvidia-smi -L; git log -1 --oneline; git status --short | head; } > $O/log.txt
( date +%T; timeout 120 python bench/probe_hc_loss.py 2>&1 | drop; date +%T ) > $O/log_probe.txt 2>&1
( date +%T; timeout 150 python -m pytest -q tests/test_kernels.py tests/test_alignment.py tests/test_tensor_sync.py -k "cuda or gpu or hc_mixes or fast or ipc" 2>&1 | tail -8; date +%T ) > $O/log_test.txt 2>&1
( date +%T; timeout 390 python bench.py --what=decode --model=$B2 --seq=32 --batch=64 --new_tokens=1024 --dtype=bfloat16 --compile=layers 2>&1 | drop; date +%T ) > $O/log_decode.txt 2>&1
tar c -C /tmp/ind . | xz -2 -T16 | split -b 15M - $O/ind.txz.
cat $O/log.txt $O/log_probe.txt $O/log_test.txt; cut -c1-160 $O/log_decode.txt | head -c 5000
