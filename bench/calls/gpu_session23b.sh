#!/usr/bin/env bash
# Session 23, call 2: the decode attention kernel (kernels_triton.decode_attention_triton) and decode's inline RoPE
# angles: the Triton tests and the engine's CUDA-graph test on the GPU, then decode at batch 64 with its trace.
source bench/calls/prelude.sh
step tests 150 python -m pytest -q -p no:cacheprovider tests/test_triton.py tests/test_kernels_engine.py -k "triton or cuda_graphs" -v
step decode 400 python bench.py --what=decode --model=$B2 --seq=32 --batch=64 --new_tokens=1024 --dtype=bfloat16 --compile=layers --profile --trace=$O/dtrace.json
step summary 30 python bench/trace_summary.py $O/dtrace.json --top=40 --per=4 --order=0:400
cd $O && cat log.txt tests.txt decode.txt summary.txt > results.txt && xz -T4 dtrace.json; tar c *.raw | xz > logs.tar.xz && rm -f *.raw tests.txt decode.txt
grep -v "^ *$" results.txt | grep -v "^ *-\+" | grep -v "^ *nvjet\|^ *triton_\|Memset\|^ *aten::\|^ *void \|^ *cuda\|^ *Cuda\|^ *_ZN\|^ *Compiled\|^ *[0-9.]* us \|^ *sm80\|^ *_sinkhorn\|^ *_hc_post" | head -70
