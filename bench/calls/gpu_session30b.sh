#!/usr/bin/env bash
# Session 30, call 2: call 1's code (hc_pre's second kernel as two programs a token; the combine's fusion dropped)
# plus the decode attention's key loops bounded by each sequence's visible entries, each block's keep loaded a block
# ahead. Its tests on cuda, the attention probe, decode at batch 64 with the trace.
source bench/calls/prelude.sh
step tests 200 python -m pytest -q -p no:cacheprovider tests/test_decode_attention.py
step probe_attn 200 python bench/probe_decode_attn.py
step decode64 400 python bench.py --what=decode --model=$B2 --seq=32 --batch=64 --new_tokens=1024 --dtype=bfloat16 --compile=layers --no_peer --profile --trace=$O/dtrace.json
step summary 20 python bench/trace_summary.py $O/dtrace.json --top=30 --per=4 --order=120:40
cd $O && cat log.txt tests.txt probe_attn.txt decode64.txt summary.txt > results.txt && rm -f dtrace*.json; tar c *.raw | xz > logs.tar.xz && rm -f *.raw
grep -v "^ *$" results.txt | grep -v "^ *-\+" | grep -v "^ *nvjet\|^ *triton_\|Memset\|^ *aten::\|^ *void \|^ *cuda\|^ *Cuda\|^ *_ZN\|^ *Compiled\|^ *sm80\|^ *_sinkhorn\|^ *Name  \|^ *_[a-z_]* *0.00%\|Memcpy\|^ *[0-9.]* us after\|^  *[0-9.]* us  *[0-9.]* us" | cut -c1-180 | head -80
