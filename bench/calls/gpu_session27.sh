#!/usr/bin/env bash
# Written in session 26 for the next session's first call. Not yet run on a GPU: hc_pre's mixes in tf32x3 on CUDA
# (kernels_triton.hc_dot, chosen from session 26's probe), its second kernel loading the streams before the partials,
# the router reading its logits in place, the query's norm and RoPE as one kernel (kernels_decode.q_norm_rope_triton).
# The kernels' GPU tests, the hc_pre probe (with the second kernel's breakdown), decode at batch 64 against
# transformers with the step's trace. Decode at 256 is for a second call.
source bench/calls/prelude.sh
step tests 160 python -m pytest -q -p no:cacheprovider tests/test_triton.py tests/test_decode_kernels.py tests/test_routing_kernels.py tests/test_kernel_builds.py tests/test_kernels_engine.py
step hcpre 60 python bench/probe_hc_pre.py
step decode64 250 python bench.py --what=decode --model=$B2 --seq=32 --batch=64 --new_tokens=1024 --dtype=bfloat16 --compile=layers --profile --trace=$O/dtrace.json
step summary 20 python bench/trace_summary.py $O/dtrace.json --top=30 --per=4 --order=120:60
cd $O && cat log.txt tests.txt hcpre.txt decode64.txt summary.txt > results.txt && rm -f dtrace*.json; tar c *.raw | xz > logs.tar.xz && rm -f *.raw
grep -v "^ *$" results.txt | grep -v "^ *-\+" | grep -v "^ *nvjet\|^ *triton_\|Memset\|^ *aten::\|^ *void \|^ *cuda\|^ *Cuda\|^ *_ZN\|^ *Compiled\|^ *[0-9.]* us \|^ *sm80\|^ *_sinkhorn\|^ *_hc_p\|^ *_hc_m\|^ *_decode_attn\|^ *_experts\|^ *_compress\|^ *_sample\|^ *_route\|^ *_pair\|^ *_q_norm\|^ *Name  " | head -120
