#!/usr/bin/env bash
# Session 22, call 1: the CSA layers' compressed keys in groups of query blocks (kernels_torch.window_attention's
# `chunks`): the kernel tests on the GPU, the CSA attention alone in 1, 2, 4 and 8 groups (bench/probe_layer.py),
# hc_post alone (its forward launched a token a program, for the next change), then the training step at 1 x 4096
# with its trace, summed by bench/trace_summary.py. Output: $OUT/log.txt, results.txt, trace1.json.xz
source bench/calls/prelude.sh
step tests 70 python -m pytest -q -p no:cacheprovider tests/test_kernels.py
step layer 200 python bench/probe_layer.py attention
step hcpost 50 python bench/probe_hc_post.py
step train1 230 python bench.py --model=$B2 --seq=4096 --batch=1 --dtype=bfloat16 --steps=6 --warmup=2 --compile=graphs --profile --trace=$O/trace1.json
step summary 40 python bench/trace_summary.py $O/trace1.json --top=45
cd $O && cat log.txt tests.txt layer.txt hcpost.txt summary.txt train1.txt > results.txt && xz -T4 trace1.json; tar c *.raw | xz > logs.tar.xz && rm -f *.raw tests.txt layer.txt hcpost.txt train1.txt
grep -v "^ *$" results.txt | grep -v "^ *-\+" | grep -v "^ *## Call\|^ *nvjet\|^ *triton_\|Memset\|^ *aten::\|^ *void \|^ *cuda\|^ *Cuda" | head -110
