#!/usr/bin/env bash
# H200 call 2 of session 17 (2026-12-02), with session 14's compile cache (bench_2b's decode layers) and session
# 15's (small test models): the GRPO trainer on the GPU with config/h200.py as it now stands (compile='layers' in
# the trainer and the embedded server, activation recompute, the tensor transport), on the toy task, bench_2b from
# scratch; GPU memory sampled every 20 s. Then test_compile.py's two tests not run on a GPU since session 15.
# Output: $OUT/log.txt, results.txt, logs.tar.xz, new.txz.*
source bench/calls/prelude.sh
nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader -l 20 > $O/mem.txt &
step grpo 430 python train_grpo.py config/h200.py --data=toy --eval_data=toy --max_steps=6 --format_warmup_steps=8 \
    --max_new_tokens=64 --n_prompts=8 --n_samples=8 --checkpoint_interval=0 --eval_interval=0 --out_dir=/tmp/grpo
kill %1
(cd /tmp/ind && find . -type f -newer $O/log.txt | tar c -T - | xz -T0 -1 | split -b 15M - $O/new.txz.)
step test 110 python -m pytest -v -x -p no:cacheprovider "tests/test_compile.py::test_compiled_sampler_and_sinkhorn_equal_eager" \
    "tests/test_compile.py::test_compiled_grpo_losses_equal_eager"
cd $O && cat log.txt grpo.txt mem.txt test.txt > results.txt && tar c *.raw | xz > logs.tar.xz && rm -f *.raw grpo.txt test.txt
tail -70 results.txt
