#!/usr/bin/env bash
# H200 call 2 of session 15 (2026-12-02): the experts' stacks as the autograd leaves (kernels_torch.stack_experts_: two
# gradients per MoE layer where the per-expert parameters made 192), a cold compile of the changed layers; bench.py
# now also prints how long the host took to issue a step. The GPU tests of the stacked experts run beside the
# compile. Output: $OUT/log.txt, results.txt, logs.tar.xz, new.txz.*
source bench/calls/prelude.sh
step test 200 python -m pytest -q tests/test_kernels.py &
step train 520 python bench.py --model=$B2 --seq=4096 --batch=1 --dtype=bfloat16 --steps=10 --warmup=3 --compile=graphs
wait
(cd /tmp/ind && find . -type f -newer $O/log.txt | tar c -T - | xz -T0 -1 | split -b 15M - $O/new.txz.)
cd $O && cat log.txt test.txt train.txt > results.txt && tar c *.raw test.txt train.txt | xz > logs.tar.xz \
    && rm -f *.raw test.txt train.txt
tail -30 results.txt
