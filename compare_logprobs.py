"""
Trainer vs rollout engine: the logprobs of the same tokens, and where two implementations part.

    python compare_logprobs.py                                   # tiny model: fp32 trainer vs fp32 engine
    python compare_logprobs.py --trainer bf16 --engine fp8       # what an FP8 rollout does to a bf16 trainer
    python compare_logprobs.py --table                           # the README table (four pairs)
    python compare_logprobs.py --layers --trainer fp32 --engine bf16     # first layer and module where they part
    python compare_logprobs.py --layers --inject_bug 3           # a planted bug: layer 3's mHC comb untransposed
    python compare_logprobs.py --table --invariant               # both sides path-invariant: the pairs agree exactly
    python compare_logprobs.py --rollout_url http://localhost:30000 --init_from out/ckpt --trainer bf16
    python compare_logprobs.py --table --replay all --init_from out/base --prompts math   # routing / indexer replay
    torchrun --nproc_per_node=4 compare_logprobs.py --pp 2 --ep 2   # the trainer as a PP x EP layout (parallel.py)

The engine samples (the embedded Engine in this process, or any SGLang-compatible server through RolloutClient); the
trainer re-scores the same tokens with a plain forward. Reported over the generated tokens: mean / p99 / max
|logp_trainer - logp_engine|, the k3 estimate of KL(engine || trainer) that Miles logs as train_rollout_kl, the first
generated token (the engine's prefill) against the rest (its KV-cache decode), and the worst tokens with their context.
--replay (routing, both: replay.py) re-scores through the experts (and the CSA indexer's picks) the engine recorded, and
adds the share of (token, layer) pairs whose expert set the trainer's own routers pick otherwise (in a replaying
forward: Gate.forward's count, as train_grpo's routing_disagree), and of (token, CSA layer) rows and of single picks
where its indexers do (those not replayed).

Precisions, for either side:
  fp32, bf16  the model as is;
  fp8         bf16, plus every FP8 linear's weight through quant.py's 128x128 block round trip (what an FP8 server
              dequantises: wq_a, wq_b, wkv, wo_a, wo_b, indexer wq_b, shared and routed experts, MTP projections;
              routed experts in FP8 as in the FP8 repack SGLang serves), plus set_fp8_emulation(True): FP8
              activations into those linears (not wo_a), the KV FP8 round trip on the non-RoPE dims, the indexer's
              Hadamard + FP4;
  fp8_fp4     fp8 with the routed experts through the FP4 (e2m1, group 32) round trip instead;
  fp32_emu    fp32 weights as they are, with set_fp8_emulation(True): the emulation without any bf16.
An fp8 trainer gets the same rounded weights as an fp8 engine (dequantising FP8 is exact, spec §2.7): the aligned pair,
whose trainer side is train_quant='fp8''s forward bit for bit (tests/test_fp8_training.py). A bf16 trainer against an
fp8 engine keeps its own weights: the FP8-rollout setup of the seed's run (FP8 rollouts, a BF16 actor).

--layers records per-layer hidden states with forward hooks (and wrappers around each block's hc_pre/hc_post, so the
mHC streams are included), token by token: the trainer side runs one full forward, the engine side prefills the prompt
and decodes the rest through its KV cache (or --engine_path forward: a second full forward, to compare precisions
alone). It prints the relative error of every recorded module in execution order and the first one above --tol.

--invariant (model.set_invariant, on both sides) removes what makes a token's numbers depend on the path that computed
it: every sum and transcendental function is taken in fp64 (dsv4_kernels.invariant.PathInvariant) and rounded as usual,
so an aligned pair then agrees bit for bit, on the CPU and on a GPU, and what remains of a gap is a recipe difference.
"""
import argparse
import copy
import os
import time

import torch
import torch.distributed as dist

import parallel
import replay
from engine import Engine, SamplingParams
from checkpoint import from_pretrained
from model_dsv4 import ModelArgs, Transformer, mask_picks, picks_mask
from quant import FP8Linear, fp4_dequantize, fp4_quantize, fp8_round
from tasks import load_tokenizer, math_problems, prompt_ids, toy_problems

MODES = {"none": (), "routing": ("routed_experts",), "both": ("routed_experts", "indexer_topk")}  # --replay
PRECISIONS = ("fp32", "bf16", "fp8", "fp8_fp4", "fp32_emu")  # --trainer, --engine: the module docstring says what

# -----------------------------------------------------------------------------
# models: one fp32 base, prepared per side

@torch.no_grad()
def wide_init_(model, head_scale=4.0, seed=0):
    """From scratch, a random model whose next-token distributions are not flat: matrices ~ N(0, 1/fan_in) (the 0.02
    init gives near-uniform logits, where every logprob delta is tiny), the head scaled up."""
    g = torch.Generator().manual_seed(seed)
    for name, t in model.named_parameters():
        if t.dim() == 2 and not name.startswith("embed"):
            scale = head_scale if name == "head.weight" else 1
            t.copy_(torch.randn(t.shape, generator=g) / t.shape[1] ** 0.5 * scale)
    return model


def prepare(base, precision, invariant=False):
    """A copy of the fp32 base in `precision` (see the module docstring); invariant: model.set_invariant."""
    return to_precision(copy.deepcopy(base), precision, invariant)


def stage_of(base, grid, precision, invariant=False):
    """This rank's part of the trainer under torchrun: a PP stage with its EP expert shard, built by parallel.py as
    train_grpo.py builds it, holding the base's tensors (the names are the same)."""
    stage, sd = parallel.build_stage(base.args, grid, torch.float32, init=False), base.state_dict()
    stage.load_state_dict({k: sd[k] for k in stage.state_dict()})
    return to_precision(stage, precision, invariant)


@torch.no_grad()
def to_precision(model, precision, invariant=False):
    assert precision in PRECISIONS, precision
    model.set_dtype(torch.float32 if precision.startswith("fp32") else torch.bfloat16)
    if invariant:
        model.set_invariant()
    model.set_fp8_emulation(precision != "bf16" and precision != "fp32")
    if precision.startswith("fp8"):
        for name, m in model.named_modules():
            if isinstance(m, FP8Linear) or name.endswith("attn.wo_a"):
                if precision == "fp8_fp4" and ".experts." in name:  # routed only: shared_experts has no ".experts."
                    m.weight.copy_(fp4_dequantize(*fp4_quantize(m.weight)))
                else:
                    m.weight.copy_(fp8_round(m.weight))
    return model.eval()


def inject_untransposed_comb(model, layer):
    """A planted bug for --layers to find: block `layer` mixes its residual streams with comb, not comb^T."""
    def hc_post(f, x, post, comb):
        return (post.unsqueeze(-1) * f.float().unsqueeze(-2) + torch.matmul(comb, x.float())).to(x.dtype)
    model.layers[str(layer)].hc_post = hc_post  # an instance attribute: wins over Block.hc_post
    return model


# -----------------------------------------------------------------------------
# logprobs: sample with the engine, re-score with the trainer

def sample(engine_model, url, prompts, temperature, max_new_tokens, seed, record=(), args=None):
    """-> [(prompt, output_ids, engine logprobs)], and for each the replay fields `record` the engine recorded
    ({field: int32 [T - 1, ...]}, replay.py; a server needs its --enable-return-* flags)"""
    if url:
        from rollout import RolloutClient
        sp = {"temperature": temperature, "max_new_tokens": max_new_tokens, "ignore_eos": True}
        samples = [o[0] for o in RolloutClient(url).generate(prompts, 1, sp, seed=seed, desc="compare", replay=record)]
        shape = replay.columns(args, range(args.num_hidden_layers), record) if record else {}
        return ([(p, s["output_ids"], s["logprobs"]) for p, s in zip(prompts, samples)],
                [{f: replay.sample_ids(s, f, len(p) + len(s["output_ids"]) - 1, shape[f][1], args) for f in record}
                 for p, s in zip(prompts, samples)])
    engine = Engine(engine_model, max_batch=len(prompts), max_len=max(map(len, prompts)) + max_new_tokens + 8,
                    record=record)
    sp = [SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, ignore_eos=True, seed=seed + i)
          for i in range(len(prompts))]
    reqs = engine.generate(prompts, sp)
    return [(r.input_ids, r.output_ids, r.output_logprobs) for r in reqs], [r.recorded or {} for r in reqs]


@torch.no_grad()
def trainer_logprobs(model, prompt, out_ids, temperature, grid=None, rec=None, stats=None):
    """log_softmax(logits / T) of the generated tokens, from one full forward (what the GRPO step computes). With a
    grid, `model` is this rank's stage and the forward goes through the pipeline (parallel.forward_only): the last
    stage gets the logprobs, the other stages None. rec: the engine's ids to replay ({field: [T - 1, ...]}, the last
    token routing itself); stats: Transformer.replay_kwargs' (one process)."""
    ids = torch.tensor(prompt + out_ids, device=next(model.parameters()).device)[None]
    rep = {f: torch.cat([t, torch.full_like(t[:1], -1)])[None].to(ids.device) for f, t in (rec or {}).items()}
    T = max(temperature, 1e-6)
    with model.numerics():  # the log-softmax too, as the engine's sampling does it
        if grid is None:
            logits = model(ids, replay=rep, stats=stats)[0, len(prompt) - 1:ids.shape[1] - 1].float()
            return (logits / T).log_softmax(-1).gather(-1, ids[0, len(prompt):, None])[:, 0]
        cols = replay.columns(model.args, model.layers, rep)  # this stage's layers of each field
        mb = {"input_ids": ids, "tgt": ids.roll(-1, 1), **{f: t[:, :, cols[f][0]] for f, t in rep.items()}}
        model.temperature = T  # the trainer's head_loss: its chunked head at the sampling temperature
        out = parallel.forward_only(model, grid, [mb], lambda logp, entropy, mb: logp[0, len(prompt) - 1:-1])
    return out[0] if out else None


@torch.no_grad()
def pick_disagreement(model, samples, records, fields):
    """The share of (token, layer) pairs whose expert set the trainer's routers pick otherwise than the engine's, of
    (token, CSA layer) rows where its indexers pick another set, and of the engine's single indexer picks they miss, in
    a forward that replays `fields` (a replaying router's own picks: Gate.forward's stats; replayed indexers: None)."""
    n = torch.zeros(6)  # experts: differ, rows; indexer: rows differ, rows, picks missed, picks
    for (p, o, _), rec in zip(samples, records):
        own, hooks, stats = {}, [], []
        for i, layer in model.layers.items():
            if "routed_experts" not in fields:
                hooks.append(layer.ffn.gate.register_forward_hook(
                    lambda m, a, out, i=i: own.__setitem__(("e", i), out[1])))
            if "indexer_topk" not in fields and layer.attn.indexer is not None:
                hooks.append(layer.attn.indexer.register_forward_hook(
                    lambda m, a, out, i=i: own.__setitem__(("x", i), mask_picks(out[0], model.args.index_topk))))
        trainer_logprobs(model, p, o, 1.0, rec={f: rec[f] for f in fields}, stats=stats)
        for h in hooks:
            h.remove()
        T = len(p) + len(o) - 1
        sets = lambda t: t.sort(-1).values
        if stats:
            n[:2] += torch.stack(stats).sum(0).cpu()
        else:
            e = torch.stack([own[("e", i)][:T] for i in model.layers], 1).cpu()
            n[:2] += torch.tensor([(sets(e) != sets(rec["routed_experts"])).any(-1).sum(), e.shape[0] * e.shape[1]])
        if "indexer_topk" not in fields:
            x, want = torch.stack([own[k][:T] for k in own if k[0] == "x"], 1).cpu(), rec["indexer_topk"]
            missed = picks_mask(want, T) & ~picks_mask(x, T)
            n[2:] += torch.tensor([(x != want).any(-1).sum(), x.shape[0] * x.shape[1], missed.sum(), (want >= 0).sum()])
    return {"experts_differ": (n[0] / n[1]).item(), "index_rows_differ": (n[2] / n[3]).item() if n[3] else None,
            "index_picks_missed": (n[4] / n[5]).item() if n[5] else None}


def compare(scores, samples, n_worst=5, decode=None):
    """The module docstring's statistics of scores (trainer_logprobs per sample), as a dict; prints the worst tokens."""
    rows = [(i, j, lt, le) for i, ((p, o, lp), s) in enumerate(zip(samples, scores))
            for j, (lt, le) in enumerate(zip(s.tolist(), lp))]
    lt, le = torch.tensor([r[2] for r in rows]), torch.tensor([r[3] for r in rows])
    d, first = (lt - le).abs(), torch.tensor([r[1] == 0 for r in rows])
    log_ratio = (lt - le).clamp(-10, 10)
    res = {"tokens": len(rows), "mean": d.mean().item(), "p99": d.quantile(0.99).item(), "max": d.max().item(),
           "kl_k3": (log_ratio.exp() - 1 - log_ratio).mean().item(), "first": d[first].mean().item(),
           "rest": d[~first].mean().item() if (~first).any() else float("nan"), "mean_logp": lt.mean().item()}
    decode = decode or str
    print(f"worst {n_worst} tokens (sample, position in the completion, token, trainer, engine, context):")
    for k in d.topk(min(n_worst, len(rows))).indices.tolist():
        i, j, a, b = rows[k]
        p, o, _ = samples[i]
        ctx = (p + o)[max(0, len(p) + j - 8):len(p) + j]
        print(f"  sample {i:2d} pos {j:3d} token {o[j]:6d} | {a:8.4f} vs {b:8.4f} (|d| {abs(a - b):.2e}) | "
              f"after {decode(ctx)}")
    return res


def line(name, r):
    return (f"{name}: mean |d| {r['mean']:.2e} | p99 {r['p99']:.2e} | max {r['max']:.2e} | KL(k3) {r['kl_k3']:.2e} | "
            f"first token {r['first']:.2e} rest {r['rest']:.2e} | {r['tokens']} tokens, mean logp {r['mean_logp']:.2f}")


# -----------------------------------------------------------------------------
# --layers: hidden states per layer and module, by token position

class Trace:
    """Records, per module name, the output row of every token position it processed. Forward hooks on the modules
    both paths call (attention projections, MoE), wrappers around hc_pre (whose output is the sublayer's normed input:
    the norm is in the decode's hc_pre kernel) / hc_post (methods, not modules) and logits. `pos`: the positions of the
    tokens of the next call, which the driver updates; close() after the run puts the model back as it was."""
    MODULES = ("attn.wq_a", "attn.wkv", "attn.wo_b", "ffn")

    def __init__(self, model, pos):
        self.rec, self.pos, self.handles, self.model = {}, pos, [], model
        self.saved = [(blk, blk.hc_pre, blk.hc_post) for blk in model.layers.values()] + [(model, model.logits)]
        for i, blk in model.layers.items():
            for name in self.MODULES:
                self.handles.append(blk.get_submodule(name).register_forward_hook(self.hook(f"layers.{i}.{name}")))
            blk.hc_pre, blk.hc_post = self.wrap_hc(blk, f"layers.{i}")
        logits = model.logits
        model.logits = lambda x: self.put("logits", logits(x))

    def hook(self, key):
        def record(module, args, out):  # returns None: the module's output stays as it is
            self.put(key, out[0] if isinstance(out, tuple) else out)  # MoE(routed=True): (y, experts)
        return record

    def close(self):
        for h in self.handles:
            h.remove()
        for blk, pre, post in self.saved[:-1]:
            blk.hc_pre, blk.hc_post = pre, post
        self.model.logits = self.saved[-1][1]

    def wrap_hc(self, blk, prefix):
        pre, post = blk.hc_pre, blk.hc_post
        def hc_pre(x, fn, scale, base, norm=None):
            blk.sub = "attn" if fn is blk.hc_attn_fn else "ffn"
            out = pre(x, fn, scale, base, norm)
            self.put(f"{prefix}.hc_pre.{blk.sub}", out[0])  # the collapsed input of the sublayer (normed)
            return out
        return hc_pre, lambda *a: self.put(f"{prefix}.hc_post.{blk.sub}", post(*a))  # the n streams after it

    def put(self, key, out):
        # out: [1, t, ...]; a call that returns fewer rows than positions (prefill logits) covers the last ones
        rows, out_rows = self.rec.setdefault(key, {}), out[0, :len(self.pos)]  # padded rows are dropped
        for p, row in zip(self.pos[len(self.pos) - len(out_rows):], out_rows):
            rows[p] = row.detach().float().clone()
        return out


@torch.no_grad()
def trace_forward(model, ids):
    t = Trace(model, list(range(len(ids))))
    model(torch.tensor(ids, device=next(model.parameters()).device)[None])
    t.close()
    return t.rec


@torch.no_grad()
def trace_engine(model, ids, n_prompt):
    """Prefill ids[:n_prompt], then decode ids[n_prompt:] one token at a time through the KV cache."""
    engine = Engine(model, max_batch=1, max_len=len(ids) + 8)
    t = Trace(model, list(range(n_prompt)))
    engine.prefill([0], [ids[:n_prompt]])
    for p in range(n_prompt, len(ids)):
        t.pos = [p]
        engine.decode(torch.tensor([0]), torch.tensor([ids[p]]), torch.tensor([p]))
    t.close()
    return t.rec


def first_divergence(rec_a, rec_b, tol):
    """-> [(name, relative error ||a - b|| / ||a||)] in side A's execution order, and the first name above tol."""
    errs = []
    for name, rows in rec_a.items():
        common = sorted(set(rows) & set(rec_b.get(name, {})))
        a = torch.stack([rows[p] for p in common])
        b = torch.stack([rec_b[name][p] for p in common])
        errs.append((name, ((a - b).norm() / a.norm().clamp(min=1e-30)).item()))
    return errs, next((n for n, e in errs if e > tol), None)


def print_layers(errs, first, tol):
    by_layer = {}
    for name, e in errs:
        layer, _, module = name.partition(".")[2].partition(".") if name.startswith("layers.") else ("", "", name)
        by_layer.setdefault(layer, []).append(f"{module} {e:.1e}")
    for layer, items in by_layer.items():
        print(f"{'layer ' + layer if layer else 'head':>8s} | " + " | ".join(items))
    print(f"first module above tol {tol:g}: {first or 'none, the two agree'}")


# -----------------------------------------------------------------------------

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="config/models/tiny.json", help="model shape when starting from scratch")
    ap.add_argument("--init_from", default="", help="a checkpoint directory (else a random model, see wide_init_)")
    ap.add_argument("--rollout_url", default="", help="sample from these servers instead of the embedded engine")
    ap.add_argument("--tokenizer", default="", help="decode the worst tokens' context ('bytes', a tokenizer.json)")
    ap.add_argument("--trainer", default="fp32", choices=PRECISIONS)
    ap.add_argument("--engine", default="fp32", choices=PRECISIONS)
    ap.add_argument("--table", action="store_true", help="fp32/fp32, bf16/bf16, bf16/fp8, fp8/fp8 as a table")
    ap.add_argument("--invariant", action="store_true",
                    help="both sides path-invariant (model.set_invariant): what closes the gap")
    ap.add_argument("--n_prompts", type=int, default=8)
    ap.add_argument("--prompts", default="random", choices=["random", "toy", "math"],
                    help="random ids, the toy task's prompts, or the math task's held-out problems (a base's task)")
    ap.add_argument("--math", default="2,1",
                    help="--prompts math: operations per problem, digits per operand (a base's task)")
    ap.add_argument("--replay", default="none", choices=[*MODES, "all"],
                    help="re-score through the engine's experts (routing) and indexer picks (both), or each in turn")
    ap.add_argument("--max_new_tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", action="store_true", help="localise the divergence on the first sample")
    ap.add_argument("--engine_path", default="cache", choices=["cache", "forward"], help="--layers: engine side runs")
    ap.add_argument("--tol", type=float, default=1e-3, help="--layers: relative error that counts as parting")
    ap.add_argument("--inject_bug", type=int, default=-1, help="engine side: layer whose mHC comb is untransposed")
    ap.add_argument("--device", default="",
                    help="'' = cuda when there is a GPU (the rank's own under torchrun), else cpu")
    ap.add_argument("--pp", type=int, default=1, help="under torchrun: the trainer as pp stages (parallel.py)")
    ap.add_argument("--ep", type=int, default=1, help="under torchrun: experts sharded over ep ranks")
    a = ap.parse_args()
    # under torchrun every rank holds a stage / expert shard of the trainer and runs every forward (DP ranks score
    # the same samples, so the EP all-to-alls pair up); rank 0 samples, the last stage's first DP rank reports
    grid = parallel.init_distributed(a.pp, a.ep) if int(os.environ.get("WORLD_SIZE", 1)) > 1 else None
    report = grid is None or (grid.is_last_stage and grid.dp_rank == 0)
    assert grid is None or not a.layers, "--layers hooks one process's model: run it without torchrun"

    torch.manual_seed(a.seed)
    base = (from_pretrained(a.init_from, dtype=torch.float32) if a.init_from
            else wide_init_(Transformer(ModelArgs.from_json(a.config), dtype=torch.float32), seed=a.seed))
    base.to(grid.device if grid else a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    g = torch.Generator().manual_seed(a.seed)
    lengths = torch.randint(4, 65, (a.n_prompts,), generator=g).tolist()
    prompts = [torch.randint(2, base.args.vocab_size, (n,), generator=g).tolist() for n in lengths]
    if a.prompts != "random":  # a task's prompts, as a base trained by train_sft.py / train_grpo.py reads them
        steps, digits = map(int, a.math.split(","))
        probs = (toy_problems() * (a.n_prompts // 10 + 1) if a.prompts == "toy"
                 else math_problems("test", a.n_prompts, steps=steps, digits=digits))
        prompts = [prompt_ids(load_tokenizer("bytes"), p["prompt"]) for p in probs[:a.n_prompts]]
    tok = load_tokenizer(a.tokenizer) if a.tokenizer else None
    decode = (lambda ids: repr(tok.decode(ids))) if tok else None

    pairs = [(a.trainer, a.engine)]
    if a.table:
        pairs = [("fp32", "fp32"), ("bf16", "bf16"), ("bf16", "fp8"), ("fp8", "fp8")]
    if a.table and a.rollout_url:  # the server's precision is its own: the trainer's vary
        pairs = [(tp, "server") for tp in ("fp32", "bf16", "fp8")]
    modes = list(MODES) if a.replay == "all" else [a.replay]
    # the engine's picks: to replay, and to count where the trainer's differ (a server: with its flags, if asked)
    record = MODES["both"] if not a.rollout_url or a.replay != "none" else ()
    m, csa = base.args, len(replay.csa_layers(base.args))
    ids_bytes = 4 * (m.num_hidden_layers * m.num_experts_per_tok + csa * m.index_topk)
    print(f"replayed ids: {ids_bytes} bytes a token (int32: "
          f"{m.num_hidden_layers} layers x {m.num_experts_per_tok} experts, {csa} CSA layers x {m.index_topk} picks)")
    results = []
    for tp, ep in pairs:
        trainer = prepare(base, tp, a.invariant) if grid is None else stage_of(base, grid, tp, a.invariant)
        samples, records = None, None
        if grid is None or grid.rank == 0:
            engine_model = None if a.rollout_url else prepare(base, ep, a.invariant)
            if a.inject_bug >= 0:
                inject_untransposed_comb(engine_model, a.inject_bug)
            samples, records = sample(engine_model, a.rollout_url, prompts, a.temperature, a.max_new_tokens, a.seed,
                                      record, base.args)
        if grid is not None:
            samples, records = parallel.broadcast_object((samples, records), 0, dist.group.WORLD, "samples")
        for mode in modes:
            recs = [{f: r[f] for f in MODES[mode]} for r in records]
            cuda = next(trainer.parameters()).is_cuda
            if cuda:  # the memory a mode's scoring adds: its peak over what was held before
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                held = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            scores = [trainer_logprobs(trainer, p, o, a.temperature, grid, r) for (p, o, _), r in zip(samples, recs)]
            if cuda:
                torch.cuda.synchronize()
            t_score = time.perf_counter() - t0
            peak_mib = (torch.cuda.max_memory_allocated() - held) / 2 ** 20 if cuda else None
            if not report:
                continue
            name = f"trainer {tp} vs " + (f"server {a.rollout_url}" if a.rollout_url else f"engine {ep}") + \
                f", replay {mode}"
            res = compare(scores, samples, decode=decode)
            res.update(t_score=t_score, peak_mib=peak_mib)
            if grid is None and record:
                res.update(pick_disagreement(trainer, samples, records, MODES[mode]))
            results.append(((tp, ep, mode), name, res))
            picks = {"experts differ": res.get("experts_differ"), "indexer rows differ": res.get("index_rows_differ"),
                     "indexer picks missed": res.get("index_picks_missed")}
            print(line(name, res) + "".join(f" | {k} {v:.4f}" for k, v in picks.items() if v is not None)
                  + f" | scored in {t_score:.2f}s" + (f", peak +{peak_mib:.0f} MiB" if cuda else ""))
        if grid is not None and report:  # the layout against one process holding the whole trainer
            whole = prepare(base, tp, a.invariant)
            one = [trainer_logprobs(whole, p, o, a.temperature, rec=r) for (p, o, _), r in zip(samples, recs)]
            diff = max((x - y).abs().max().item() for x, y in zip(scores, one))
            print(f"trainer as pp {grid.pp_size} x ep {grid.ep_size} (dp {grid.dp_size}) vs one process: "
                  f"max |d| {diff:.2e}")
        if a.layers:
            assert not a.rollout_url, "--layers hooks the engine's modules: it needs the embedded engine"
            p, o, _ = samples[0]
            rec_a = trace_forward(trainer, p + o)
            if a.engine_path == "forward":
                rec_b = trace_forward(engine_model, p + o)
            else:
                rec_b = trace_engine(engine_model, p + o, len(p))
            print(f"--layers: trainer {tp} (full forward) vs engine {ep} ({a.engine_path}), {len(p + o)} tokens")
            print_layers(*first_divergence(rec_a, rec_b, a.tol), a.tol)
    if a.table and report:
        f = lambda v: "-" if v is None else f"{v:.3g}"
        print("\n| trainer | engine | replay | mean abs d logprob | p99 | max | KL (k3) | first token | rest | experts "
              "differ | indexer rows differ | indexer picks missed | scoring s | scoring peak MiB |\n|" + "---|" * 14)
        for (tp, ep, mode), _, r in results:
            print(f"| {tp} | {ep} | {mode} | {r['mean']:.2e} | {r['p99']:.2e} | {r['max']:.2e} | {r['kl_k3']:.1e} | "
                  f"{r['first']:.2e} | {r['rest']:.2e} | {f(r.get('experts_differ'))} | "
                  f"{f(r.get('index_rows_differ'))} | {f(r.get('index_picks_missed'))} | {r['t_score']:.2f} | "
                  f"{f(r['peak_mib'])} |")
    if grid is not None:  # all ranks leave together, after the report: a rank still scoring when the others exit
        dist.barrier()    # aborts in gloo's teardown (SIGABRT on a loaded CPU)
        dist.destroy_process_group()
