#!/usr/bin/env bash
# Session 21, call 3: hc_post's Triton kernels rewritten without the [n, n, columns] product (call 2 timed the first
# version's backward at 117 us a sublayer): the Triton tests on the GPU, hc_post alone (bench/probe_hc_post.py),
# then the training step at 2 x 4096 and 1 x 4096. Output: $OUT/log.txt, results.txt, logs.tar.xz
source bench/calls/prelude.sh
step tests 70 python -m pytest -q -p no:cacheprovider tests/test_triton.py
step hcpost 60 python bench/probe_hc_post.py
step train2 200 python bench.py --model=$B2 --seq=4096 --batch=2 --dtype=bfloat16 --steps=4 --warmup=2 --compile=graphs
step train1 170 python bench.py --model=$B2 --seq=4096 --batch=1 --dtype=bfloat16 --steps=6 --warmup=2 --compile=graphs --profile
cd $O && cat log.txt tests.txt hcpost.txt train2.txt train1.txt > results.txt && tar c *.raw | xz > logs.tar.xz && rm -f *.raw tests.txt hcpost.txt train2.txt train1.txt
grep -v "^ *$" results.txt | grep -v "^ *-\+" | grep -v "^ *## Call\|^ *nvjet\|^ *triton_\|Memset" | head -60
