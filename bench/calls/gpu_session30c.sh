#!/usr/bin/env bash
# Session 30, call 3: call 1's code (hc_pre's two programs a token) plus the router's GEMM inside its kernel
# (kernels_route.gate_triton, for a decode step's few tokens), the experts' kernels reading the counts (the prefix
# sum inside, where it was an inductor kernel), and the decode attention's key loops ending at each sequence's last
# visible entry (call 2's look-ahead of the keep dropped: slower). The GPU tests of those, then decode at batch 64
# with the trace.
source bench/calls/prelude.sh
step tests 240 python -m pytest -q -p no:cacheprovider tests/test_routing_kernels.py tests/test_decode_kernels.py tests/test_decode_attention.py tests/test_kernels_engine.py
step decode64 400 python bench.py --what=decode --model=$B2 --seq=32 --batch=64 --new_tokens=1024 --dtype=bfloat16 --compile=layers --no_peer --profile --trace=$O/dtrace.json
step summary 20 python bench/trace_summary.py $O/dtrace.json --top=30 --per=4 --order=120:40
cd $O && cat log.txt tests.txt decode64.txt summary.txt > results.txt && rm -f dtrace*.json; tar c *.raw | xz > logs.tar.xz && rm -f *.raw
grep -v "^ *$" results.txt | grep -v "^ *-\+" | grep -v "^ *nvjet\|^ *triton_\|Memset\|^ *aten::\|^ *void \|^ *cuda\|^ *Cuda\|^ *_ZN\|^ *Compiled\|^ *sm80\|^ *_sinkhorn\|^ *Name  \|^ *_[a-z_]* *0.00%\|Memcpy\|^ *[0-9.]* us after\|^  *[0-9.]* us  *[0-9.]* us" | cut -c1-180 | head -70
