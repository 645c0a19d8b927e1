# One 80 GB GPU (H100 or H200): bench_2b (2.43B, 0.79B active; spec §7.2) from scratch at V4's real shapes, the
# embedded server on the same GPU, 2,048-token answers: step time and memory. A random model earns reward 0 on every
# sample, so every group is flat: dynamic sampling is off (on, it re-rolls each step and then skips it) and each step
# runs whole (rollout, forward and backward of every sample, AdamW, sync) on zero advantages, moving no weight. Read
# t_roll / t_train / t_sync and mem, not reward; from a base that earns reward, turn sampling and evals back on.
#   python train_grpo.py config/h200.py [--dry_run=True]                  # the math task: no download, no network
#   python train_grpo.py config/h200.py --data=<DAPO-Math-17k .parquet or .jsonl> --eval_data=data/aime2024.jsonl
out_dir = 'out/h200'
seed = 1337
max_steps = 20

init_from = 'scratch'
model_config = 'config/models/bench_2b.json'
dtype = 'bfloat16'
compile = 'off'  # 'layers' compiles the trainer's layers (minutes cold); the server replays CUDA graphs of eager

# one GPU, so no PP/EP; micro-batches bound activation memory (8 samples of ~3k tokens each)
pp_size, ep_size, dry_run_world = 1, 1, 1
micro_batch_tokens = 24576
recompute = True  # ~2k-token samples x 4 mHC streams; spec §7.2 budgets ~80 GB for activations
optimizer_offload = False  # fp32 master + Adam is ~39 GB, it fits

# embedded server, colocated: the weights are handed over on the same GPU, in bf16
rollout_url = ''
weight_sync = 'tensor'  # CUDA IPC handles to the trainer's buckets, read by the server on the same GPU
rollout_quant = 'none'

# the math task (tasks.py) offline; DAPO-Math-17k with --data=<its file> (one of its ~100 copies of each problem kept;
# a hub name works where there is network and the datasets package), AIME-2024 from data/ (data/README.md)
data = 'math'
eval_data = 'math'
n_prompts, n_samples = 16, 8
max_new_tokens = 2048
temperature, top_p = 0.8, 1.0
lr, lr_schedule = 1e-6, 'constant'
trainable, freeze_router = 'all', True
kl_coef, entropy_coef, dynamic_sampling = 0.0, 0.0, False
eps_low, eps_high, tis_cap = 0.2, 0.28, 2.0
eval_interval, eval_n_samples = 0, 8  # a random model's evals measure nothing (200 problems x 8 x 2,048 tokens)
checkpoint_interval, keep_checkpoints = 0, 1  # a checkpoint with AdamW's state is ~34 GB of a random model
