# The seed run: GRPO on DeepSeek-V4-Flash (284B / 13B active) with DAPO-Math-17k, after the AMD/Miles
# MI355X recipe: 4 nodes x 8 MI355X train with TP1/PP4/EP4, so dp = 32/4 = 8 and EP
# folds into DP; SGLang rollout servers run elsewhere and are reached by URL. (The blog used 2 actor nodes,
# dp 4, plus 2 rollout nodes: same file, --nnodes=2.) On every node, with $MASTER_ADDR = node 0:
#   torchrun --nproc_per_node=8 --nnodes=4 --node_rank=$NODE_RANK --master_addr=$MASTER_ADDR \
#            --master_port=29500 train_grpo.py config/mi355x.py
out_dir = 'out/mi355x'  # must be on a filesystem all nodes see; the bf16 weights alone are ~0.6 TB
max_steps = 100
wandb_log, wandb_project = True, 'nano-dsv4-rl'

# model: the official checkpoint; its own config.json gives the shape when it is read
init_from = '/data/DeepSeek-V4-Flash'
model_config = 'config/models/flash.json'  # the same shape, for --dry_run=True (the memory plan, no hardware)
dtype = 'bfloat16'
resume = True  # after a crash, relaunching the same command continues from the newest checkpoint in out_dir

# 43 layers over 4 stages, 256 experts over 4 ranks (64 each); 256 samples / dp 8 = 32 micro-batches of 1
pp_size, ep_size = 4, 4
n_microbatches = 32
recompute, optimizer_offload = True, True  # fp32 master + Adam is 12 bytes/param: keep it in host RAM

# rollout: comma-separated SGLang servers (TP4/EP4 each, FP8 experts); NCCL broadcast sync across nodes
rollout_url = 'http://rollout-0:30000,http://rollout-1:30000,http://rollout-2:30000,http://rollout-3:30000'
weight_sync = 'distributed'
rollout_quant = 'fp8'  # the engine runs SGLANG_DSV4_FP4_EXPERTS=0, so experts are FP8 too, not FP4

# data: the hub (network on every node, or --data=<a .jsonl copy>) repeats each problem 100x; one of each is kept
data = 'BytedTsinghua-SIA/DAPO-Math-17k'
eval_data = 'data/aime2024.jsonl'  # 30 problems (data/README.md); the hub's AIME-2024 repeats them 32x
n_prompts, n_samples = 32, 8
max_prompt_len, max_new_tokens = 1024, 4096  # the blog's cap; 55-60% of AIME answers were truncated at it
temperature, top_p = 0.8, 1.0

# GRPO as in Miles' DSV4 recipe: clip-higher, no KL, no entropy, per-sample token mean, TIS capped at 2
lr, lr_schedule, warmup_steps = 1e-6, 'constant', 0
weight_decay, grad_clip = 0.1, 1.0
eps_low, eps_high, tis_cap = 0.2, 0.28, 2.0
kl_coef, entropy_coef, loss_agg = 0.0, 0.0, 'seq_mean_token_mean'
trainable, freeze_router = 'all', True  # every parameter but the router gates, as large-MoE RL recipes train
eval_interval, eval_n_samples, checkpoint_interval, keep_checkpoints = 10, 8, 20, 2
