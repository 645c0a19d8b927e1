# The default base for GRPO: the micro V4 (config/models/micro.json, 2.2M parameters: window, CSA + indexer and HCA
# layers, a hash-routed layer, 8 routed experts top-2 + a shared one, mHC with 4 streams) trained from scratch on
# the math task's worked solutions, on 2 CPU cores. train_grpo.py runs this first when it is given no init_from.
#   python train_sft.py config/sft_micro.py
#   python train_grpo.py --init_from=out/sft_micro
out_dir = 'out/sft_micro'
seed = 1337
max_steps = 250

init_from = 'scratch'
model_config = 'config/models/micro.json'
dtype = 'float32'
tokenizer = 'bytes'

# the math task: two operations on one-digit numbers ("4+8-3=?"), the second step in columns
math_steps = 2
math_digits = 1
math_ops = '+-'
math_words = 0.0
batch_size = 64
n_microbatches = 1  # the whole batch in one forward: on the CPU fewer, bigger ops are faster
pack_samples = False  # on the CPU the packed rows' masks cost more than the padding they save here
# 60% of the worked solutions come from a noisy teacher that carries one intermediate result into the next step one
# too high (tasks.math_batch). The base imitates the slip as well as the skills: it writes well-formed solutions
# (>= 99% end in "Answer: <integer>") that are right about 40% of the time, and more supervised training on these
# solutions does not fix that, since the slip is part of what it imitates. A reward for the true answer does.
math_teacher_error = 0.6

# AdamW 3e-3 after a 20-step warm-up, then a linear decay to 3e-4 at the last step
lr = 3e-3
lr_schedule = 'linear'
warmup_steps = 20
min_lr_ratio = 0.1
grad_clip = 1.0

# the held-out test set: 200 problems, 8 samples each at temperature 1, after the last step
eval_interval = 0
n_test = 200
eval_n_samples = 8
eval_temperature = 1.0
max_new_tokens = 64
