#!/usr/bin/env bash
# Session 28, call 1: the decode step's dense projections on kernels_gemm.skinny_linear_triton (split over K, the
# tile's last program adds the splits), the sublayers' RMSNorm inside hc_pre's kernel, the RoPE tables once a step
# (KVCache.step_rope). The new kernels' GPU tests and the engine's CUDA-graph test, the GEMM probe (against aten,
# and its block sizes), decode at batch 64 with its profile and trace.
source bench/calls/prelude.sh
step tests 170 python -m pytest -q -p no:cacheprovider tests/test_gemm_kernels.py tests/test_kernels_engine.py tests/test_triton.py -k "skinny or hc_pre or cuda_graphs"
step skinny 120 python bench/probe_skinny.py
step decode64 220 python bench.py --what=decode --model=$B2 --seq=32 --batch=64 --new_tokens=1024 --dtype=bfloat16 --compile=layers --no_peer --profile --trace=$O/dtrace.json
step summary 20 python bench/trace_summary.py $O/dtrace.json --top=40 --per=4 --order=120:60
cd $O && cat log.txt tests.txt skinny.txt decode64.txt summary.txt > results.txt && rm -f dtrace*.json; tar c *.raw | xz > logs.tar.xz && rm -f *.raw
grep -v "^ *$" results.txt | grep -v "^ *-\+" | grep -v "^ *nvjet\|^ *triton_\|Memset\|^ *aten::\|^ *void \|^ *cuda\|^ *Cuda\|^ *_ZN\|^ *Compiled\|^ *[0-9.]* us \|^ *sm80\|^ *_sinkhorn\|^ *_hc_p\|^ *_hc_m\|^ *_decode_attn\|^ *_experts\|^ *_compress\|^ *_window\|^ *_sample\|^ *_route\|^ *_pair\|^ *_q_norm\|^ *_skinny\|^ *Name  " | head -150
