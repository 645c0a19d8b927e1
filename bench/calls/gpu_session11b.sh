#!/usr/bin/env bash
# H200 call 2 of session 11 (2026-12-02), with call 1's compile caches (.ind/): the training step again, its loss now
# the trainer's compiled token_logprobs, profiled with shapes and Python stacks (bench.py --trace) to find where its
# copies come from; a whole GRPO run with compile='layers' (the toy model, fp32: the reference expert loop, eager);
# the CUDA-IPC tests. Output: $OUT/*.txt, all.log, trace.json.gz
source bench/calls/prelude.sh
step train 300 python bench.py --model=$B2 --seq=4096 --batch=1 --dtype=bfloat16 --steps=10 --warmup=3 \
    --compile=graphs --profile --trace=/tmp/trace.json
gzip -c /tmp/trace.json > $O/trace.json.gz 2>/dev/null
step grpo 170 python train_grpo.py --out_dir=/tmp/g11 --compile=layers --weight_sync=tensor --max_steps=3 \
    --format_warmup_steps=10 --eval_interval=0 --checkpoint_interval=0
step ipc 80 python -m pytest -q tests/test_tensor_sync.py -k ipc
cat $O/train.raw $O/grpo.raw $O/ipc.raw > $O/all.log && rm $O/train.raw $O/grpo.raw $O/ipc.raw
ls -la $O; cat $O/log.txt $O/ipc.txt $O/grpo.txt | cut -c1-200; grep -v "^ *\(triton\|nvjet\|void\|_ZN\|sm80\|##\|aten\)" $O/train.txt | head -30
