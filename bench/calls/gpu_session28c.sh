#!/usr/bin/env bash
# Session 28, call 3: call 2's pipelined key loops were no faster (removed); the MoE's hc_pre with the attention's
# write-back kept. Now also hc_pre's Sinkhorn on 16 scalars for n = 4 (kernels_triton._sinkhorn4). The GPU tests,
# the hc_pre probe, decode at batch 64 against transformers with its trace, the compiled decode's calls of
# compress_step and window_kv (what inductor passes them: session 28's trace had copies before each).
source bench/calls/prelude.sh
step tests 150 python -m pytest -q -p no:cacheprovider tests/test_triton.py tests/test_kernels_engine.py -k "hc_pre or hc_post_pre or cuda_graphs"
step hcpre 60 python bench/probe_hc_pre.py
step decode64 300 python bench.py --what=decode --model=$B2 --seq=32 --batch=64 --new_tokens=1024 --dtype=bfloat16 --compile=layers --profile --trace=$O/dtrace.json
step summary 20 python bench/trace_summary.py $O/dtrace.json --top=30 --per=4 --order=120:40
step codegen 150 env TORCH_LOGS=output_code TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 python bench.py --what=decode --model=$B2 --seq=32 --batch=64 --new_tokens=8 --dtype=bfloat16 --compile=layers --no_peer
grep -h "compress_step\|window_kv" $O/codegen.raw | grep -v "^ *#\|Topologically\|Original ATen" | sed 's/.*__output_code\] //' | cut -c1-300 | sort | uniq -c | sort -rn | head -60 > $O/codegen_calls.txt; rm -f $O/codegen.raw $O/codegen.txt
cd $O && cat log.txt tests.txt hcpre.txt decode64.txt summary.txt codegen_calls.txt > results.txt && rm -f dtrace*.json; tar c *.raw | xz > logs.tar.xz && rm -f *.raw
grep -v "^ *$" results.txt | grep -v "^ *-\+" | grep -v "^ *nvjet\|^ *triton_\|Memset\|^ *aten::\|^ *void \|^ *cuda\|^ *Cuda\|^ *_ZN\|^ *Compiled\|^ *[0-9.]* us \|^ *sm80\|^ *_sinkhorn\|^ *_hc_p\|^ *_hc_m\|^ *_decode_attn\|^ *_experts\|^ *_compress\|^ *_window\|^ *_sample\|^ *_route\|^ *_pair\|^ *_q_norm\|^ *Name  " | head -150
