# The base for config/h200_math.py on one H200: config/models/math_265m.json (265M parameters, 95M active: CSA +
# indexer and HCA layers, 2 hash-routed layers, 16 experts top-4 + a shared one, mHC with 4 streams, no MTP)
# trained from scratch on worked solutions of three-operation, two-digit problems, half of them from the noisy
# teacher (tasks.math_batch), so the base writes well-formed solutions that are often wrong.
# Not yet run on a GPU: max_steps, lr and math_teacher_error are first settings, to be checked against the
# held-out pass@1 at the end (the target is 0.2-0.6 with >= 90% well-formed).
#   python train_sft.py config/sft_h200_math.py          # writes out/h200_math/base, where h200_math.py looks
out_dir = 'out/h200_math/base'
seed = 1337
max_steps = 1000

init_from = 'scratch'
model_config = 'config/models/math_265m.json'
dtype = 'bfloat16'
tokenizer = 'bytes'

math_steps = 3
math_digits = 2
math_ops = '+-'
math_words = 0.0
math_teacher_error = 0.5
batch_size = 256
n_microbatches = 2

lr = 8e-4
lr_schedule = 'linear'
warmup_steps = 50
min_lr_ratio = 0.1
grad_clip = 1.0

eval_interval = 250
n_test = 200
eval_n_samples = 8
eval_temperature = 1.0
max_new_tokens = 160
