#!/usr/bin/env bash
# H200 call 1 of session 9 (2026-12-01): the probe of mHC's mixes and the vocabulary loss (bench/probe_hc_loss.py);
# the GPU tests that compile little (kernels, alignment, CUDA IPC) beside it; then bench_2b training with
# --compile=graphs (mHC's mixes on tensor cores, the GRPO loss compiled) from a cold inductor cache, with the profile
# of one step. The cache comes back as $OUT/ind.txz.* for the next calls. Output: $OUT/log*.txt
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind/inductor TRITON_CACHE_DIR=/tmp/ind/triton
O=${OUT:-/tmp}
mkdir -p /tmp/ind
B2=config/models/bench_2b.json
drop() { grep -v "Loading weights" | grep -v -i "warn\|online softmax\|split the\|important use case\|softmax\.$\|^$\|originates\|rope_inv_freq\|^ *\^*$\|File \"/work\|^E1201"; }
{ nvidia-smi -L; git log -1 --oneline; git status --short | head; } > $O/log.txt
( date +%T; timeout 150 python bench/probe_hc_loss.py 2>&1 | drop; date +%T ) > $O/log_probe.txt 2>&1
( date +%T; timeout 240 python -m pytest -q -x tests/test_kernels.py tests/test_alignment.py tests/test_tensor_sync.py -k "cuda or gpu or hc_mixes or fast or ipc" 2>&1 | tail -15; date +%T ) > $O/log_test.txt 2>&1 &
( date +%T; timeout 420 python bench.py --model=$B2 --seq=4096 --batch=1 --dtype=bfloat16 --steps=10 --warmup=3 --compile=graphs --profile 2>&1 | drop; date +%T ) > $O/log_train.txt 2>&1
wait
tar c -C /tmp/ind . | xz -2 -T16 | split -b 15M - $O/ind.txz.
cat $O/log.txt $O/log_probe.txt $O/log_test.txt; cut -c1-100,190-270 $O/log_train.txt | head -c 7000; ls -la $O
