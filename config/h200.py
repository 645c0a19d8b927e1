# One H200 (141 GB): the bench_2b model (2.43B total, 0.79B active; spec §7.2) from scratch, with the embedded
# rollout server on the same GPU: step time and memory at real V4 shapes (head_dim 512, ratios 4/128, real vocab);
# a random model scores ~0 on math, so read t_roll/t_train/mfu, not reward. Measured with --data=toy (6 steps of
# 64 samples x 64 tokens; bench/RESULTS.md): the server compiled its decode in 103 s (273-332 s from a cold cache);
# steps trained in 2.5-12 s (the first compiling), rollouts 1.3-8.2 s, sync 0.2 s, at most 77 GB.
#   python train_grpo.py config/h200.py
out_dir = 'out/h200'
seed = 1337
max_steps = 20

init_from = 'scratch'
model_config = 'config/models/bench_2b.json'
dtype = 'bfloat16'
compile = 'layers'  # each layer one inductor graph, in the trainer and the server (compile_policy.compile_layers)

# one GPU, so no PP/EP; micro-batches bound activation memory (128 samples / 16 = 8 per micro-batch)
pp_size, ep_size = 1, 1
n_microbatches = 16
recompute = True  # ~2k-token samples x 4 mHC streams; spec §7.2 budgets ~80 GB for activations
optimizer_offload = False  # fp32 master + Adam is ~39 GB, it fits

# embedded server, colocated: the weights are handed over on the same GPU, in bf16
rollout_url = ''
weight_sync = 'tensor'  # CUDA IPC handles to the trainer's buckets, read by the server on the same GPU
rollout_quant = 'none'

# DAPO-Math-17k from the hub (needs network; one of its 100 copies of each problem kept), or --data=<.jsonl/.parquet>;
# AIME-2024 (30 problems) from the copy in data/ (data/README.md)
data = 'BytedTsinghua-SIA/DAPO-Math-17k'
eval_data = 'data/aime2024.jsonl'
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
