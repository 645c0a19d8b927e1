# The seed's before/after table at our scale, on one GPU: GRPO with DAPO's settings from the base that
# config/sft_gpu_math.py makes, on RL prompts the SFT never saw; held-out pass@k on 200 problems x 8 samples at
# steps 0, 25, 50, 75 and 100. Its figures: README's Results, bench/RESULTS.md.
#   python train_sft.py config/sft_gpu_math.py       # the base, in out/gpu_math/base
#   python train_grpo.py config/gpu_math.py           # 100 steps; a SIGTERM stops
#   python train_grpo.py config/gpu_math.py --resume=True      # it with a checkpoint, --resume goes on
#   python scripts/plot_metrics.py out/gpu_math/metrics.jsonl
out_dir = 'out/gpu_math'
seed = 1337
max_steps = 100
init_from = ''  # the base in out_dir/base
sft_config = 'config/sft_gpu_math.py'
dtype = 'bfloat16'
compile = 'off'

weight_sync = 'tensor'  # the embedded server on the same GPU reads the trainer's buckets through CUDA IPC
rollout_quant = 'none'  # --rollout_quant=fp8 for the seed's own setting
train_quant = 'none'  # --train_quant=fp8 with it: the actor computes what the FP8 engine computes
rollout_max_batch = 1024  # a step's 256 samples in one wave, an eval's 1,600 in two

data, eval_data = 'math', 'math'
math_steps, math_digits, math_ops, math_words = 3, 2, '+--', 0.0  # as in sft_config
n_rl, n_test = 4000, 200
n_prompts, n_samples = 32, 8  # the seed's batch (config/mi355x.py)
max_prompt_len, max_new_tokens = 64, 160  # prompts are <= 16 bytes, worked solutions <= 128
micro_batch_tokens = 4096  # a step's ~100-250 samples in 3-8 micro-batches of 16 rows x 240, padding ~12 %

# DAPO: clip-higher, dynamic sampling, token-level loss, truncated importance sampling; no KL, no entropy bonus
lr = 3e-5
eps_low, eps_high = 0.2, 0.28
dynamic_sampling, max_sampling_rounds = True, 2  # each round costs a whole decode's latency
max_oversample = 1.0  # as run for the table (README); 2.0 draws ahead by the last kept share, in fewer rounds
loss_agg = 'token_mean'
tis_cap = 2.0

eval_interval = 25
eval_n_samples = 8
checkpoint_interval, keep_checkpoints = 10, 2
