#!/usr/bin/env bash
# Session 29, call 1: where the remaining decode time could come from. The routed experts' kernels under more block
# configs (bench/probe_moe_decode.py, 64 tokens); the prefill's host and device time (bench/probe_prefill.py); decode
# at batch 64 as committed, and with hc_post_pre's fused write-back off (model_dsv4.HC_BK set to a value that does not
# divide D, so that Block.hc_post_pre takes hc_post then hc_pre: session 28's open A/B).
source bench/calls/prelude.sh
step moe 150 python bench/probe_moe_decode.py --tokens 64
step prefill 120 python bench/probe_prefill.py
D64="--what=decode --model=$B2 --seq=32 --batch=64 --new_tokens=1024 --dtype=bfloat16 --compile=layers --no_peer"
step decode64 240 python bench.py $D64
step decode64_nofuse 240 python -c "import sys, runpy, model_dsv4; model_dsv4.HC_BK = 100; sys.argv = ['bench.py'] + sys.argv[1:]; runpy.run_path('bench.py', run_name='__main__')" $D64
cd $O && cat log.txt moe.txt prefill.txt decode64.txt decode64_nofuse.txt > results.txt; tar c *.raw | xz > logs.tar.xz && rm -f *.raw
cat results.txt | cut -c1-200 | head -150
