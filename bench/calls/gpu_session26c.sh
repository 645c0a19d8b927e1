#!/usr/bin/env bash
# Session 26, call 3: hc_pre's second kernel reading its partials in shape (no store and reload of the mixes) with the
# weighted sum before the Sinkhorn, and the pairs' order comparing all of a step's pairs in one load: the kernels'
# GPU tests, the hc_pre probe with its variants, decode at batch 64 with its trace.
source bench/calls/prelude.sh
step tests 90 python -m pytest -q -p no:cacheprovider tests/test_triton.py tests/test_decode_kernels.py -k "hc_pre or route or pair_order or routing or compile_for or experts"
step hcpre 60 python bench/probe_hc_pre.py
step decode64 170 python bench.py --what=decode --model=$B2 --seq=32 --batch=64 --new_tokens=1024 --dtype=bfloat16 --compile=layers --no_peer --profile --trace=$O/dtrace.json
step summary 25 python bench/trace_summary.py $O/dtrace.json --top=25 --per=4 --order=120:60
cd $O && cat log.txt tests.txt hcpre.txt decode64.txt summary.txt > results.txt && rm -f dtrace*.json; tar c *.raw | xz > logs.tar.xz && rm -f *.raw decode64.txt
grep -v "^ *$" results.txt | grep -v "^ *-\+" | grep -v "^ *nvjet\|^ *triton_\|Memset\|^ *aten::\|^ *void \|^ *cuda\|^ *Cuda\|^ *_ZN\|^ *Compiled\|^ *[0-9.]* us \|^ *sm80\|^ *_sinkhorn\|^ *_hc_p\|^ *_decode_attn\|^ *_experts\|^ *_compress\|^ *_sample\|^ *_route\|^ *_pair\|^ *Name  " | head -120
