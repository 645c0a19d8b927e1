#!/usr/bin/env bash
# Session 20, call 3: the training step at batch 2 x 4096 (the trainer's micro-batches on config/h200.py hold 8
# samples of up to ~2k tokens: more tokens than bench's usual 1 x 4096), --compile=graphs, against transformers
# at the same batch. Output: $OUT/log.txt, results.txt, logs.tar.xz
source bench/calls/prelude.sh
step train2 300 python bench.py --model=$B2 --seq=4096 --batch=2 --dtype=bfloat16 --steps=4 --warmup=2 --compile=graphs
cd $O && cat log.txt train2.txt > results.txt && tar c *.raw | xz > logs.tar.xz && rm -f *.raw train2.txt
grep -v "^ *$" results.txt | tail -20
