"""
Supervised fine-tuning (SFT) of DeepSeek-V4 on the math task's worked solutions (tasks.py): the base model that
train_grpo.py then improves with RL on held-out problems it half solves. It runs on the GRPO trainer's own parts:
the pipeline stages and 1F1B step (parallel.py), the micro-batches (grpo.py), the chunked head and its token logprobs
(chunked_head.py), AdamW (optimizer.py) and the official-layout weight writer (checkpoint.save_weights).

    python train_sft.py config/sft_micro.py                    # the default base: micro V4, 2 CPU cores, ~3 min
    torchrun --standalone --nproc_per_node=4 train_sft.py config/sft_micro.py --pp_size=2 --ep_size=2
    python train_grpo.py --init_from=out/sft_micro ...                 # GRPO from the base

One step: one global batch from the supervised pool, drawn by the same seeded generator on every rank and then
sharded over DP (so every layout trains on the same examples and equals one process) -> micro-batches of
(prompt, worked solution + EOS), a share math_teacher_error of the solutions with the noisy teacher's slip ->
cross-entropy of the solution tokens, a mean over every solution token of the global batch (no prompt tokens) ->
1F1B over the stages, grads reduced over DP (experts over EDP), clip, AdamW.
At every eval_interval and at the end, the weights go to out_dir in the official layout (train_grpo --init_from
and checkpoint.from_pretrained read it) and rank 0 samples the fixed held-out test set from them with the
in-process engine: pass@k by eval_aime's unbiased estimator, graded by math_reward, and the share of samples that
end in a well-formed "Answer: <integer>". No resume: a run is a few minutes; GRPO starts with fresh moments anyway.
"""
import glob
import json
import os
import random
import subprocess
import sys
import time

import torch

import grpo
import parallel
from checkpoint import from_pretrained, load_weights, save_weights
from engine import Engine
from graphs import StepGraphs, why_not
from kernel_check import choose as choose_kernels
from eval_aime import evaluate, summary
from model_dsv4 import ModelArgs, pack_multiple
from optimizer import AdamW, lr_at
from rollout import LocalClient
from tasks import load_tokenizer, math_batch, math_problems, prompt_ids

# -----------------------------------------------------------------------------
# config: every default, then config/*.py and --key=value overrides (configurator.py)
out_dir = 'out/sft'
seed = 1337
max_steps = 200
# model
init_from = 'scratch'  # 'scratch' (model_config) or a checkpoint directory with config.json + safetensors
model_config = 'config/models/micro.json'
dtype = 'float32'  # 'float32' | 'bfloat16'
kernels = 'auto'  # 'auto': the fast paths that pass kernel_check.py on this GPU | 'fast' | 'reference'
tokenizer = 'bytes'  # 'bytes' | 'deepseek-v4' | a tokenizer.json path
# parallel layout (tensor parallel is fixed at 1)
pp_size = 1
ep_size = 1
pp_layers = ''  # e.g. '2,2'; '' = balanced
n_microbatches = 2  # per DP rank, without a token budget
micro_batch_tokens = 0  # > 0: micro-batches of this many tokens, as many as the batch needs (train_grpo.py's key);
# 0: 16384 where training graphs run, else n_microbatches a step
pack_samples = True  # several samples a row, kept apart (grpo.pack_rows), as train_grpo.py packs them
recompute = False
loss_chunk = 1024  # tokens whose head logits exist at once in the loss (chunked_head.py)
train_graphs = 'off'  # 'auto': a micro-batch's forward and backward replayed as a CUDA graph on one GPU (graphs.py)
dist_timeout = 600
# data: the math task (tasks.py); the knobs are train_grpo's too, so that both see the same pools
math_steps = 2  # operations per problem
math_digits = 1  # digits per operand
math_ops = '+-'  # from '+-*'
math_words = 0.0  # share of word problems
math_teacher_error = 0.4  # share of solutions with a miscopied intermediate result (tasks.math_batch): GRPO fixes it
math_teacher_bug = 0.0  # share of solutions that subtract without borrowing (tasks.math_batch): fails the same problems
batch_size = 64  # problems per step, all DP ranks together
# optimizer
lr = 3e-3
lr_schedule = 'linear'  # 'constant' | 'linear' | 'cosine': after the warm-up, down to min_lr_ratio * lr at max_steps
warmup_steps = 20
min_lr_ratio = 0.1
weight_decay = 0.0
grad_clip = 1.0
# held-out evaluation and logging
eval_interval = 0  # 0: only after the last step
n_test = 200  # held-out problems (math_problems('test', n_test): fixed for a task config)
eval_n_samples = 8
eval_temperature = 1.0
max_new_tokens = 96
log_interval = 10
config_keys = [k for k, v in globals().items() if not k.startswith('_') and isinstance(v, (int, float, bool, str))]
try:
    exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'configurator.py')).read())
    if loss_chunk < 1 or micro_batch_tokens < 0:
        raise ValueError(f"loss_chunk={loss_chunk!r} (positive), micro_batch_tokens={micro_batch_tokens!r} (0 or more)")
    if train_graphs not in ('auto', 'off'):
        raise ValueError(f"train_graphs={train_graphs!r}: choose one of auto, off")
    if lr_schedule not in ('constant', 'linear', 'cosine') or dtype not in ('float32', 'bfloat16'):
        raise ValueError(f"lr_schedule={lr_schedule!r} (constant, linear, cosine), dtype={dtype!r} (float32, bfloat16)")
    if init_from != 'scratch' and not os.path.isfile(os.path.join(init_from, 'config.json')):
        raise ValueError(f"init_from={init_from!r} is not a checkpoint directory (no config.json in it)")
    model_dir = init_from if init_from != 'scratch' else None
    args = ModelArgs.from_json(os.path.join(model_dir, 'config.json') if model_dir else model_config)
    tok = load_tokenizer(tokenizer)
    if tok.vocab_size > args.vocab_size:
        raise ValueError(f"tokenizer {tokenizer!r} has {tok.vocab_size} ids, more than the model's vocab_size "
                         f"{args.vocab_size}")
    knobs = dict(steps=math_steps, digits=math_digits, ops=math_ops, words=math_words)
    test = math_problems('test', n_test, **knobs) if n_test else []
    if not (0 <= math_teacher_error and 0 <= math_teacher_bug and math_teacher_error + math_teacher_bug < 1):
        raise ValueError(f"math_teacher_error={math_teacher_error}, math_teacher_bug={math_teacher_bug}: shares of the "
                         f"solutions, >= 0 and together < 1")
except ValueError as e:  # bad config is a usage error: say it and exit 2
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
config = {k: globals()[k] for k in config_keys}
t_start = time.time()

# -----------------------------------------------------------------------------
# distributed init
grid = parallel.init_distributed(pp_size, ep_size, timeout_s=dist_timeout)
if batch_size % grid.dp_size:
    print(f"error: batch_size {batch_size} must divide by dp = {grid.dp_size}", file=sys.stderr)
    sys.exit(2)
master = grid.rank == 0
is_logger = grid.is_last_stage and grid.dp_rank == 0  # the loss lives on the last stage
print0 = lambda *a: print(*a, flush=True) if master else None
torch.manual_seed(seed)
ptype = {'float32': torch.float32, 'bfloat16': torch.bfloat16}[dtype]
print0(f"config: {json.dumps(config)}")
print0(f"git: {subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], capture_output=True, text=True).stdout.strip()}"
       f" | {grid}")

# -----------------------------------------------------------------------------
# model, optimizer
split = [int(x) for x in pp_layers.split(',')] if pp_layers else None
model = parallel.build_stage(args, grid, dtype=ptype, pp_layers=split, init=model_dir is None, seed=seed)
if model_dir:
    load_weights(model, model_dir, strict=False, device=grid.device)
fast = choose_kernels(kernels, args, grid.device, ptype, print0)  # 'auto': each fast path checked here first
model.set_kernels(fast)
model.loss_chunk = loss_chunk
graphs = StepGraphs(model, grid, log=print0) if (why := why_not(grid, model, train_graphs)) is None else None
print0(f"train graphs: {'on' if graphs else f'off ({why})'}")
mb_tokens = micro_batch_tokens or (16384 if graphs else 0)  # graphs replay fixed shapes: a token budget
pack, row_len = pack_multiple(args) if pack_samples else 0, 0  # row_len: the budget's, kept while samples fit it
print0(f"micro-batches: {f'{mb_tokens} tokens each' if mb_tokens else f'{n_microbatches} a step'}")
for name, p in model.named_parameters():  # every parameter but MTP's, which has no loss here
    p.requires_grad_(not name.startswith('mtp.'))
opt = AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
n_params = sum(p.numel() for p in model.parameters())
print0(f"rank 0 holds {n_params / 1e6:.2f}M parameters ({'scratch' if not model_dir else model_dir}), {dtype}")
lr_of = lambda step: lr_at(step, lr, warmup_steps, lr_schedule, max_steps, min_lr_ratio)


# -----------------------------------------------------------------------------
# held-out evaluation: rank 0 samples the written checkpoint with an in-process engine (rollout.LocalClient)


def save_and_evaluate(step):
    """Write the weights to out_dir (collective), then rank 0 evaluates them; every rank returns the metrics."""
    save_weights(model, grid, out_dir, args)
    res = {}
    if master and test:
        t = time.time()
        eval_model = from_pretrained(out_dir, device=grid.device, dtype=ptype)  # what GRPO will start from
        eval_model.set_kernels(fast)
        max_len = max(len(prompt_ids(tok, p['prompt'])) for p in test) + max_new_tokens
        engine = Engine(eval_model, max_batch=min(1024, len(test) * eval_n_samples), max_len=max_len)
        ev = evaluate(LocalClient(engine), tok, test, eval_n_samples,
                      dict(temperature=eval_temperature, top_p=1.0, max_new_tokens=max_new_tokens),
                      seed=seed, chat=False)
        res = {f'eval_{k}': v for k, v in ev.items() if k != 'per_problem'}
        res['t_eval'], res['summary'] = time.time() - t, summary(ev)
    return parallel.broadcast_object(res, 0, grid.world_group, 'eval metrics')


# -----------------------------------------------------------------------------
# the loop
os.makedirs(out_dir, exist_ok=True)
if master:  # a fresh run: stale shards of another layout would be read with the new ones (checkpoint_index globs)
    for f in glob.glob(os.path.join(out_dir, 'model-*.safetensors')):
        os.remove(f)
if is_logger:
    open(os.path.join(out_dir, 'metrics.jsonl'), 'w').close()
parallel.barrier(grid.world_group, 'out_dir cleared')
rng = random.Random(seed)  # the same stream on every rank: one global batch a step
loss_fn = lambda logp, entropy, mb: -(logp * mb['weight'] * mb['mask']).sum()  # Transformer.head_loss calls it
for step in range(max_steps):
    t0 = time.time()
    batch = math_batch(rng, batch_size, **knobs, teacher_error=math_teacher_error, teacher_bug=math_teacher_bug)
    pairs = [(prompt_ids(tok, p['prompt']), tok.encode(p['solution']) + [tok.eos_id]) for p in batch]
    n_tokens = sum(len(r) for _, r in pairs)  # the loss is a mean over every solution token of the global batch
    mine = pairs[grid.dp_rank::grid.dp_size]
    groups = [(p, [{'output_ids': r, 'logprobs': [0.0] * len(r)}], [1.0]) for p, r in mine]
    # as many micro-batches on every DP rank (expert-parallel peers run each one together)
    n, row_len = grpo.count_microbatches(groups, n_microbatches, pack, mb_tokens, 1, row_len)
    n = parallel.all_reduce(torch.tensor(float(n), device=grid.device), grid.dp_group, 'micro-batches',
                            op=torch.distributed.ReduceOp.MAX if mb_tokens else torch.distributed.ReduceOp.MIN).item()
    mbs = grpo.make_microbatches(groups, int(n), float(n_tokens), 'token_mean', grid.device, pack=pack,
                                 tokens=mb_tokens, row_len=row_len)
    for g in opt.param_groups:
        g['lr'] = lr_of(step)
    m = parallel.train_step(model, grid, opt, mbs, loss_fn, grad_clip, graphs.train if graphs else '1f1b', recompute)
    loss = torch.tensor(m.get('loss', 0.0), dtype=torch.float64, device=grid.device)
    loss = parallel.all_reduce(loss, grid.dp_group, 'loss').item()  # the last stage's; other stages hold 0
    dt, tokens = time.time() - t0, sum(len(p) + len(r) for p, r in pairs)
    rec = {'step': step, 'loss': loss, 'lr': lr_of(step), 'grad_norm': m['grad_norm'], 'skipped': m['skipped'],
           'tokens': tokens, 'tok_s': tokens / dt, 't_step': dt, **grpo.layout_metrics([groups], [mbs], grid),
           **(graphs.take_counts() if graphs else {})}
    last = step + 1 == max_steps
    ev = save_and_evaluate(step) if last or (eval_interval and (step + 1) % eval_interval == 0) else {}
    line = ev.pop('summary', None)
    rec.update(ev, elapsed_s=time.time() - t_start)
    if is_logger:
        open(os.path.join(out_dir, 'metrics.jsonl'), 'a').write(json.dumps(rec) + '\n')
        if step % log_interval == 0 or line or last:
            print(f"step {step:05d}/{max_steps} | loss {loss:.4f} | lr {rec['lr']:.2e} | gnorm {m['grad_norm']:.2f} | "
                  f"{rec['tok_s']:.0f} tok/s | {dt:.2f}s | {rec['elapsed_s']:.0f}s | {rec['micro_batches']} x "
                  f"{rec['row_len']} pad {rec['padding']:.0%}"
                  + (f" | graphs: {rec['graph_captured']} captured" if rec.get('graph_captured') else '')
                  + (f" | {rec['graph_eager']} micro-batches eager (graphs full)" if rec.get('graph_eager') else '')
                  + (' | skipped: non-finite' if m['skipped'] else ''), flush=True)
        if line:
            print(f"  held-out after step {step}: {line} ({rec['t_eval']:.0f}s)", flush=True)

# -----------------------------------------------------------------------------
# cleanup
if grid.world_size > 1:
    parallel.barrier(grid.world_group, 'the end')
    torch.distributed.destroy_process_group()
print0(f"done: the base is in {out_dir} (train_grpo.py --init_from={out_dir})")
