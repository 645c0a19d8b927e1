#!/usr/bin/env bash
# H200 call 1 of session 16 (2026-12-02), with the compile caches of sessions 14-15: the training step with session
# 15's four untimed changes (the compiled head, grpo._TargetLogprob, model_dsv4.top_k_mask, the head's bf16 mixes)
# against 96d73a5 (ab_old/: that commit's modules, this bench.py) in the same call; then bench/probe_loss.py.
# Output: $OUT/log.txt, results.txt, logs.tar.xz, new.txz.*
source bench/calls/prelude.sh
step train 230 python bench.py --model=$B2 --seq=4096 --batch=1 --dtype=bfloat16 --steps=10 --warmup=3 --compile=graphs
step old 190 python ab_old/bench.py --model=$B2 --seq=4096 --batch=1 --dtype=bfloat16 --steps=10 --warmup=3 --compile=graphs
step loss 80 python bench/probe_loss.py
(cd /tmp/ind && find . -type f -newer $O/log.txt | tar c -T - | xz -T0 -1 | split -b 15M - $O/new.txz.)
cd $O && cat log.txt train.txt old.txt loss.txt > results.txt && tar c *.raw train.txt old.txt loss.txt | xz > logs.tar.xz \
    && rm -f *.raw train.txt old.txt loss.txt
tail -40 results.txt
