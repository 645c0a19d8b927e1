#!/usr/bin/env bash
# Session 22, call 3: RoPE's cos and sin as an op of their own (model_dsv4.rope_angles), on top of call 2's changes:
# the GPU tests of the fast paths (the bf16 model, the Triton kernels in the model), then the training step at
# 2 x 4096 and at 1 x 4096 with its trace, summed. Output: $OUT/log.txt, results.txt, trace1.json.xz
source bench/calls/prelude.sh
step tests 110 python -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_triton.py -k "gpu or model_on_triton or hc_post_triton_equals"
step train2 210 python bench.py --model=$B2 --seq=4096 --batch=2 --dtype=bfloat16 --steps=4 --warmup=2 --compile=graphs
step train1 200 python bench.py --model=$B2 --seq=4096 --batch=1 --dtype=bfloat16 --steps=6 --warmup=2 --compile=graphs --profile --trace=$O/trace1.json
step summary 40 python bench/trace_summary.py $O/trace1.json --top=25
cd $O && cat log.txt tests.txt train2.txt summary.txt train1.txt > results.txt && xz -T4 trace1.json; tar c *.raw | xz > logs.tar.xz && rm -f *.raw tests.txt train2.txt train1.txt
grep -v "^ *$" results.txt | grep -v "^ *-\+" | grep -v "^ *## Call\|^ *nvjet\|^ *triton_\|Memset\|^ *aten::\|^ *void \|^ *cuda\|^ *Cuda\|^ *_ZN\|^ *Compiled" | head -60
