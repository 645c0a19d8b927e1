"""
kernels='auto', a default that checks itself. The fast paths of dsv4_kernels/ were written for and measured on an
NVIDIA H200; ROCm builds (AMD MI355X, the seed run's GPU) answer torch.cuda too, and nothing here has run there. So at
start each path runs once on this device, on a small model of the run's widths, against the plain reference beside it
in the model: those that run and agree stay on, the others fall back to the reference, and one line says which are on
and why the others are off. kernels='fast' takes every path unchecked, 'reference' none, and a comma-separated list the
paths it names (the trainer hands its verdict to the embedded server that way).

The paths, by mechanism (model_dsv4.KERNEL_PATHS, the names Transformer.set_kernels takes):
  gemm_f32          bf16 GEMMs with an fp32 result, torch.mm(..., out_dtype=) (router, compressors, indexer, head,
                    and inside the paths below); off: fp32 GEMMs of fp32 copies. One switch for the whole process
  attention         the sink attention over the window by blocks of `sliding_window` queries (training, prefill)
  decode_attention  the engine's decode step: the input projections as one GEMM; query norm + RoPE, window key,
                    compressor step and the attention over the cache in Triton
  mhc               mHC's mixes on bf16 tensor cores; Sinkhorn, hc_post (training) and hc_pre (decode) in Triton
  experts           the routed experts as grouped GEMMs (torch._grouped_mm); a decode step's few rows in Triton
  routing           a decode step's router top-k and (token, expert) pair order in Triton
  sampling          the engine's sampler in Triton
  fp8_gemm          train_quant='fp8''s linears as FP8 GEMMs with block scales (dsv4_kernels/fp8.py, Hopper). One
                    switch for the whole process

The check. A model with one trunk layer for each attention kind of the run's (window, CSA, HCA), at the run's widths
and in its dtype, with at most 8 experts, a 512-token vocabulary and random weights (check_args). Each path is switched
on alone and held to all paths off: the training forward and backward (the logits and every gradient), then two prompts
prefilled and 4 decode steps through the KV cache that complete a compressed window of every ratio. Every layer routes
by hash and the indexer keeps every entry, so no near-tie at a top-k cut can pick differently on the two sides.
gemm_f32 goes first; the others then run with its verdict, as they will in the run. routing and sampling also run alone
at the run's expert count and vocabulary: the learned router (and the hash table) on 64 tokens, the sampler on 8 rows,
greedy and sampled. fp8_gemm runs alone too: quant.fp8_linear's forward and backward on 64 tokens, at the run's
widths (hidden size in, q_lora_rank out).

Agreement, for each tensor compared: max |fast - gold| <= 2 max |reference - gold| + tol max |gold|, gold being the
reference computed in fp32 from the same weights and inputs (in an fp32 run, the reference itself); tol is 1e-3 in fp32
and 0.1 in bf16. In fp32 the two sides differ only in the order of their sums: up to 3e-5 of the largest value on an
H200 and 2e-5 on the CPU (gradients of mHC's scales). In bf16 (8 significant bits) rounding errors grow through this
random model's layers and its backward: no fast path missed by more than twice the bf16 reference's own miss (an H200
at tiny's, bench_2b's and Flash's widths; the CPU at tiny's and micro's), which reaches 0.06 of the largest value on the
CPU (a router's gradient). The 1-D parameters' gradients (norms, sinks, mHC's scales and bases) are left out in bf16:
each sums a term from every token, and bf16 rounding moves such a sum by up to 0.16 of itself with a correct fast path
(Flash's hc_head_scale, where the reference happened to land 0.01 off). A wrong kernel (a mask, an index, a missing
term, a bad layout) misses by about the largest value or gives NaN, which never agrees. Picks (router experts, sampled
tokens, pair order) must be equal. Not covered: the indexer's scores (every entry is kept), combinations of paths.

On the CPU auto checks nothing and takes the reference: the CPU figures (README) are the reference's, the Triton paths
run only on a GPU (dsv4_kernels.has_triton), and a check would add to every start for no gain. kernels='fast' takes the
torch paths on the CPU too (tests/test_fast_paths.py holds them to the reference there). A kernel that faults the device
(an illegal memory access) leaves CUDA unusable for the whole process: the check then stops the run, naming the path;
kernels='reference', or a list without that path, gets past it.
"""
import dataclasses
import glob
import hashlib
import json
import os

import torch

from dsv4_kernels import has_triton
import dsv4_kernels.fast
import dsv4_kernels.fp8
from dsv4_kernels.decode import sample_triton
from engine import GREEDY_T, sample_tokens
from kv_cache import KVCache
from model_dsv4 import KERNEL_PATHS, Transformer
from moe import Gate, dispatch
from quant import fp8_linear

TOL = {torch.float32: 1e-3, torch.bfloat16: 1e-1}  # of a tensor's largest value (the module docstring says why)
STEPS = 4  # decode steps after the prefill
# what each path changes, so what its check runs: the training step, the decode, and alone the router and the sampler
PARTS = {"gemm_f32": ("train", "decode"), "attention": ("train", "decode"), "decode_attention": ("decode",),
         "mhc": ("train", "decode"), "experts": ("train", "decode"), "routing": ("decode", "router"),
         "sampling": ("sampler",), "fp8_gemm": ("fp8",)}


ROOT = os.path.dirname(os.path.abspath(__file__))
CACHE = os.path.join("out", "compile_cache", "kernel_check.json")  # train_grpo puts it in its compile_cache


def device_name(device):
    return torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)


def verdict_key(args, device, dtype):
    """What a verdict depends on: the GPU model, torch's and Triton's versions, the dtype, the check's model (its
    widths), and the source of the kernels and of the reference they are held to."""
    src = hashlib.sha256()
    for path in sorted(glob.glob(os.path.join(ROOT, "dsv4_kernels", "*.py"))) + [
            os.path.join(ROOT, f) for f in ("kernel_check.py", "model_dsv4.py", "moe.py", "mhc.py", "kv_cache.py",
                                            "engine.py", "quant.py")]:
        src.update(open(path, "rb").read())
    try:
        import triton
        triton = triton.__version__
    except ImportError:
        triton = None
    widths = dataclasses.asdict(check_args(args)[0])
    return json.dumps([device_name(device), torch.__version__, triton, str(dtype), widths, src.hexdigest()[:16]],
                      sort_keys=True)


def cached_check(args, device, dtype, cache):
    """check's verdicts, read from the cache file when one there has the same verdict_key (a check takes tens of seconds
    on a GPU, its cached verdict milliseconds), else checked and added. -> (verdicts, read from the cache?)"""
    key = verdict_key(args, device, dtype)
    try:
        stored = json.load(open(cache))
    except (OSError, ValueError):  # none yet, or unreadable: check again
        stored = {}
    if key in stored:
        return stored[key], True
    stored[key] = check(args, device, dtype)
    if cache:
        os.makedirs(os.path.dirname(cache) or ".", exist_ok=True)
        with open(f"{cache}.{os.getpid()}.tmp", "w") as f:  # renamed: a reader sees the old file or the new one
            json.dump(stored, f)
        os.replace(f"{cache}.{os.getpid()}.tmp", cache)
    return stored[key], False


def choose(mode, args, device, dtype, log=print, cache=CACHE):
    """The fast paths to take for kernels=mode ('auto', 'fast', 'reference', or path names joined by commas) with a
    model of ModelArgs args on device in dtype: a tuple of names for Transformer.set_kernels. One line to log.
    cache: the file of auto's verdicts (cached_check); None checks every time."""
    device = torch.device(device)
    if mode == "fast":
        on, line = KERNEL_PATHS, f"every fast path, unchecked: {', '.join(KERNEL_PATHS)}"
    elif mode == "reference":
        on, line = (), "the plain reference everywhere"
    elif mode == "auto" and device.type == "cpu":
        on, line = (), "the reference on the CPU (auto checks the fast paths on a GPU; kernels='fast' takes them here)"
    elif mode == "auto":
        verdicts, cached = cached_check(args, device, dtype, cache) if cache else (check(args, device, dtype), False)
        if device.type == "cuda":  # the check's model and gradients, back to the run
            torch.cuda.empty_cache()
        on = tuple(p for p in KERNEL_PATHS if verdicts[p] is None)
        off = [f"{p} ({why})" for p, why in verdicts.items() if why is not None]
        line = (f"checked on {device_name(device)}, {str(dtype).removeprefix('torch.')}"
                f"{f' (the verdict cached in {cache})' if cached else ''}: on {', '.join(on) or 'none'}; "
                f"off {'; '.join(off) or 'none'}")
    else:
        on = tuple(p for p in mode.split(",") if p)
        if not on or set(on) - set(KERNEL_PATHS):
            raise ValueError(f"kernels={mode!r}: 'auto', 'fast', 'reference' or path names joined by commas, from "
                             f"{', '.join(KERNEL_PATHS)}")
        line = "the paths named"
    log(f"kernels {mode}: {line}")
    return on


def check(args, device, dtype):
    """{path: None where it runs and agrees with the reference, else why not} for every path of KERNEL_PATHS, on device
    in dtype (the module docstring says how). Runs eager: its own model, which nothing has compiled."""
    device = torch.device(device)
    small, span = check_args(args)
    with torch.device("meta"):
        model = Transformer(small, dtype=dtype)
    randomize_(model.to_empty(device=device))
    g = torch.Generator().manual_seed(0)  # inputs drawn on the CPU: the run's own random state is left alone
    rand = lambda *shape: torch.randn(*shape, generator=g).to(device)
    ints = lambda n, *shape: torch.randint(0, n, shape, generator=g).to(device)
    T, V = 2 * span + 5, small.vocab_size
    ids, dy, tokens = ints(V, 2, T), rand(2, T, V), ints(V, STEPS, 2)
    # the first prompt's decode steps pass position 2 span - 1, which completes a window of every ratio (divides 2 span)
    prompts = [ints(V, n).tolist() for n in (2 * span - 2, span // 2 + 3)]
    x, tok_ids, dy_fp8 = rand(64, args.hidden_size).to(dtype), ints(args.vocab_size, 64), rand(64, args.q_lora_rank)
    dy_fp8 = dy_fp8.to(dtype)
    temp = torch.tensor([0.0, 1.0, 0.7, 1.3] * 2, dtype=torch.float64, device=device)
    logits, draws = rand(8, args.vocab_size) * 4, torch.stack([ints(2 ** 62, 8), ints(5000, 8)], 1)
    runs = {"train": lambda m, on: train_step(m, ids, dy, vectors=dtype == torch.float32),
            "decode": lambda m, on: decode(m, prompts, tokens),
            "router": lambda m, on: router(args, x, tok_ids, "routing" in on),
            "sampler": lambda m, on: sampler(logits, temp, draws, "sampling" in on),
            "fp8": lambda m, on: fp8_gemms(x, dy_fp8, "fp8_gemm" in on)}

    def run(m, on, parts):
        m.set_kernels(on)
        return {k: v for part in parts for k, v in runs[part](m, on).items()}

    def reference(m, on, parts):
        try:
            return run(m, on, parts)
        except Exception as e:
            raise RuntimeError(f"kernel check: the reference itself fails on {device}: {e}") from e

    verdicts, gemm, refs, gold = {}, (), {}, {}
    was = dsv4_kernels.fast.GEMM_F32, dsv4_kernels.fp8.FP8_GEMM
    try:
        with torch.compiler.set_stance("force_eager"):
            if dtype != torch.float32:  # the reference in fp32 from the same weights: how far the reference is off
                with torch.device("meta"):
                    exact = Transformer(small, dtype=torch.float32)
                exact.to_empty(device=device).load_state_dict(model.state_dict())
                gold = reference(exact, (), ("train", "decode"))
                del exact
            for path in KERNEL_PATHS:  # gemm_f32 first
                key = (gemm, PARTS[path])
                if key not in refs:
                    refs[key] = reference(model, gemm, PARTS[path])
                try:
                    got = run(model, gemm + (path,), PARTS[path])
                    verdicts[path] = disagreement(got, refs[key], gold, TOL.get(dtype, TOL[torch.bfloat16]))
                except Exception as e:
                    why = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:160]}"
                    if not alive(device):
                        raise RuntimeError(f"kernel check: the fast path {path} left {device} unusable ({why}); run "
                                           f"with kernels='reference', or name the other paths") from e
                    verdicts[path] = why
                if path == "gemm_f32" and verdicts[path] is None:
                    gemm = ("gemm_f32",)
    finally:
        dsv4_kernels.fast.use_gemm_f32(was[0])
        dsv4_kernels.fp8.use_fp8_gemm(was[1])
    return verdicts


def check_args(args):
    """The run's ModelArgs cut down to the check's model: one trunk layer for each compress ratio, the widths kept, at
    most 8 experts, a 512-token vocabulary, no MTP, hash routing in every layer and an indexer top-k over every
    entry. -> (ModelArgs, span): span, the longest window or compress ratio, sets the lengths."""
    kinds = sorted(set(args.compress_ratios[:args.num_hidden_layers]))
    span = max(kinds + [args.sliding_window])
    E = min(args.n_routed_experts, 8)
    return dataclasses.replace(args, num_hidden_layers=len(kinds), compress_ratios=kinds, num_nextn_predict_layers=0,
                               num_hash_layers=len(kinds), vocab_size=min(args.vocab_size, 512), n_routed_experts=E,
                               num_experts_per_tok=min(args.num_experts_per_tok, E), index_topk=4 * span), span


@torch.no_grad()
def randomize_(module, seed=0):
    """Weights with some size to them, drawn on the module's device: matrices at 1/sqrt(fan-in), norms and scales
    around 1, sinks, mHC bases, biases and position biases O(1), a hash table of distinct experts a token. A fresh
    init's zero sinks and biases and unit norms would leave parts of the paths unchecked."""
    params = list(module.named_parameters()) + list(module.named_buffers())
    g = torch.Generator(params[0][1].device).manual_seed(seed)
    randn = lambda t: torch.randn(t.shape, generator=g, device=t.device)
    for name, t in params:
        if name.endswith("tid2eid"):
            E = module.args.n_routed_experts
            t.copy_(torch.rand(t.shape[0], E, generator=g, device=t.device).argsort(-1)[:, :t.shape[1]])
        elif not t.is_floating_point():
            continue
        elif t.dim() >= 2:
            t.copy_(randn(t) / t.shape[-1] ** 0.5)
        elif "norm" in name or name.endswith("scale"):
            t.copy_(1 + 0.2 * randn(t))
        else:
            t.copy_(randn(t))
    return module


def train_step(model, ids, dy, vectors=True):
    """The training forward and backward: {name: tensor} of the logits and the parameters' gradients, of the 1-D
    ones (norms, sinks, mHC's scales and bases) too if vectors."""
    model.zero_grad(set_to_none=True)
    logits = model(ids)
    (logits * dy).sum().backward()
    return {"logits": logits.detach()} | {f"grad {name}": torch.zeros_like(p) if p.grad is None else p.grad
                                          for name, p in model.named_parameters() if vectors or p.dim() > 1}


@torch.no_grad()
def decode(model, prompts, tokens):
    """The engine's side of the model: the prompts prefilled into a KV cache, then a decode step for each row of
    tokens [STEPS, B]: {name: logits} of the prefill and of each step."""
    dev = model.embed.weight.device
    model.stack_experts()  # as the engine does before its steps (Engine._weights_in_place)
    model.fuse_projections()
    cache = KVCache(model, len(prompts), max(map(len, prompts)) + len(tokens) + 1, dev)
    slots = torch.arange(len(prompts), device=dev)
    out = {"prefill logits": cache.prefill(model, slots.tolist(), prompts)}
    pos = torch.tensor([len(p) for p in prompts], device=dev)
    for i, step in enumerate(tokens):
        out[f"decode step {i} logits"] = cache.decode(model, slots, step, pos + i)
    return out


@torch.no_grad()
def router(args, x, ids, fast):
    """The run's routers alone (its expert count and top-k): the hash table's, if it has hash layers, and the learned
    one, on x [N, D] of tokens ids [N]; then a decode step's pair order (moe.dispatch). {name: tensor}."""
    out = {}
    for layer in ([0] if args.num_hash_layers else []) + [args.num_hash_layers]:
        gate = randomize_(Gate(layer, args).to(x.device), seed=layer)
        gate.weight.data = gate.weight.data.to(x.dtype)  # as Transformer.set_dtype leaves it
        kind = "hash" if gate.hash else "learned"
        w, idx = gate(x, ids, fast=fast)
        xs, ws, counts, _ = dispatch(x, w, idx, args.n_routed_experts, None, count=True, fast=fast)
        out |= {f"{kind} router weights": w, f"picks {kind} router": idx, f"picks {kind} pair order": xs,
                f"{kind} pair weights": ws, f"picks {kind} pair counts": counts}
    return out


def sampler(logits, temp, draws, fast):
    """The engine's sampler (Engine._launch_sample without top-p or top-k): {name: tensor} of picks and logprobs."""
    greedy = temp < GREEDY_T
    if fast and has_triton(logits):
        chosen = sample_triton(logits, torch.where(greedy, 1.0, temp).float(), greedy, draws)
    else:
        params = torch.stack([temp, torch.ones_like(temp), torch.full_like(temp, logits.shape[1])], 1)
        chosen = sample_tokens(logits, params, draws, False)
    return {"picks sampler": chosen[0], "sampler logprobs": chosen[1]}


def fp8_gemms(x, dy, fast):
    """FP8 training's linear alone (quant.fp8_linear), x [N, D] times a weight [dy's width, D] drawn here, forward and
    backward, FP8 GEMMs on or off: {name: tensor}."""
    dsv4_kernels.fp8.use_fp8_gemm(fast)
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(dy.shape[1], x.shape[1], generator=g) / x.shape[1] ** 0.5).to(x).requires_grad_()
    xg = x.detach().requires_grad_()
    y = fp8_linear(xg, w)
    (y * dy).sum().backward()
    return {"fp8 linear": y.detach(), "fp8 linear dgrad": xg.grad, "fp8 linear wgrad": w.grad}


def disagreement(got, ref, gold, tol):
    """None where got agrees with ref (dicts of tensors by name), else the worst miss. Tensors whose names start with
    "picks" must be equal. Each other one is held to gold's (the reference in fp32, else ref itself): it may be off by
    twice what ref is, plus tol of gold's largest |value|. NaN never agrees."""
    worst, why = 0.0, None
    for name, r in ref.items():
        a, g = got[name], gold.get(name, r)
        if name.startswith("picks"):
            if a.shape != r.shape or not torch.equal(a, r):
                return f"{name[6:]} differ"
            continue
        err, base = ((t.float() - g.float()).abs().max().item() for t in (a, r))
        scale = max(g.float().abs().max().item(), 1e-30)  # all zero (a gradient no token reached): must stay zero
        miss = (err - 2 * base) / scale
        if not miss <= worst:  # NaN too
            worst, why = miss, (f"{name} off by {err / scale:.1e} of its largest value, the reference by "
                                f"{base / scale:.1e}, tolerance {tol:g}")
            if miss != miss:
                break
    return None if worst <= tol else why


def alive(device):
    """Whether the device still runs work after an error: CUDA's faults (an illegal address) stick to the process."""
    try:
        torch.ones(1, device=device).sum().item()
        return True
    except Exception:
        return False
