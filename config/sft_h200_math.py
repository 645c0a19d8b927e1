# The base for config/h200_math.py on one H200: config/models/math_265m.json (265M parameters, 95M active: CSA +
# indexer and HCA layers, 2 hash-routed layers, 16 experts top-4 + a shared one, mHC with 4 streams, no MTP)
# trained from scratch on worked solutions of three-operation, two-digit problems (two subtractions to an addition),
# 90% of them from a teacher who subtracts without borrowing (tasks.math_batch's teacher_bug), so the base writes
# well-formed solutions that fail most problems with a borrow, the same ones in every sample: pass@8 has room to grow.
# A teacher who slips at random instead (math_teacher_error=0.5, math_ops='+-', 335 steps) gave a base at pass@1
# 0.567 but pass@8 0.995, and GRPO took pass@1 to 0.996 in 25 steps (2026-12-05, H200, 1cb239f; bench/RESULTS.md).
# 335 steps take 5 min on an H200 (0.88 s a step); math_teacher_bug is a first setting, not yet run. What to expect:
# the bug's solution is wrong on 62.5% of 4,000 problems of the held-out pool, so a base that copies the
# teacher would score pass@1 ~0.44 and pass@8 ~0.73 (1 - 0.625 x 0.9^8), and a cured one 1.0 on both.
#   python train_sft.py config/sft_h200_math.py          # writes out/h200_math/base, where h200_math.py looks
out_dir = 'out/h200_math/base'
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
n_microbatches = 2

lr = 8e-4
lr_schedule = 'linear'
warmup_steps = 50
min_lr_ratio = 0.1
grad_clip = 1.0

eval_interval = 0  # the held-out eval after the last step (~1 min)
n_test = 200
eval_n_samples = 8
eval_temperature = 1.0
max_new_tokens = 160
