# Smoke test of the whole GRPO loop on CPU: a tiny DeepSeek-V4 (config/models/tiny.json, 19M params) from
# scratch, the embedded rollout server, and a toy task whose reward a random model can still move.
# It checks that the loop runs (and that PP/EP give the same numbers as one rank), not that it learns math.
#   python train_grpo.py config/cpu_tiny.py
#   torchrun --standalone --nproc_per_node=4 train_grpo.py config/cpu_tiny.py --pp_size=2 --ep_size=2
out_dir = 'out/cpu_tiny'
seed = 1337
max_steps = 10
dry_run = False

# model: scratch init in float32, so multi-rank runs can be compared with one rank to fp32 tolerance
init_from = 'scratch'
model_config = 'config/models/tiny.json'
dtype = 'float32'
resume = False

# parallel layout: dp = world / pp, EP folds into DP, and ep_size must divide the 16 experts
pp_size = 1
ep_size = 1
n_microbatches = 2  # > 1 even at pp 1, so the micro-batch loop is exercised

# rollout: '' starts the embedded server in-process; weights cross as CPU tensors
rollout_url = ''
weight_sync = 'disk'  # the embedded server reads the trainer's safetensors shards
rollout_quant = 'none'

# data and GRPO: 4 prompts x 4 samples, short answers
data = 'toy'
eval_data = 'toy'
n_prompts, n_samples = 4, 4
max_new_tokens = 16
temperature, top_p = 1.0, 1.0
lr = 3e-4  # a scratch model needs a real learning rate, unlike the 1e-6 of RL on a pretrained one
trainable = 'all'  # every parameter, experts included, so the layouts are compared on all of them
entropy_coef = 0.0
eval_interval, eval_n_samples = 5, 2
checkpoint_interval, keep_checkpoints = 5, 1
wandb_log = False
