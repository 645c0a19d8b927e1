#!/usr/bin/env bash
# H200 call 3 of session 12 (2026-12-02), with call 2's compile caches (.ind/): the training step of call 2's code
# (window_attention's softmax in two parts, the indexer's fused score), with its profile and trace.
# Output: $OUT/*.txt, *.raw, trace.json.gz
source bench/calls/prelude.sh
step train 490 python bench.py --model=$B2 --seq=4096 --batch=1 --dtype=bfloat16 --steps=6 --warmup=2 \
    --compile=graphs --profile --trace=$O/trace.json.gz
cat $O/log.txt; grep -v "^ *\(triton\|nvjet\|void\|_ZN\|sm80\|##\|aten\|cutlass\|at::\|Memcpy\|Memset\)" $O/train.txt | head -40
