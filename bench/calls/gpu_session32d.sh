#!/usr/bin/env bash
# Session 32's third call: the warm-up test with inductor's shape padding off in compile_layers (its pad_mm pass had
# guarded the prefill on batch x length: 13 == 12 in gpu_session32.sh, the guard in gpu_session32a.sh's recompile
# log), then the mismatch with the engine and the trainer compiled, given more time than gpu_session32a.sh's 270 s.
source bench/calls/prelude.sh
export TORCH_LOGS=recompiles
step warm 240 python -m pytest -q -s -p no:cacheprovider -p no:logging tests/test_compile_engine.py -k "warm_up or compiled_prefill"
unset TORCH_LOGS
step mismatch_compiled 330 python bench.py --what=mismatch --model=$B2 --seq=64 --batch=16 --new_tokens=64 --dtype=bfloat16 --compile=layers
cd $O && grep -h "Recompiling\|- [0-9]*/[0-9]*:\|passed\|failed" warm.raw | cut -c60-300 | tail -12; cat mismatch_compiled.txt | tail -5
