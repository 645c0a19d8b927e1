#!/usr/bin/env bash
# H200 call 1 of session 10 (2026-12-02): flattened weight-sync buckets. The CUDA-IPC tests (flattened and tensor by
# tensor, fp8); the sync benchmark on the whole bench_2b (tensor transport, flattened vs per tensor, in one run);
# then a whole GRPO run of the default toy model on the GPU with compile='layers' and weight_sync='tensor', which
# train_grpo.py had not run on a GPU before. Output: $OUT/log*.txt
source bench/calls/prelude.sh
( date +%T; timeout 110 python -m pytest -q tests/test_tensor_sync.py -k "ipc" 2>&1 | tail -6; date +%T ) > $O/log_test.txt 2>&1
( date +%T; timeout 190 python bench.py --what=sync --model=$B2 --dtype=bfloat16 2>&1 | drop; date +%T ) > $O/log_sync.txt 2>&1
( date +%T; timeout 280 python train_grpo.py --out_dir=/tmp/g10 --compile=layers --weight_sync=tensor --max_steps=6 \
    --eval_interval=0 --checkpoint_interval=0 2>&1 | drop | cut -c1-220 | tail -40; date +%T ) > $O/log_grpo.txt 2>&1
cat $O/log.txt $O/log_test.txt $O/log_sync.txt $O/log_grpo.txt
