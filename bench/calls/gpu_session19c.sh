#!/usr/bin/env bash
# Session 19, call 2: why test_engine_cuda_graphs_equal_eager_and_forward failed in call 1 (one logprob of 40 at
# 0.128 against 0.05 allowed, before the runs part): again as it was (the same value: deterministic), with every
# launch synchronous (CUDA_LAUNCH_BLOCKING=1: no host write can race a copy), and with the indexer's top-k covering
# every entry (bench/probe_topk.py). Then session 18c's GRPO run after 7ed7c93 (gpu_session19b.sh, 6 steps), with
# call 1's caches (the bench's training graphs and decode). Output: $OUT/log.txt, results.txt, logs.tar.xz, new.txz.*
source bench/calls/prelude.sh
T=tests/test_kernels.py::test_engine_cuda_graphs_equal_eager_and_forward
step again 40 python -m pytest -q -x -p no:cacheprovider $T
CUDA_LAUNCH_BLOCKING=1 step blocking 40 python -m pytest -q -x -p no:cacheprovider $T
PYTHONPATH=bench TOPK=64 step topk 40 python -m pytest -q -x -p no:cacheprovider -p probe_topk $T
nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader -l 20 > $O/mem.txt &
step grpo 450 python train_grpo.py config/h200.py --data=toy --eval_data=toy --max_steps=6 --max_new_tokens=64 \
    --n_prompts=8 --n_samples=8 --checkpoint_interval=0 --eval_interval=0 --out_dir=/tmp/grpo
kill %1
(cd /tmp/ind && find . -type f -newer $O/log.txt | tar c -T - | xz -T0 -1 | split -b 15M - $O/new.txz.)
cd $O && cat log.txt again.txt blocking.txt topk.txt grpo.txt mem.txt > results.txt && tar c *.raw | xz > logs.tar.xz
rm -f *.raw again.txt blocking.txt topk.txt grpo.txt
grep -v "^config:" results.txt | grep -v "^ *$" | tail -90
