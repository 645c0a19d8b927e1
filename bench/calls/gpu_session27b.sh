#!/usr/bin/env bash
# Session 27, call 2: on the GPU the decode attention split over several programs a sequence
# (kernels_decode.decode_splits), dispatch's order and row moves in one kernel (kernels_route.sort_pairs_triton), the
# window key's norm, RoPE and cache write in one (kernels_decode.window_kv_triton), the compressor's step in one
# (kernels_decode.compress_step_triton), the output's RoPE undone inside the attention kernel: their tests,
# bench/probe_decode_attn.py (splits 1-4, blocks of 32 / 64 keys, against the gathered reference), decode at batch 64
# with the model's step timed at the prompts' end and at the mean context (the profile and trace there).
source bench/calls/prelude.sh
python -c "import triton; print(\"triton\", triton.__version__)" >> $O/log.txt
step tests 150 python -m pytest -q -p no:cacheprovider tests/test_decode_kernels.py tests/test_routing_kernels.py tests/test_kernels_engine.py
step attn 120 python bench/probe_decode_attn.py
step decode64 220 python bench.py --what=decode --model=$B2 --seq=32 --batch=64 --new_tokens=1024 --dtype=bfloat16 --compile=layers --no_peer --profile --trace=$O/dtrace.json
step summary 20 python bench/trace_summary.py $O/dtrace.json --top=40 --per=4 --order=120:60
cd $O && cat log.txt tests.txt attn.txt decode64.txt summary.txt > results.txt && rm -f dtrace*.json; tar c *.raw | xz > logs.tar.xz && rm -f *.raw
grep -v "^ *$" results.txt | grep -v "^ *-\+" | grep -v "^ *nvjet\|^ *triton_\|Memset\|^ *aten::\|^ *void \|^ *cuda\|^ *Cuda\|^ *_ZN\|^ *Compiled\|^ *[0-9.]* us \|^ *sm80\|^ *_sinkhorn\|^ *_hc_p\|^ *_hc_m\|^ *_decode_attn\|^ *_experts\|^ *_compress\|^ *_window\|^ *_sample\|^ *_route\|^ *_pair\|^ *_q_norm\|^ *Name  " | head -150
