#!/usr/bin/env bash
# H200 call 2 of session 18 (2026-12-02), with call 1's cache: the GRPO trainer with config/h200.py on the toy task
# (30 format warm-up steps), bench_2b from scratch, as 3f813f3 runs it: the embedded server now compiles its decode
# step at every batch bucket before its ready line (Engine.warm_up) while the trainer builds its model and warms up.
# GPU memory sampled every 20 s. Then the warm-up's test on the GPU.
# Output: $OUT/log.txt, results.txt, logs.tar.xz, new.txz.*
source bench/calls/prelude.sh
nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader -l 20 > $O/mem.txt &
step grpo 470 python train_grpo.py config/h200.py --data=toy --eval_data=toy --max_steps=8 --max_new_tokens=64 \
    --n_prompts=8 --n_samples=8 --checkpoint_interval=0 --eval_interval=0 --out_dir=/tmp/grpo
kill %1
step test 60 python -m pytest -v -x -p no:cacheprovider "tests/test_compile.py::test_engine_warm_up_compiles_every_batch_size_first"
(cd /tmp/ind && find . -type f -newer $O/log.txt | tar c -T - | xz -T0 -1 | split -b 15M - $O/new.txz.)
cd $O && cat log.txt grpo.txt mem.txt test.txt > results.txt && tar c *.raw | xz > logs.tar.xz && rm -f *.raw grpo.txt test.txt
grep -v "^config:" results.txt | tail -60
