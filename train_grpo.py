"""
GRPO post-training of DeepSeek-V4 on the hand-written PP/EP/DP trainer, with rollouts from SGLang or from the
embedded server (rollout.py), which speaks the same HTTP API.

    python train_grpo.py                   # the default: a micro V4 made a base by SFT on the math task, then GRPO
    torchrun --nproc_per_node=4 train_grpo.py config/cpu_tiny.py --pp_size=2 --ep_size=2
    torchrun --nnodes=4 --nproc_per_node=8 ... train_grpo.py config/mi355x.py     # the seed run (README)

The default run (CPU, no download): train_sft.py makes the base in out_dir/base (unless it is there) from worked
solutions of the math task (tasks.py); GRPO then trains every parameter on prompts the SFT never saw, with held-out
evals before the first update, every eval_interval steps and after the last.

One step: prompts (sharded over DP ranks) -> n samples each from the rollout servers -> rewards ->
group-normalised advantages -> dynamic sampling -> pipelined training -> weight sync -> metrics -> eval -> checkpoint.

Where this differs from the GRPO paper (Shao et al. 2024), each a common choice in current RL stacks:
  - no KL penalty by default (kl_coef=0); when on, it is the k3 estimator against a frozen reference, in the loss;
  - clip-higher (DAPO): the ratio is clipped to [1 - eps_low, 1 + eps_high] = [0.8, 1.28], not symmetric;
  - advantages (r - mean) / (std + 1e-6) over the group, std skipped when zero (then all advantages are 0);
  - dynamic sampling (DAPO): groups whose rewards are all equal are dropped, more prompts drawn to refill the batch;
  - the loss is aggregated as a per-sample token mean averaged over samples (default) or a token mean over all
    tokens (DAPO), normalised by *global* counts so the layout does not change the result;
  - truncated importance sampling (TIS) against the rollout engine's logprobs, weight min(pi_old/pi_rollout, cap),
    corrects for the engine/trainer mismatch;
  - one optimizer step per rollout by default (strictly on-policy: ratio 1 at the step), several with n_minibatches;
  - the reward is 0/1 (eval_aime.math_reward, the same grader as evaluation), optionally with DAPO's overlong penalty.
"""
import functools
import json
import math
import os
import random
import subprocess
import sys
import time

import torch
import torch.distributed as dist

import checkpoint
import faults
import compile_policy
import parallel
import replay
from memory_plan import plan_table, step_peaks
import weight_sync as wsync
from eval_aime import evaluate, load_problems, math_reward, overlong_penalty, summary
import grpo
from graphs import StepGraphs, why_not
from grpo import deal, group_advantages, inert_group, keep_group, make_microbatches
from kernel_check import choose as choose_kernels
from model_dsv4 import ModelArgs, length_multiple, pack_multiple
from optimizer import AdamW, lr_at
from rollout import EmbeddedServer, RolloutClient
from tasks import load_tokenizer, math_problems, prompt_ids, toy_problems

# -----------------------------------------------------------------------------
# config: every default, then config/*.py and --key=value overrides (configurator.py)
out_dir = 'out/default'
seed = 1337
max_steps = 30
dry_run = False  # build the layout on the meta device, print the per-rank memory plan and the loss's peak, exit
dry_run_world = 32  # the GPUs the dry run plans for (under torchrun: WORLD_SIZE)
# model
init_from = ''  # '': the SFT base in out_dir/base (train_sft.py sft_config makes it) | 'scratch' | a checkpoint dir
sft_config = 'config/sft_micro.py'  # init_from='': the base's recipe, for train_sft.py
model_config = 'config/models/micro.json'  # init_from='scratch': the architecture
dtype = 'float32'  # 'float32' | 'bfloat16' (parameters and activations; fp32 islands stay fp32)
kernels = 'auto'  # 'auto': the fast paths (dsv4_kernels/) that pass kernel_check.py on this GPU | 'fast' | 'reference'
compile = 'off'  # 'layers': layers, head, loss compiled | 'background': blocks, in a side thread (compile_policy.py)
rollout_compile = 'off'  # the embedded server: 'off' replays CUDA graphs of its eager decode; 'layers' compiles first
train_graphs = 'off'  # 'auto': a micro-batch's forward and backward replayed as a CUDA graph on one GPU (graphs.py)
compile_cache = 'out/compile_cache'  # inductor / Triton caches for the next launch (TORCHINDUCTOR_CACHE_DIR wins)
invariant = False  # trainer and embedded server path-invariant (model.set_invariant): logprobs equal bit for bit; slow
tokenizer = ''  # '' = the checkpoint's tokenizer.json, else 'bytes' for the math and toy tasks, else 'deepseek-v4'
resume = False  # continue from the newest complete checkpoint in out_dir
# parallel layout (tensor parallel is fixed at 1)
pp_size = 1  # pipeline stages
ep_size = 1  # expert-parallel ranks, carved out of data parallel
pp_layers = ''  # e.g. '11,11,11,10'; '' = balanced
n_microbatches = 1  # per DP rank, without a token budget; the default trains its batch at once; PP wants several
micro_batch_tokens = 0  # > 0: micro-batches of so many tokens (grpo.plan_microbatches); 0: 16384 with graphs, else none
recompute = False  # recompute each layer's activations in backward instead of keeping them
loss_chunk = 1024  # tokens whose head logits exist at once in the loss (chunked_head.py): its memory, any length
optimizer_offload = False  # AdamW's fp32 master weights and moments in host memory
pack_samples = True  # several samples a row, kept apart (grpo.pack_rows): fewer padded tokens than a sample a row
dist_timeout = 600  # seconds before a stuck collective fails (every process group; weight-sync calls too)
watchdog_s = 0  # > 0: a step running longer prints every thread's stack on each rank and exits 124 (faults.py)
max_consecutive_skips = 3  # steps skipped in a row (non-finite loss or gradient, rollouts failed) that stop the run
# rollout
rollout_url = ''  # '' = start the embedded server; else comma-separated SGLang URLs
rollout_api_key = ''  # the servers' --api-key, if they have one
rollout_timeout = 3600.0  # seconds one /generate request may take before it is retried elsewhere
weight_sync = 'disk'  # 'disk' | 'distributed' | 'tensor' (servers on this machine: CUDA IPC; weight_sync.py)
weight_sync_bucket_mb = 512  # distributed, tensor: bytes per bucket, the most one rank gathers at a time
weight_sync_flatten = True  # distributed, tensor: a bucket as one tensor of its bytes (SGLang's 'flattened_bucket')
weight_sync_verify = False  # after each sync, check every tensor's first rows on every server against what was sent
rollout_quant = 'none'  # 'none' | 'fp8' | 'fp8_fp4': what the rollout engine serves (FP8: W8A8, as SGLang)
train_quant = 'none'  # 'fp8': the FP8-stored linears train in FP8 as the FP8 engine computes them (quant.py)
rollout_max_batch = 512  # sequences a server decodes at once: an over-sampled step in one batch, an eval in four
rollout_concurrency = 0  # /generate requests in flight a server (0: max(256, rollout_max_batch)); fewer decode in waves
# data and sampling
data = 'math'  # 'math' (tasks.py: RL prompts), 'toy', a .jsonl / .parquet path, or a hub dataset name
eval_data = 'math'  # 'math': the task's fixed held-out set of n_test problems
math_steps = 2  # the math task: operations per problem (its knobs as in sft_config)
math_digits = 1  # the math task: digits per operand
math_ops = '+-'  # the math task: operations drawn from '+-*'
math_words = 0.0  # the math task: share of word problems
n_rl = 400  # the math task: RL prompts (a pool SFT never sees)
n_test = 200  # the math task: held-out problems (fixed)
n_prompts = 16  # groups per step (all DP ranks together)
n_samples = 8  # samples per prompt: a group
max_prompt_len = 1024  # prompt tokens kept (the last ones)
max_new_tokens = 64  # tokens a sample may generate
temperature = 1.0  # rollout sampling temperature
top_p = 1.0  # rollout nucleus sampling (1: the full vocabulary, as the trainer's logprobs are)
eval_temperature = 1.0  # held-out eval sampling temperature
eval_top_p = 1.0  # held-out eval nucleus sampling
# GRPO
lr = 1e-4  # the micro base's (3e-4 and up undo it in a few steps); RL on a large pretrained model uses ~1e-6
trainable = 'all'  # 'all' | 'io' (embeddings, output head, final norms: for a model whose body is random)
lr_schedule = 'constant'  # 'constant' | 'cosine'
warmup_steps = 0  # steps of linear warm-up
min_lr_ratio = 0.1  # cosine: the last step's lr, a share of lr
weight_decay = 0.0  # AdamW's decoupled weight decay
grad_clip = 1.0  # the global gradient norm's cap (0: off)
eps_low = 0.2  # clip-higher (DAPO): the ratio's clip range is [1 - eps_low, 1 + eps_high]
eps_high = 0.28  # clip-higher (DAPO): the upper side
tis_cap = 2.0  # 0 turns truncated importance sampling off
kl_coef = 0.0  # the k3 KL penalty against the frozen start (0: off, no reference model)
entropy_coef = 0.0  # an entropy bonus in the loss (0: off)
loss_agg = 'seq_mean_token_mean'  # | 'token_mean'
n_minibatches = 1  # optimizer steps per rollout; > 1 recomputes the old-policy logprobs first
dynamic_sampling = True  # drop flat groups (rewards all equal) and draw more prompts to refill the batch
max_sampling_rounds = 4  # rounds of sampling to refill the batch
max_oversample = 2.0  # a round draws the prompts the last step's kept share says it needs, at most this many times
overlong_buffer = 0  # DAPO overlong penalty over the last overlong_buffer tokens (0 = off)
overlong_factor = 1.0  # the overlong penalty at max_new_tokens
freeze_router = False  # True: the router gate stays as it was (large-MoE RL recipes freeze it); its bias never trains
routing_replay = False  # train through the engine's experts (R3): replay.py
indexer_replay = False  # train through the engine's CSA indexer picks: replay.py
# logging, eval, checkpoints
eval_interval = 15  # evals before steps 0, 15, 30, ... and after the last
eval_n_samples = 8  # eval samples a problem
eval_limit = 0  # evaluate the first eval_limit problems (0: all)
checkpoint_interval = 20  # steps between checkpoints (and the last step); 0: none
keep_checkpoints = 2  # complete checkpoints kept, the newest
wandb_log = False  # log to wandb (offline without WANDB_API_KEY)
wandb_project = 'nano-dsv4-rl'
config_keys = [k for k, v in globals().items() if not k.startswith('_') and isinstance(v, (int, float, bool, str))]


def load_task(name, split, key):
    """The problems of data or eval_data (key: which one, for its errors); the math task's test set is fixed for any
    seed."""
    knobs = dict(steps=math_steps, digits=math_digits, ops=math_ops, words=math_words)
    if name == 'toy':
        return toy_problems()
    if name != 'math':
        return load_problems(name, split, key=key)
    if split == 'train':
        return math_problems('rl', n_rl, seed, **knobs)
    return math_problems('test', n_test, **knobs)


try:  # bad config is a usage error: say it and exit 2, before anything is built
    exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'configurator.py')).read())
    choices = {  # a key's allowed values
        'dtype': ('float32', 'bfloat16'),
        'trainable': ('all', 'io'),
        'loss_agg': ('seq_mean_token_mean', 'token_mean'),
        'weight_sync': ('disk', 'distributed', 'tensor'),
        'rollout_quant': ('none', 'fp8', 'fp8_fp4'), 'train_quant': ('none', 'fp8'),
        'lr_schedule': ('constant', 'cosine'),
        'kernels': ('auto', 'fast', 'reference'),
        'compile': ('off', 'layers', 'background'),
        'rollout_compile': ('off', 'layers'), 'train_graphs': ('auto', 'off'),
    }
    positive = ['n_prompts', 'n_samples', 'max_prompt_len', 'max_new_tokens', 'n_microbatches', 'n_minibatches',
                'loss_chunk', 'dry_run_world', 'rollout_max_batch', 'pp_size', 'ep_size', 'eval_n_samples',  # zero:
                'max_sampling_rounds', 'n_rl', 'n_test', 'weight_sync_bucket_mb']  # a batch / 0, a server of 0 rows
    at_least_0 = ['max_steps', 'warmup_steps', 'eval_interval', 'checkpoint_interval', 'eval_limit', 'watchdog_s',
                  'overlong_buffer', 'rollout_concurrency', 'micro_batch_tokens']
    for _k, _ok in choices.items():
        if globals()[_k] not in _ok:
            raise ValueError(f"{_k}={globals()[_k]!r}: choose one of {', '.join(_ok)}")
    for _k in positive:
        if not globals()[_k] > 0:
            raise ValueError(f"{_k}={globals()[_k]!r}: must be positive")
    for _k in at_least_0:
        if globals()[_k] < 0:
            raise ValueError(f"{_k}={globals()[_k]!r}: must be at least 0")
    if max_oversample < 1:
        raise ValueError(f"max_oversample={max_oversample!r}: must be at least 1 (1: draw only the groups needed)")
    for _k in ('compile', 'rollout_compile'):
        if invariant and globals()[_k] != 'off':  # a Python dispatch mode per op; compiled graphs would bypass it
            raise ValueError(f"invariant=True runs eager: set {_k}='off'")
        if globals()[_k] != 'off' and not dry_run and not torch.cuda.is_available():  # inductor's C++: no CPU build
            raise ValueError(f"{_k}={globals()[_k]!r} needs a GPU; on the CPU use {_k}='off'")
    if not dry_run:  # read now: data that is not there stops the run before a base is trained or any model built
        problems = load_task(data, 'train', 'data')
        eval_problems = load_task(eval_data, 'test', 'eval_data')[:eval_limit or None]
except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
config = {k: globals()[k] for k in config_keys}
t_start = time.time()

# -----------------------------------------------------------------------------
# the base, then distributed init: bad input stops here, before anything is built
complete = checkpoint.checkpoints(out_dir)[0]  # oldest first
resume_dir = os.path.join(out_dir, complete[-1]) if resume and complete else None
base_dir = os.path.join(out_dir, 'base')
if not init_from and not resume_dir and not dry_run and not os.path.isfile(os.path.join(base_dir, 'config.json')):
    if int(os.environ.get('WORLD_SIZE', 1)) > 1:  # one process makes the base; ranks would each start one
        sys.exit(f"error: no SFT base in {base_dir}: make it first with `python train_sft.py {sft_config} "
                 f"--out_dir={base_dir}`, or pass init_from")
    print(f"no base in {base_dir}: training it first (train_sft.py {sft_config})", flush=True)
    sft_cmd = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), 'train_sft.py'), sft_config,
               f'--out_dir={base_dir}', f'--seed={seed}', f'--math_steps={math_steps}', f'--math_digits={math_digits}',
               f'--math_ops={math_ops}', f'--math_words={math_words}']
    if eval_interval:  # GRPO's step-0 eval measures the base: the SFT's own would repeat it
        sft_cmd.append('--n_test=0')
    if subprocess.run(sft_cmd).returncode:
        sys.exit(f"error: train_sft.py failed; the base in {base_dir} was not made")
if resume_dir:
    model_dir = resume_dir
elif init_from == 'scratch' or dry_run:
    model_dir = None  # the architecture of model_config
else:
    model_dir = init_from or base_dir
try:
    if model_dir and not os.path.isfile(os.path.join(model_dir, 'config.json')):
        raise ValueError(f"init_from={model_dir!r} is not a checkpoint directory (no config.json in it)")
    args = ModelArgs.from_json(os.path.join(model_dir, 'config.json') if model_dir else model_config)
    tok_name = tokenizer
    if not tok_name and model_dir and os.path.exists(os.path.join(model_dir, 'tokenizer.json')):
        tok_name = model_dir
    elif not tok_name and data in ('math', 'toy'):
        tok_name = 'bytes'
    elif not tok_name:
        tok_name = 'deepseek-v4'
    tok = load_tokenizer(tok_name)
    if tok.vocab_size > args.vocab_size:
        raise ValueError(f"the tokenizer has {tok.vocab_size} ids, more than the model's vocab_size {args.vocab_size}")
except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
split = [int(x) for x in pp_layers.split(',')] if pp_layers else None
if dry_run:  # the layout of the whole job on the meta device, no hardware; its longest micro-batch's rows: a DP rank's
    world = int(os.environ.get('WORLD_SIZE', dry_run_world))  # samples of a step, dealt by grpo.make_microbatches
    micro = (max(1, micro_batch_tokens // (max_prompt_len + max_new_tokens)) if micro_batch_tokens  # longest rows
             else math.ceil(math.ceil(n_prompts * n_samples / (world // pp_size)) / n_microbatches))
    print(plan_table(args, pp_size, ep_size, world, micro, max_prompt_len + max_new_tokens, recompute,
                     n_microbatches, pp_layers=split, loss_chunk=loss_chunk, entropy_grad=entropy_coef > 0))
    sys.exit(0)
grid = parallel.init_distributed(pp_size, ep_size, timeout_s=dist_timeout)
master = grid.rank == 0
watchdog = faults.Watchdog(watchdog_s, grid.rank)
preempt = faults.Preemption()
skips = faults.Skips(max_consecutive_skips)
is_logger = grid.is_last_stage and grid.dp_rank == 0  # the loss lives on the last stage
print0 = lambda *a: print(*a, flush=True) if master else None
torch.manual_seed(seed)
random.seed(seed)
ptype = {'float32': torch.float32, 'bfloat16': torch.bfloat16}[dtype]
print0(f"config: {json.dumps(config)}")
print0(f"git: {subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], capture_output=True, text=True).stdout.strip()}"
       f" | {grid}")

# -----------------------------------------------------------------------------
# model, optimizer
print0(f"building the model ({'scratch' if not model_dir else model_dir}), {dtype}, pp {pp_size} ep {ep_size}")
model = parallel.build_stage(args, grid, dtype=ptype, pp_layers=split, init=model_dir is None, seed=seed)
if model_dir:
    checkpoint.load_weights(model, model_dir, strict=False, device=grid.device)
kernel_cache = os.path.join(compile_cache, 'kernel_check.json')
kernel_paths = choose_kernels(kernels, args, grid.device, ptype, print0, kernel_cache)
model.set_kernels(kernel_paths).set_invariant(invariant).set_fp8_training(train_quant == 'fp8')
model.loss_chunk, model.temperature = loss_chunk, temperature  # the loss's logprobs are the rollouts' (engine.py)
if cache := compile_policy.use_compile(compile, compile_cache):
    compile_policy.compile_model(model, compile, log=print0)  # blocks (head, loss: traced in, with 'layers')
    print0(f"compile cache: {cache}")
graphs = StepGraphs(model, grid, log=print0) if (why := why_not(grid, model, train_graphs)) is None else None
mb_tokens = micro_batch_tokens or (16384 if graphs else 0)  # graphs replay fixed shapes: a token budget
print0(f"train graphs: {'on' if graphs else f'off ({why})'} | micro-batches: "
       f"{f'{mb_tokens} tokens each' if mb_tokens else f'{n_microbatches} a step'}")
pad_to = length_multiple(args) if compile == 'layers' else 1  # micro-batch lengths
pack = pack_multiple(args) if pack_samples else 0  # where a packed sample may start (a multiple of every ratio)
row_len = 0  # the token budget's row length, kept from step to step while the samples fit it (plan_microbatches)
# the servers' ids we replay
replayed = replay.columns(args, model.layers, replay.fields(routing_replay, indexer_replay))
for name, p in model.named_parameters():  # MTP is not trained here; the router optionally frozen
    p.requires_grad_(not name.startswith('mtp.') and not (freeze_router and name.endswith('gate.weight'))
                     and (trainable == 'all' or name.startswith(('embed.', 'head.', 'norm.', 'hc_head_'))))
opt = AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, offload=optimizer_offload)
n_params = sum(p.numel() for p in model.parameters())
print0(f"rank 0 holds {n_params / 1e6:.1f}M parameters, trains {sum(p.numel() for p in opt.params) / 1e6:.1f}M "
       f"({trainable}{', router gates frozen' if freeze_router else ''})")
order = list(range(len(problems)))  # the data stream, one for every layout, cycled
random.Random(seed).shuffle(order)
cursor = 0  # the next position in the stream (saved in checkpoints)
keep_rate = 1.0  # the share of groups dynamic sampling kept in the last step, of every rank (saved in checkpoints)
encode = lambda problem: prompt_ids(tok, problem['prompt'])[-max_prompt_len:]  # noqa: E731 (as print0)
start_step, weight_version = 0, 0  # the embedded server starts from the trainer's weights, labelled with their version
if resume_dir:
    st = checkpoint.load_state(resume_dir, grid)
    opt.load_state_dict(st['opt'])
    start_step, weight_version = st['step'] + 1, st['weight_version']
    cursor = st['stream_pos'] if 'stream_pos' in st else st['cursor'] * grid.dp_size  # older: a position per rank
    keep_rate = st.get('keep_rate', 1.0)
    print0(f"resumed from {resume_dir} at step {start_step} (the newest complete checkpoint; ignoring incomplete "
           f"{checkpoint.checkpoints(out_dir)[1]})")

# -----------------------------------------------------------------------------
# rollout servers: the given URLs, or the embedded server started here (stopped on exit, crash included)
sync_dir = os.path.join(out_dir, 'weights')
os.makedirs(out_dir, exist_ok=True)
server, external = None, bool(rollout_url)
if not external:
    # the server starts from the trainer's weights: from disk, or with a transport that hands tensors over, from the
    # config alone (random weights: SGLang's --load-format dummy) and then the trainer's first sync, as any update
    checkpoint.save_weights(model, grid, sync_dir, args, quant=rollout_quant, weights=weight_sync == 'disk')
    if master:
        flags = ['--dtype', dtype, '--max-batch', str(rollout_max_batch), '--max-len', str(max_prompt_len +
                 max_new_tokens), '--quant', rollout_quant, '--compile', rollout_compile, '--load-format',
                 'auto' if weight_sync == 'disk' else 'dummy'] + ['--invariant'] * invariant
        flags += [replay.FLAGS[f] for f in replayed]
        flags += ['--kernels', ','.join(kernel_paths) or 'reference']
        server = EmbeddedServer(sync_dir, flags).start(str(weight_version))
        rollout_url = server.url
    rollout_url = parallel.broadcast_object(rollout_url, 0, grid.world_group, 'rollout url')
client = RolloutClient(rollout_url, api_key=rollout_api_key or None, timeout=rollout_timeout, max_concurrency=(
    rollout_concurrency or max(256, rollout_max_batch)) * len(rollout_url.split(',')))


def servers_ready():
    """External servers are waited for at once. The embedded one is waited for at its first use: with
    rollout_compile='layers' it compiles its decode step before it answers, while the trainer builds and warms up."""
    if not client.ready:
        client.wait_ready(600 if external else 1800, server=server)
        print0(f"rollout servers ready: {rollout_url}")


if external:
    servers_ready()


# -----------------------------------------------------------------------------
# GRPO: rollouts, advantages, dynamic sampling, the token loss

def rollout_groups(step):
    """The step's groups by one rule for any layout (on the first stage of each DP replica, together): the stream's
    next prompts, n samples each, shared out over the DP ranks; with dynamic sampling a group whose rewards all agree
    is dropped, and the stream's next prompts refill the batch, up to max_sampling_rounds rounds. A round draws the
    prompts it needs over the last step's kept share (at most max_oversample times as many): each round costs a whole
    decode's latency, and a bigger batch costs less than another round. The first n_prompts kept groups, in stream
    order, are then dealt out (grpo.deal). -> ([minibatch][group] this rank trains, this rank's stats)"""
    global cursor, keep_rate
    kept, mine, stats = [], {}, dict(groups=0, kept=0, samples=[])  # kept: (stream position, rank that drew it)
    drawn = 0
    for _ in range(max_sampling_rounds if dynamic_sampling else 1):
        need = n_prompts - len(kept)
        if dynamic_sampling:
            need = math.ceil(need / max(keep_rate, 1 / max_oversample))
        pos = list(range(cursor, cursor + need))
        drawn += need
        cursor += len(pos)
        pos = pos[grid.dp_rank::grid.dp_size]  # this rank's share of the round
        take = [problems[order[i % len(order)]] for i in pos]
        err, outs, flags = None, [], []
        try:  # seeds from (seed, step, stream position): the same samples whichever rank asks
            outs = client.generate([encode(p) for p in take], n_samples, dict(temperature=temperature, top_p=top_p,
                                   max_new_tokens=max_new_tokens), seed=seed * 100003 + step,
                                   desc=f"step {step} rollout", prompt_keys=pos, replay=replayed)
        except RuntimeError as e:  # servers unreachable, bad answers: the other ranks hear of it just below
            err = f"{type(e).__name__}: {e}"
        for i, p, samples in zip(pos, take, outs):
            for s in samples:
                s['reward'] = s['correct'] = math_reward(tok.decode(s['output_ids']), p['answer'])
                if overlong_buffer:
                    n_out = len(s['output_ids'])
                    s['reward'] += overlong_penalty(n_out, max_new_tokens, overlong_buffer, overlong_factor)
            rewards = [s['reward'] for s in samples]
            stats['groups'] += 1
            stats['samples'] += samples
            flags.append((i, keep_group(rewards) or not dynamic_sampling))
            if flags[-1][1]:
                mine[i] = (encode(p), samples, group_advantages(rewards))
        every = parallel.all_gather_object((err, flags), grid.dp_group, 'kept groups')  # every rank's verdicts
        err = next((e for e, _ in every if e), None)
        if err:
            raise RuntimeError(err)
        kept += sorted((i, r) for r, (_, rank_flags) in enumerate(every) for i, keep in rank_flags if keep)
        if len(kept) >= n_prompts:
            break
    keep_rate = len(kept) / drawn  # the same on every rank
    kept = kept[:n_prompts]
    stats['kept'], stats['trained'] = len(mine), len(kept)
    owner, plan = dict(kept), deal(kept, grid.dp_size, n_minibatches)
    moving = [i for r, parts in enumerate(plan) for part in parts for i in part if owner[i] != r]
    if moving:  # the groups that change rank travel once, over the DP group
        sent = {i: mine[i] for i in moving if owner[i] == grid.dp_rank}
        for arrived in parallel.all_gather_object(sent, grid.dp_group, 'dealt groups'):
            mine.update(arrived)
    return [[mine[i] for i in part] for part in plan[grid.dp_rank]], stats


def rollout_step(step):
    """rollout_groups, checked: samples from older weights than the trainer's (a restarted server) are refused. A
    failure on any rank fails every rank: the servers are synced again (a dead embedded one restarted first) and the
    step's prompts redrawn with the same seeds, so none is lost. -> ((groups, stats) or None off stage 0, [why an
    attempt failed]); (None, [why, why]) when both did"""
    global cursor
    start, errors = cursor, []
    for attempt in (1, 2):
        out, err = None, None
        if grid.pp_rank == 0:
            try:
                out = rollout_groups(step)
                old = {s['url'] for s in out[1]['samples'] if s['weight_version'] != str(weight_version)}
                if old:
                    client.stale.update(old)
                    err = f"samples from weights older than version {weight_version} from {sorted(old)}"
            except RuntimeError as e:  # servers unreachable, bad answers: raised on every first stage alike
                err = f"{type(e).__name__}: {e}"
        err = wsync.agree(grid, err)
        if err is None:
            return out, errors
        errors.append(err)
        cursor = start
        print0(f"step {step} rollout, attempt {attempt} failed: {err}")
        if attempt == 1:
            sync_weights()
    return None, errors


def loss_fn(logp, entropy, mb):
    """The GRPO token loss of a micro-batch (grpo.grpo_loss), as the last stage computes it (Transformer.head_loss)."""
    return grpo.grpo_loss(logp, entropy, mb, eps_low, eps_high, tis_cap, kl_coef, entropy_coef)


# -----------------------------------------------------------------------------
# checkpoints: official-name safetensors + per-rank optimizer/RNG/cursor (checkpoint.save_checkpoint)

def save_checkpoint(step):
    state = checkpoint.trainer_state(step, opt, stream_pos=cursor, keep_rate=keep_rate, weight_version=weight_version)
    checkpoint.save_checkpoint(out_dir, step, model, grid, args, state, config, keep_checkpoints)


# -----------------------------------------------------------------------------
# wandb (optional), weight sync, the held-out eval, the step's end
if wandb_log and is_logger:
    try:
        import wandb
    except ImportError:
        raise SystemExit("error: wandb_log=True needs the wandb package (pip install wandb)")
    wandb_mode = None if os.environ.get('WANDB_API_KEY') else 'offline'  # online with a key
    wandb.init(project=wandb_project, config=config, dir=out_dir, mode=wandb_mode)


def sync_weights():
    """Push the trainer's weights to every rollout server that is up; the next rollouts carry the new version. A
    server that fails mid-sync is named and gets no rollouts until a sync completes there: the others are synced
    again at once, and each later sync retries it (weight_sync.py)."""
    global weight_version
    servers_ready()
    weight_version += 1
    for attempt in (1, 2):
        try:
            return wsync.sync(model, grid, client, args, sync_dir, mode=weight_sync, version=str(weight_version),
                              quant=rollout_quant, bucket_mb=weight_sync_bucket_mb, verify=weight_sync_verify,
                              timeout=dist_timeout, flatten=weight_sync_flatten)
        except wsync.SyncError as e:
            print0(f"weight sync, attempt {attempt}: {e}")
            if master and server is not None and server.exit_code() is not None:  # ours died: start it again
                print0(f"the embedded rollout server exited with {server.exit_code()}: restarting it")
                server.start('restarted')  # older weights: it serves once a sync completes there
                client.wait_ready(timeout=600)


def finish_step(step, saved):
    """The safe point: the step is over on every rank. A SIGTERM / SIGINT on any rank stops all here, with a
    checkpoint."""
    save = None  # the step has saved already
    if not saved:
        save = functools.partial(save_checkpoint, step)
    preempt.safe_point(grid, step, save)
    watchdog.disarm()


def log(rec, line):
    if is_logger:
        print(line, flush=True)
        open(os.path.join(out_dir, 'metrics.jsonl'), 'a').write(json.dumps(rec) + '\n')  # closed at once (CPython)
        if wandb_log:
            wandb.log(rec, step=rec['step'])


def held_out_eval(n_updates):
    """eval_* metrics of the policy after n_updates GRPO steps (the servers hold it), on every rank. The same sampling
    seed at every eval, so two evals differ by the policy, not by the draws."""
    ev = {}
    if master:
        try:  # servers down: no eval this time, and the next step's rollout recovers them
            sampling = dict(temperature=eval_temperature, top_p=eval_top_p, max_new_tokens=max_new_tokens)
            chat = data not in ('math', 'toy')  # V4's chat layout, not for the built-in tasks' plain prompts
            res = evaluate(client, tok, eval_problems, eval_n_samples, sampling, seed=seed, chat=chat)
            ev = {f'eval_{k}': v for k, v in res.items() if k != 'per_problem'}
            print(f"eval after {n_updates} GRPO steps | {summary(res)}", flush=True)
        except RuntimeError as e:
            ev = {'eval_error': str(e)[:1000]}
    return parallel.broadcast_object(ev, 0, grid.world_group, 'eval metrics')


if external or weight_sync != 'disk':
    sync_weights()  # the servers may hold other weights than the ones we start from (the embedded one: random ones)

# -----------------------------------------------------------------------------
# the loop
servers_ready()  # before the first step's watchdog is armed
preempt.defer = True  # from here a signal stops at the end of the step, with a checkpoint
for step in range(start_step, max_steps):
    watchdog.arm(f"step {step}")
    evals = {}
    if eval_interval and step % eval_interval == 0:  # before this step's update
        evals = held_out_eval(step)
    t0 = time.time()
    out, errors = rollout_step(step)
    if len(errors) == 2:
        log({'step': step, 'skipped': f'rollouts failed: {errors[-1]}', 'weight_version': weight_version, **evals},
            f"step {step:05d}/{max_steps} | skipped: rollouts failed twice: {errors[-1]}")
        skips.update(step, 'rollouts failed')
        finish_step(step, saved=False)
        continue
    # every stage of a DP replica trains on the same samples: [minibatch][group]
    parts, rstats = parallel.broadcast_object(out, grid.first_stage_rank, grid.pp_group, 'samples')
    t_roll = time.time() - t0
    rec = {'step': step, 'lr': lr_at(step, lr, warmup_steps, lr_schedule, max_steps, min_lr_ratio),
           'weight_version': weight_version, **evals, **grpo.rollout_metrics(rstats, weight_version, grid)}
    if errors:
        rec['rollout_error'] = errors[0][:1000]
    t1, bad = time.time(), None
    if rstats['trained'] == 0:  # the same count on every rank
        rec.update(skipped='no group with reward spread')
    else:
        for g in opt.param_groups:
            g['lr'] = rec['lr']
        samples = [s for part in parts for _, ss, _ in part for s in ss]
        # the loss is a mean over samples, or (token_mean) over tokens
        norm_local = sum(len(s['output_ids']) for s in samples) if loss_agg == 'token_mean' else len(samples)
        norm_local = torch.tensor(float(norm_local), device=grid.device)
        norm = float(parallel.all_reduce(norm_local, grid.dp_group, 'loss norm'))
        parts = [part or [inert_group(encode(problems[0]))] for part in parts]  # a rank short of groups runs one
        plans = []  # as many micro-batches on every DP rank (expert-parallel peers run each one together)
        for part in parts:
            plans.append(grpo.count_microbatches(part, n_microbatches, pack, mb_tokens, pad_to, row_len))
            row_len = plans[-1][1]
        counts = parallel.all_reduce(torch.tensor([float(n) for n, _ in plans], device=grid.device), grid.dp_group,
                                     'micro-batches', op=dist.ReduceOp.MAX if mb_tokens else dist.ReduceOp.MIN)
        minis = [make_microbatches(part, int(n), norm / n_minibatches, loss_agg, grid.device, pad_to, replayed, args,
                                   pack, mb_tokens, T) for part, n, (_, T) in zip(parts, counts.tolist(), plans)]
        rec.update(grpo.layout_metrics(parts, minis, grid))
        if n_minibatches > 1:  # the old policy's logprobs, before any of this rollout's updates
            for mbs in minis:
                for mb, lp in zip(mbs, (graphs or parallel).forward_only(model, grid, mbs, grpo.token_logprobs)):
                    mb['old_lp'] = lp
        for mbs in minis:
            m = parallel.train_step(model, grid, opt, mbs, loss_fn, grad_clip, graphs.train if graphs else '1f1b',
                                    recompute)
            rec['grad_norm'] = m['grad_norm']
            if m['skipped']:  # the same verdict on every rank
                bad = rec['skipped'] = faults.report_nonfinite(step, m, mbs, model, grid.rank,
                                                               os.path.join(out_dir, 'nonfinite'), is_logger)
        if grid.is_last_stage:
            rec.update(grpo.train_metrics(m, grid))
    t2 = time.time()
    sync_weights()
    t3 = time.time()
    rec.update(step_peaks(grid, client if server is not None else None), **(graphs.take_counts() if graphs else {}))
    rec.update(t_rollout=t_roll, t_train=t2 - t1, t_sync=t3 - t2, weight_version=weight_version, elapsed_s=t3 - t_start,
               rollout_tok_s=rec['response_tokens'] / max(t_roll, 1e-9),
               train_tok_s=rec.get('train_tokens', 0) / max(t2 - t1, 1e-9))
    log(rec, grpo.step_line(rec, max_steps))
    skips.update(step, bad)
    saved = checkpoint_interval and ((step + 1) % checkpoint_interval == 0 or step + 1 == max_steps)
    if saved:
        save_checkpoint(step)
    finish_step(step, saved)

if eval_interval and start_step < max_steps:  # the policy after the last update
    log({'step': max_steps, **held_out_eval(max_steps)}, f"step {max_steps:05d}/{max_steps} | held-out eval only")

# -----------------------------------------------------------------------------
# cleanup
wsync.teardown(grid, client)  # the weight-update groups with the servers (weight_sync='distributed' makes them)
if grid.world_size > 1:
    parallel.barrier(grid.world_group, 'the end')
    dist.destroy_process_group()
print0("done")
