# The seed run's layout (config/mi355x.py) rehearsed on the CPU: pipeline and expert parallel, recompute, optimizer
# offload, distributed weight sync into FP8 rollouts, evals, checkpoints and resume, on 4 gloo ranks with the micro
# V4 from the SFT base (so steps have reward spread and train). scripts/rehearsal.py makes the base, runs 100 steps,
# kills the job in the middle, resumes it and reports; by hand, after the base (train_sft.py config/sft_micro.py):
#   torchrun --standalone --nproc_per_node=4 train_grpo.py config/rehearsal.py --init_from=out/rehearsal/base
out_dir = 'out/rehearsal'
max_steps = 100
wandb_log = False

# model: the micro base (config/models/micro.json: 4 layers, 8 experts), in float32 as it was trained
init_from = 'out/rehearsal/base'  # python train_sft.py config/sft_micro.py --out_dir=out/rehearsal/base
dtype = 'float32'
resume = True  # relaunching the same command continues from the newest checkpoint in out_dir

# the seed's PP4 x EP4 scaled to PP2 x EP2: 4 layers over 2 stages, 8 experts over 2 ranks (4 each); dp = 4 / 2 = 2
pp_size, ep_size = 2, 2
n_microbatches = 8  # 32 samples per DP rank: micro-batches of 4, enough for 1F1B to reach its steady state
recompute, optimizer_offload = True, True

# rollout: the embedded server stands in for SGLang; the seed's NCCL broadcast sync is a gloo one here
rollout_url = ''
weight_sync = 'distributed'
rollout_quant = 'fp8'  # the engine serves e4m3 weights with a scale per 128x128 block, as the seed's SGLang does

# data: the math task (tasks.py), RL prompts the base never saw, the held-out set at each eval
data, eval_data = 'math', 'math'
n_prompts, n_samples = 8, 8
max_new_tokens = 64

# GRPO as in the seed but for the learning rate (1e-6 is for a pretrained 284B model; the micro base takes 1e-4)
lr, lr_schedule, warmup_steps = 1e-4, 'constant', 0
weight_decay, grad_clip = 0.1, 1.0
eps_low, eps_high, tis_cap = 0.2, 0.28, 2.0
kl_coef, entropy_coef, loss_agg, trainable = 0.0, 0.0, 'seq_mean_token_mean', 'all'
eval_interval, eval_n_samples, eval_limit = 10, 4, 64
checkpoint_interval, keep_checkpoints = 10, 2
watchdog_s, dist_timeout = 900, 300  # a step (its eval included) over 15 min is a hang: stacks, then exit 124
