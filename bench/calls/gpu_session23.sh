#!/usr/bin/env bash
# Session 23, call 1: the engine's decode at batch 64 after sessions 21-22 (row moves, rope_angles), with a trace of
# four replays of the model's step, summed per step and listed in order. Output: $OUT/results.txt, dtrace.json.xz
source bench/calls/prelude.sh
step decode 480 python bench.py --what=decode --model=$B2 --seq=32 --batch=64 --new_tokens=1024 --dtype=bfloat16 --compile=layers --profile --trace=$O/dtrace.json
step summary 60 python bench/trace_summary.py $O/dtrace.json --top=60 --per=4 --order=0:400
cd $O && cat log.txt decode.txt summary.txt > results.txt && xz -T4 dtrace.json; tar c *.raw | xz > logs.tar.xz && rm -f *.raw decode.txt
grep -v "^ *$" results.txt | grep -v "^ *-\+" | grep -v "^ *nvjet\|^ *triton_\|Memset\|^ *aten::\|^ *void \|^ *cuda\|^ *Cuda\|^ *_ZN\|^ *Compiled\|^ *[0-9.]* us " | head -90
