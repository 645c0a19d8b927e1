#!/usr/bin/env bash
# H200 call 4 of session 9 (2026-12-01): mHC's mixes with the parts cut instead of rounded (kernels_torch.split_bf16), so
# that inductor cannot drop them: their tests on the GPU (eager and compiled), and the probe at 4096 tokens, both
# forms compiled as CUDA graphs. Output: $OUT/log*.txt
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp}
drop() { grep -v -i "warn\|^$\|^ *\^*$\|File \"/work"; }
{ nvidia-smi -L; git log -1 --oneline; git status --short | head; } > $O/log.txt
( date +%T; timeout 60 python -m pytest -q -p no:cacheprovider tests/test_kernels.py -k "split or hc_mixes" 2>&1 | tail -3; date +%T ) > $O/log_test.txt 2>&1
( date +%T; timeout 140 python bench/probe_hc_loss.py hc 4096 2>&1 | drop; date +%T ) > $O/log_probe.txt 2>&1
cat $O/log.txt $O/log_test.txt $O/log_probe.txt
