# The base for config/gpu_math.py: config/models/math_265m.json (265M parameters, 95M active: CSA + indexer and HCA
# layers, 2 hash-routed layers, 16 experts top-4 + a shared one, mHC with 4 streams, no MTP) trained from scratch on
# worked solutions of three-operation, two-digit problems (two subtractions to an addition), 90% of them from a
# teacher who subtracts without borrowing (tasks.math_batch's teacher_bug). The base writes well-formed solutions that
# fail most problems with a borrow, the same ones in every sample, so pass@8 has room to grow: the bug's solution is
# wrong on 62.5% of the held-out pool, and a base that copies the teacher scores pass@1 ~0.44 and pass@8 ~0.73.
# Its figures: bench/RESULTS.md.
#   python train_sft.py config/sft_gpu_math.py          # writes out/gpu_math/base, where gpu_math.py looks
out_dir = 'out/gpu_math/base'
seed = 1337
max_steps = 330

init_from = 'scratch'
model_config = 'config/models/math_265m.json'
dtype = 'bfloat16'
tokenizer = 'bytes'

math_steps = 3
math_digits = 2
math_ops = '+--'  # ops are drawn uniformly from the string
math_words = 0.0
math_teacher_error = 0.0
math_teacher_bug = 0.9
batch_size = 256
micro_batch_tokens = 4096  # the batch's 256 packed samples in ~8 micro-batches of one shape

lr = 8e-4
lr_schedule = 'linear'
warmup_steps = 50
min_lr_ratio = 0.1
grad_clip = 1.0

eval_interval = 0  # the held-out eval after the last step
n_test = 200
eval_n_samples = 8
eval_temperature = 1.0
max_new_tokens = 160
