#!/usr/bin/env bash
# H200 calls 1 and 2 of session 14 (2026-12-02; call 1's first kernel did not compile): mHC's Sinkhorn as Triton
# kernels (kernels_torch.sinkhorn_triton). The GPU tests of the kernels (tests/test_triton.py compiled by Triton,
# tests/test_kernels.py with the kernel inside the model), bench/probe_mhc.py's Triton forms against the loop, and in
# the background the training step, a cold compile with its profile and trace. The compile caches written in this
# call come back for the next one. Output: $OUT/log.txt, results.txt, logs.tar.xz, trace.json.gz, new.txz.*
source bench/calls/prelude.sh
python -c "import triton; print('triton', triton.__version__)" >> $O/log.txt
step train 560 python bench.py --model=$B2 --seq=4096 --batch=1 --dtype=bfloat16 --steps=6 --warmup=2 \
    --compile=graphs --profile --trace=$O/trace.json.gz &
step test 200 python -m pytest -q -x tests/test_triton.py tests/test_kernels.py
step probe 300 python bench/probe_mhc.py
wait
(cd /tmp/ind && find . -type f -newer $O/log.txt | tar c -T - | xz -T0 -1 | split -b 15M - $O/new.txz.)
cd $O && cat log.txt test.txt probe.txt train.txt > results.txt && tar c *.raw test.txt probe.txt train.txt | xz > logs.tar.xz \
    && rm -f *.raw test.txt probe.txt train.txt
cat log.txt; grep -v "^ *\(triton\|nvjet\|void\|_ZN\|sm80\|##\|aten\|cutlass\|at::\|Memcpy\|Memset\)" results.txt | tail -60
