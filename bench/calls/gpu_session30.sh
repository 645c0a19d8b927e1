#!/usr/bin/env bash
# Session 30, call 1: the --invariant fix of session 29 on the GPU (0.079 there before it: the rope_angles op's cos
# and sin outside kernels_torch.PathInvariant), the alignment and hc_pre tests on cuda; hc_pre's second kernel as two
# programs a token (the Sinkhorn beside the weighted sum) and the combine's K adds fused into hc_post (compiled):
# the probe, and decode at batch 64 with its trace.
source bench/calls/prelude.sh
step tests 240 python -m pytest -q -p no:cacheprovider tests/test_alignment.py tests/test_triton.py -k "invariant or hc_pre"
step mismatch_inv 200 python bench.py --what=mismatch --model=$B2 --seq=64 --batch=16 --new_tokens=64 --dtype=bfloat16 --invariant
step probe_hc 120 python bench/probe_hc_pre.py
step decode64 400 python bench.py --what=decode --model=$B2 --seq=32 --batch=64 --new_tokens=1024 --dtype=bfloat16 --compile=layers --no_peer --profile --trace=$O/dtrace.json
step summary 20 python bench/trace_summary.py $O/dtrace.json --top=30 --per=4 --order=120:40
cd $O && cat log.txt tests.txt mismatch_inv.txt probe_hc.txt decode64.txt summary.txt > results.txt && rm -f dtrace*.json; tar c *.raw | xz > logs.tar.xz && rm -f *.raw
grep -v "^ *$" results.txt | grep -v "^ *-\+" | grep -v "^ *nvjet\|^ *triton_\|Memset\|^ *aten::\|^ *void \|^ *cuda\|^ *Cuda\|^ *_ZN\|^ *Compiled\|^ *sm80\|^ *_sinkhorn\|^ *Name  \|^ *_[a-z_]* *0.00%\|Memcpy\|^ *[0-9.]* us after" | cut -c1-180 | head -120
