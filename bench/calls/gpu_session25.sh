#!/usr/bin/env bash
# Session 25, call 1: the decode kernels' GPU tests (the compressor pooling's first run on a GPU), decode at batch 64
# with the model step's trace (the pooling kernel and the batched admission, first timed together; no peer: the
# floor ratio), then the probes written for this session: fused projections, skewed MoE routing, the sampler.
source bench/calls/prelude.sh
step tests 120 python -m pytest -q -p no:cacheprovider tests/test_triton.py tests/test_decode_kernels.py tests/test_kernels_engine.py -k "triton or cuda_graphs or decode or experts or compress"
step decode64 240 python bench.py --what=decode --model=$B2 --seq=32 --batch=64 --new_tokens=1024 --dtype=bfloat16 --compile=layers --no_peer --profile --trace=$O/dtrace.json
step summary 25 python bench/trace_summary.py $O/dtrace.json --top=40 --per=4
step order 25 python bench/trace_summary.py $O/dtrace.json --top=0 --order=0:240
cd bench
step proj 40 python probe_fused_proj.py
step moe 60 python probe_moe_decode.py
step sampler 40 python probe_sampler.py
cd $O && cat log.txt tests.txt decode64.txt summary.txt proj.txt moe.txt sampler.txt > results.txt && rm -f dtrace*.json; tar c *.raw | xz > logs.tar.xz && rm -f *.raw decode64.txt
grep -v "^ *$" results.txt | head -150
