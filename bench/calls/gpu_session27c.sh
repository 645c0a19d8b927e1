#!/usr/bin/env bash
# Session 27, call 3: call 2's engine test failed (the graphed bf16 engine 0.092 from the full forward against the
# reference engine's 0.025): the attention kernel had undone the output's RoPE before its one rounding, where
# Attention.output rounds, turns and rounds again. Now it rounds as the trainer does (kernels_decode._finish), the
# splits' shares are added by a kernel (not aten's 6 us reduction) and a sequence is split only while the step has
# fewer than DECODE_PROGRAMS programs (call 2's probe: splitting was slower at batch 256). The GPU tests, decode at
# batch 64 (profile and trace) and at 256.
source bench/calls/prelude.sh
step tests 150 python -m pytest -q -p no:cacheprovider tests/test_decode_kernels.py tests/test_routing_kernels.py tests/test_kernels_engine.py
step decode64 200 python bench.py --what=decode --model=$B2 --seq=32 --batch=64 --new_tokens=1024 --dtype=bfloat16 --compile=layers --no_peer --profile --trace=$O/dtrace.json
step summary 20 python bench/trace_summary.py $O/dtrace.json --top=40 --per=4 --order=120:60
step decode256 170 python bench.py --what=decode --model=$B2 --seq=32 --batch=256 --new_tokens=1024 --dtype=bfloat16 --compile=layers --no_peer
cd $O && cat log.txt tests.txt decode64.txt summary.txt decode256.txt > results.txt && rm -f dtrace*.json; tar c *.raw | xz > logs.tar.xz && rm -f *.raw
grep -v "^ *$" results.txt | grep -v "^ *-\+" | grep -v "^ *nvjet\|^ *triton_\|Memset\|^ *aten::\|^ *void \|^ *cuda\|^ *Cuda\|^ *_ZN\|^ *Compiled\|^ *[0-9.]* us \|^ *sm80\|^ *_sinkhorn\|^ *_hc_p\|^ *_hc_m\|^ *_decode_attn\|^ *_experts\|^ *_compress\|^ *_window\|^ *_sample\|^ *_route\|^ *_pair\|^ *_q_norm\|^ *Name  " | head -150
