# One GPU (an H100 or H200): the bench_2b model (2.43B total, 0.79B active; spec §7.2) from scratch, with the
# embedded rollout server on the same GPU: step time and memory at real V4 shapes (head_dim 512, ratios 4/128, real
# vocab). A random model scores ~0 on math, so read t_roll / t_train / t_sync, not reward (bench/RESULTS.md).
#   python train_grpo.py config/h200.py                                   # the math task: no download, no network
#   python train_grpo.py config/h200.py --data=<DAPO-Math-17k .parquet or .jsonl> --eval_data=data/aime2024.jsonl
out_dir = 'out/h200'
seed = 1337
max_steps = 20

init_from = 'scratch'
model_config = 'config/models/bench_2b.json'
dtype = 'bfloat16'
compile = 'off'  # 'layers' compiles the trainer's layers (minutes cold); the server replays CUDA graphs of eager

# one GPU, so no PP/EP; micro-batches bound activation memory (128 samples / 16 = 8 per micro-batch)
pp_size, ep_size = 1, 1
n_microbatches = 16
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
kl_coef, entropy_coef = 0.0, 0.0
eps_low, eps_high = 0.2, 0.28
tis_cap = 2.0
eval_interval, eval_n_samples = 10, 8
checkpoint_interval, keep_checkpoints = 10, 1
