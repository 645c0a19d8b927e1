#!/usr/bin/env bash
# Session 24, call 2: the decode step's routed experts as Triton kernels (kernels_triton.experts_triton): the GPU
# tests, batch 64 with its trace, batch 256, and the trainer/engine mismatch (the engine's experts now Triton's).
source bench/calls/prelude.sh
step tests 150 python -m pytest -q -p no:cacheprovider tests/test_triton.py tests/test_kernels_engine.py -k "triton or cuda_graphs"
step decode64 250 python bench.py --what=decode --model=$B2 --seq=32 --batch=64 --new_tokens=1024 --dtype=bfloat16 --compile=layers --profile --trace=$O/dtrace.json
step summary 25 python bench/trace_summary.py $O/dtrace.json --top=12 --per=4
step decode256 130 python bench.py --what=decode --model=$B2 --seq=32 --batch=256 --new_tokens=1024 --dtype=bfloat16 --compile=layers
step mismatch 60 python bench.py --what=mismatch --model=$B2 --seq=64 --batch=16 --new_tokens=64 --dtype=bfloat16
cd $O && cat log.txt tests.txt decode64.txt summary.txt decode256.txt mismatch.txt > results.txt && rm -f dtrace*.json; tar c *.raw | xz > logs.tar.xz && rm -f *.raw decode64.txt
grep -v "^ *$" results.txt | grep -v "^ *-\+" | grep -v "^ *nvjet\|^ *triton_\|Memset\|^ *aten::\|^ *void \|^ *cuda\|^ *Cuda\|^ *_ZN\|^ *Compiled\|^ *[0-9.]* us \|^ *sm80\|^ *_sinkhorn\|^ *_hc_post\|^ *_decode_attn\|^ *_experts\|^ *Name  " | head -90
