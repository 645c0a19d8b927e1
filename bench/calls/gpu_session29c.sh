#!/usr/bin/env bash
# Session 29, call 3. Call 2 had the shared expert as one program a column block, which ran its 64 rows one block
# after another and finished last (104 us a layer for the two kernels, 80 without it). Here its rows are in blocks,
# a program each, launched first. The GPU tests of the experts and the engine, then decode at batch 64 with its trace.
source bench/calls/prelude.sh
step tests 200 python -m pytest -q -p no:cacheprovider tests/test_decode_kernels.py tests/test_kernels_engine.py -k "experts or cuda_graphs or fused"
step decode64 300 python bench.py --what=decode --model=$B2 --seq=32 --batch=64 --new_tokens=1024 --dtype=bfloat16 --compile=layers --no_peer --profile --trace=$O/dtrace.json
step summary 20 python bench/trace_summary.py $O/dtrace.json --top=30 --per=4 --order=120:40
cd $O && cat log.txt tests.txt decode64.txt summary.txt > results.txt && rm -f dtrace*.json; tar c *.raw | xz > logs.tar.xz && rm -f *.raw
grep -v "^ *$" results.txt | grep -v "^ *-\+" | grep -v "^ *nvjet\|^ *triton_\|Memset\|^ *aten::\|^ *void \|^ *cuda\|^ *Cuda\|^ *_ZN\|^ *Compiled\|^ *sm80\|^ *_sinkhorn\|^ *Name  \|^ *_[a-z_]* *0.00%\|Memcpy\|^ *[0-9.]* us after" | cut -c1-180 | head -80
