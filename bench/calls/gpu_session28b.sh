#!/usr/bin/env bash
# Session 28, call 2: call 1's skinny GEMM was slower than cuBLAS (removed). Now: the attention's write-back into the
# streams fused into the MoE's hc_pre (kernels_triton.hc_post_pre_triton), and the decode attention's key loops
# software-pipelined (DECODE_STAGES > 1: every block read, masked, no branch). The GPU tests, the attention probe
# over stages and splits, decode at batch 64 with stages 1 (the default) and 3, a trace of the better.
source bench/calls/prelude.sh
step tests 170 python -m pytest -q -p no:cacheprovider tests/test_triton.py tests/test_decode_kernels.py tests/test_kernels_engine.py -k "hc_pre or hc_post_pre or decode_attention or cuda_graphs or engine_decode"
step attn 90 python bench/probe_decode_attn.py
step decode64 200 python bench.py --what=decode --model=$B2 --seq=32 --batch=64 --new_tokens=1024 --dtype=bfloat16 --compile=layers --no_peer --profile --trace=$O/dtrace.json
step decode64s3 150 python -c "import sys, runpy, kernels_attention as k; k.DECODE_STAGES = 3; sys.argv = ['bench.py'] + sys.argv[1:]; runpy.run_path('bench.py', run_name='__main__')" --what=decode --model=$B2 --seq=32 --batch=64 --new_tokens=1024 --dtype=bfloat16 --compile=layers --no_peer --profile --trace=$O/dtrace3.json
step summary 20 python bench/trace_summary.py $O/dtrace.json --top=30 --per=4 --order=120:40
step summary3 20 python bench/trace_summary.py $O/dtrace3.json --top=30 --per=4
cd $O && cat log.txt tests.txt attn.txt decode64.txt decode64s3.txt summary.txt summary3.txt > results.txt && rm -f dtrace*.json; tar c *.raw | xz > logs.tar.xz && rm -f *.raw
grep -v "^ *$" results.txt | grep -v "^ *-\+" | grep -v "^ *nvjet\|^ *triton_\|Memset\|^ *aten::\|^ *void \|^ *cuda\|^ *Cuda\|^ *_ZN\|^ *Compiled\|^ *[0-9.]* us \|^ *sm80\|^ *_sinkhorn\|^ *_hc_p\|^ *_hc_m\|^ *_decode_attn\|^ *_experts\|^ *_compress\|^ *_window\|^ *_sample\|^ *_route\|^ *_pair\|^ *_q_norm\|^ *Name  " | head -150
