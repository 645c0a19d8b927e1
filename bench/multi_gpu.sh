#!/usr/bin/env bash
# The multi-GPU runs (layouts, GRPO with PP x EP, scaling, the weight sync's NCCL peer), for a machine with 2, 4 or
# 8 GPUs. Every parallel code path picks NCCL (RCCL on ROCm) and cuda:LOCAL_RANK by itself when CUDA is available,
# so the CPU tests and commands below are the GPU runs as they are. Output: $OUT/multi_gpu.txt
export PYTHONUNBUFFERED=1
N=${N:-$(nvidia-smi -L | wc -l)}
run() { echo "### $*"; timeout "$@" 2>&1 | grep -v "Loading weights"; }
{
nvidia-smi -L
# 1. the layouts against one process: every rank on its own GPU with NCCL (the tests' tolerances are fp32's)
run 900 python -m pytest -q tests/test_parallel.py tests/test_grpo.py -k "layout or dispatch or pp2_ep2"
# 2. 30 GRPO steps of bench_2b with PP and EP over the GPUs, the embedded server sharing GPU 0; the step line
#    breaks time into t_roll / t_train / t_sync
run 1800 torchrun --standalone --nproc_per_node=$N train_grpo.py config/h200.py --data=toy --eval_data=toy \
    --pp_size=2 --ep_size=$((N / 2)) --max_steps=30 --out_dir=out/multi_gpu
# 3. scaling: training tokens/s of bench_2b on 1, 2, 4 (8) GPUs with PP and with EP, from the same loop's step
#    times (train_grpo.py --dry_run prints the memory plan of each layout first)
for pp in 1 2 4; do
  run 900 torchrun --standalone --nproc_per_node=$N train_grpo.py config/h200.py --data=toy --eval_data=toy \
      --pp_size=$pp --ep_size=$((N / pp)) --max_steps=5 --out_dir=out/scale_pp$pp
done
# 4. the weight sync against a plain NCCL broadcast of the same bytes: the distributed rows put the embedded
#    server on the last GPU (one GPU skips them: NCCL refuses two ranks on one GPU)
run 1200 python bench/bench.py --what=sync --model=config/models/bench_2b.json --dtype=bfloat16
} > "${OUT:-/tmp}/multi_gpu.txt" 2>&1
tail -c 11000 "${OUT:-/tmp}/multi_gpu.txt"
