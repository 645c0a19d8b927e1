#!/usr/bin/env bash
# Prepared in session 18 for the next H200 call (not yet run): session 18 call 3's GRPO run again, after 7ed7c93
# (the trainer's layers, head and losses compiled with a symbolic batch and length from the first call; micro-batches
# padded to a multiple of 128). Session 18's step 0 spent 207 s compiling the GRPO step's shapes after the warm-up's;
# now the warm-up's graphs should serve every step. Carry a cache of the same code (this script's first run compiles
# cold: the server's warm-up ~270 s overlaps the trainer's). Output: $OUT/log.txt, results.txt, logs.tar.xz, new.txz.*
source bench/calls/prelude.sh
nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader -l 20 > $O/mem.txt &
step grpo 500 python train_grpo.py config/h200.py --data=toy --eval_data=toy --max_steps=8 --max_new_tokens=64 \
    --n_prompts=8 --n_samples=8 --checkpoint_interval=0 --eval_interval=0 --out_dir=/tmp/grpo
kill %1
(cd /tmp/ind && find . -type f -newer $O/log.txt | tar c -T - | xz -T0 -1 | split -b 15M - $O/new.txz.)
cd $O && cat log.txt grpo.txt mem.txt > results.txt && tar c *.raw | xz > logs.tar.xz && rm -f *.raw grpo.txt
grep -v "^config:" results.txt | tail -50
