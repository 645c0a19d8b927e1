# The seed's before/after table at our scale, on one H200: GRPO with the DAPO settings from the base that
# config/sft_h200_math.py makes, on RL prompts the SFT never saw, held-out pass@1 and pass@8 on 200 problems.
# Steps 0-28 ran with the random-slip base (bench/RESULTS.md); with config/sft_h200_math.py's misconception teacher
# it is not yet run. Each command on the lent H200 runs <= 10 minutes, so the run goes in parts:
#   python train_sft.py config/sft_h200_math.py                      # the base, in out/h200_math/base
#   python train_grpo.py config/h200_math.py                          # GRPO; checkpoints every 10 steps
#   python train_grpo.py config/h200_math.py --resume=True            # again until step 100
#   python scripts/plot_metrics.py out/h200_math/metrics.jsonl
out_dir = 'out/h200_math'
seed = 1337
max_steps = 100
init_from = ''  # the base in out_dir/base
sft_config = 'config/sft_h200_math.py'
dtype = 'bfloat16'
compile = 'off'

weight_sync = 'tensor'  # the embedded server on the same GPU reads the trainer's buckets through CUDA IPC
rollout_quant = 'none'  # --rollout_quant=fp8 for the seed's own setting
rollout_max_batch = 1024  # a step's 256 samples in one wave, an eval's 1600 in two

data, eval_data = 'math', 'math'
math_steps, math_digits, math_ops, math_words = 3, 2, '+--', 0.0  # as in sft_config
n_rl, n_test = 4000, 200
n_prompts, n_samples = 32, 8  # the seed's batch (config/mi355x.py); 64 x 8 took 10-12 s a step, mostly rollouts
max_prompt_len, max_new_tokens = 64, 160  # prompts are <= 16 bytes, worked solutions <= 128
n_microbatches = 4

# DAPO: clip-higher, dynamic sampling, token-level loss, truncated importance sampling; no KL, no entropy bonus
lr = 3e-5
eps_low, eps_high = 0.2, 0.28
dynamic_sampling, max_sampling_rounds = True, 2  # each round costs a whole decode's latency
loss_agg = 'token_mean'
tis_cap = 2.0

eval_interval = 100  # held-out evals at steps 0 and 100 (~40 s each: the budget of one session holds no more)
eval_n_samples = 8
checkpoint_interval, keep_checkpoints = 10, 2
