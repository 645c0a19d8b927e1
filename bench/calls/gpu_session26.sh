#!/usr/bin/env bash
# Written in session 25 for the next session's first call: mHC's pre-mix for decode as one Triton kernel
# (kernels_triton.hc_pre_triton, not yet run on a GPU): the GPU tests of the Triton kernels, decode at batch 64 with
# the model step's trace and at 256 (no peer: the floor ratio).
source bench/calls/prelude.sh
step tests 140 python -m pytest -q -p no:cacheprovider tests/test_triton.py tests/test_decode_kernels.py tests/test_kernels_engine.py
step decode64 230 python bench.py --what=decode --model=$B2 --seq=32 --batch=64 --new_tokens=1024 --dtype=bfloat16 --compile=layers --no_peer --profile --trace=$O/dtrace.json
step summary 25 python bench/trace_summary.py $O/dtrace.json --top=30 --per=4
step hcpre 60 python bench/probe_hc_pre.py
step decode256 150 python bench.py --what=decode --model=$B2 --seq=32 --batch=256 --new_tokens=1024 --dtype=bfloat16 --compile=layers --no_peer
cd $O && cat log.txt tests.txt decode64.txt summary.txt hcpre.txt decode256.txt > results.txt && rm -f dtrace*.json; tar c *.raw | xz > logs.tar.xz && rm -f *.raw decode64.txt
grep -v "^ *$" results.txt | grep -v "^ *-\+" | grep -v "^ *nvjet\|^ *triton_\|Memset\|^ *aten::\|^ *void \|^ *cuda\|^ *Cuda\|^ *_ZN\|^ *Compiled\|^ *[0-9.]* us \|^ *sm80\|^ *_sinkhorn\|^ *_hc_p\|^ *_decode_attn\|^ *_experts\|^ *_compress\|^ *_sample\|^ *Name  " | head -120
