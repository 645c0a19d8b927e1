#!/usr/bin/env bash
# Session 23, call 3: decode with the MoE's pairs counted, not sorted (model_dsv4.expert_order), on top of call 2's
# decode attention kernel: batch 64 with its trace, then batch 256 (not run since session 16).
source bench/calls/prelude.sh
step decode64 275 python bench.py --what=decode --model=$B2 --seq=32 --batch=64 --new_tokens=1024 --dtype=bfloat16 --compile=layers --profile --trace=$O/dtrace.json
step summary 25 python bench/trace_summary.py $O/dtrace.json --top=30 --per=4
step decode256 270 python bench.py --what=decode --model=$B2 --seq=32 --batch=256 --new_tokens=1024 --dtype=bfloat16 --compile=layers
cd $O && cat log.txt decode64.txt summary.txt decode256.txt > results.txt && xz -T4 dtrace.json; tar c *.raw | xz > logs.tar.xz && rm -f *.raw decode64.txt decode256.txt
grep -v "^ *$" results.txt | grep -v "^ *-\+" | grep -v "^ *nvjet\|^ *triton_\|Memset\|^ *aten::\|^ *void \|^ *cuda\|^ *Cuda\|^ *_ZN\|^ *Compiled\|^ *[0-9.]* us \|^ *sm80\|^ *_sinkhorn\|^ *_hc_post\|^ *_decode_attn" | head -60
