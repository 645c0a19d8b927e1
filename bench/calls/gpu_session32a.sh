#!/usr/bin/env bash
# Session 32's second call: why the warm-up test still compiled one graph after Engine.warm_up on the H200 (13 == 12
# in gpu_session32.sh; on the CPU, with the Triton paths forced on and aot_eager, it compiles none): the test again
# with dynamo's recompile reasons. Then the mismatch with the engine compiled.
source bench/calls/prelude.sh
export TORCH_LOGS=recompiles
step warm 300 python -m pytest -q -s -p no:cacheprovider -p no:logging tests/test_compile_engine.py -k warm_up
unset TORCH_LOGS
step mismatch_compiled 270 python bench.py --what=mismatch --model=$B2 --seq=64 --batch=16 --new_tokens=64 --dtype=bfloat16 --compile=layers
cd $O && grep -h "Recompiling\|- [0-9]*/[0-9]*:\|passed\|failed" warm.raw | cut -c60-400 | tail -30; cat mismatch_compiled.txt | tail -5
