#!/usr/bin/env bash
# Session 29, call 4: call 3's code (the shared expert inside the routed experts' kernels) plus the decode
# attention's mask worked out inside its kernels (from the window's positions and each sequence's; the indexer's
# picks passed in). The GPU tests of the decode kernels and the engine; decode at batch 64 against transformers with
# the trace; decode at batch 256, ours only.
source bench/calls/prelude.sh
step tests 200 python -m pytest -q -p no:cacheprovider tests/test_decode_attention.py tests/test_decode_kernels.py tests/test_kernels_engine.py -k "attention or experts or cuda_graphs or fused"
step decode64 400 python bench.py --what=decode --model=$B2 --seq=32 --batch=64 --new_tokens=1024 --dtype=bfloat16 --compile=layers --profile --trace=$O/dtrace.json
step summary 20 python bench/trace_summary.py $O/dtrace.json --top=30 --per=4 --order=120:40
step decode256 200 python bench.py --what=decode --model=$B2 --seq=32 --batch=256 --new_tokens=1024 --dtype=bfloat16 --compile=layers --no_peer
cd $O && cat log.txt tests.txt decode64.txt summary.txt decode256.txt > results.txt && rm -f dtrace*.json; tar c *.raw | xz > logs.tar.xz && rm -f *.raw
grep -v "^ *$" results.txt | grep -v "^ *-\+" | grep -v "^ *nvjet\|^ *triton_\|Memset\|^ *aten::\|^ *void \|^ *cuda\|^ *Cuda\|^ *_ZN\|^ *Compiled\|^ *sm80\|^ *_sinkhorn\|^ *Name  \|^ *_[a-z_]* *0.00%\|Memcpy\|^ *[0-9.]* us after" | cut -c1-180 | head -90
