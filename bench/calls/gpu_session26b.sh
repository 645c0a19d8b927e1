#!/usr/bin/env bash
# Session 26, call 2: hc_pre as two kernels (the split GEMM, then the rest a token; call 1's one-program-a-token kernel
# took 41-76 us where the compiled path takes 18) and the router and the pairs' order as Triton kernels
# (kernels_decode.route_triton, pair_order_triton): the GPU tests, the hc_pre probe, decode at batch 64 with its trace
# (and one stretch of kernels in time order: a layer's sequence), the trainer/engine mismatch, decode at 256.
source bench/calls/prelude.sh
step tests 140 python -m pytest -q -p no:cacheprovider tests/test_triton.py tests/test_decode_kernels.py tests/test_kernels_engine.py tests/test_model.py::test_expert_order_counted_and_sorted_equal_the_stable_sort
step hcpre 50 python bench/probe_hc_pre.py
step decode64 200 python bench.py --what=decode --model=$B2 --seq=32 --batch=64 --new_tokens=1024 --dtype=bfloat16 --compile=layers --no_peer --profile --trace=$O/dtrace.json
step summary 25 python bench/trace_summary.py $O/dtrace.json --top=40 --per=4 --order=120:150
step mismatch 100 python bench.py --what=mismatch --model=$B2 --seq=64 --batch=16 --new_tokens=64 --dtype=bfloat16
step decode256 75 python bench.py --what=decode --model=$B2 --seq=32 --batch=256 --new_tokens=1024 --dtype=bfloat16 --compile=layers --no_peer
cd $O && cat log.txt tests.txt hcpre.txt decode64.txt summary.txt mismatch.txt decode256.txt > results.txt && rm -f dtrace*.json; tar c *.raw | xz > logs.tar.xz && rm -f *.raw decode64.txt
grep -v "^ *$" results.txt | grep -v "^ *-\+" | grep -v "^ *nvjet\|^ *triton_\|Memset\|^ *aten::\|^ *void \|^ *cuda\|^ *Cuda\|^ *_ZN\|^ *Compiled\|^ *[0-9.]* us \|^ *sm80\|^ *_sinkhorn\|^ *_hc_p\|^ *_decode_attn\|^ *_experts\|^ *_compress\|^ *_sample\|^ *_route\|^ *_pair\|^ *Name  " | head -120
