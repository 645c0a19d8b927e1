#!/usr/bin/env bash
# Session 19, call 3: the CUDA-graph engine test with seeded prompts and its new bound (most tokens, not all, to
# rounding), then call 2's GRPO run again (cut in its first step at 450 s there, after the server's 332 s compile),
# with call 2's caches. Output: $OUT/log.txt, results.txt, logs.tar.xz
source bench/calls/prelude.sh
step graphs 45 python -m pytest -q -x -p no:cacheprovider tests/test_kernels.py::test_engine_cuda_graphs_equal_eager_and_forward
nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader -l 20 > $O/mem.txt &
step grpo 420 python train_grpo.py config/h200.py --data=toy --eval_data=toy --max_steps=6 --max_new_tokens=64 \
    --n_prompts=8 --n_samples=8 --checkpoint_interval=0 --eval_interval=0 --out_dir=/tmp/grpo
kill %1
cd $O && cat log.txt graphs.txt grpo.txt mem.txt > results.txt && tar c *.raw | xz > logs.tar.xz && rm -f *.raw graphs.txt grpo.txt
grep -v "^config:" results.txt | grep -v "^ *$" | tail -60
