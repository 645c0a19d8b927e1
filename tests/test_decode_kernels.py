"""dsv4_kernels/decode.py's kernels against the code they replace: experts_triton against fast.grouped_experts and
Expert.forward, alone and in the model's forward without grad; compress_step_triton against the cache's compressor
step, alone and in the engine's decode; sample_triton against engine.sample_tokens, alone and in the engine;
q_norm_rope_triton against Attention.query; window_kv_triton against Attention.window_kv and the cache's writes, alone
and in the engine's decode (the decode attention's: test_decode_attention.py, the routing kernels':
test_routing_kernels.py). Without a GPU, Triton's interpreter runs them on CPU tensors (the package's __init__ turns
it on); test_kernel_builds.py compiles them for sm_90 and gfx950."""
import copy
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from dsv4_kernels.decode import (experts_triton, q_norm_rope_triton,  # before triton: without a GPU the package
                                 sample_triton, window_kv_triton)      # turns on the interpreter
import engine
import dsv4_kernels.fast
import kv_cache
from dsv4_kernels import INTERPRETED
import model_dsv4
from conftest import TINY, randomize_
from model_dsv4 import Attention, Compressor, Transformer, rope_cos_sin
from moe import Expert
from test_mhc_kernels import FOUR

pytest.importorskip("triton", reason="Triton comes with torch's GPU builds; requirements.txt installs it for the CPU")

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("E,D,I,tokens,limit,dtype,shared", [(4, 40, 24, 5, 1.0, torch.float32, True),
                                                              (3, 64, 32, 20, 0.0, torch.float32, False),
                                                              (3, 64, 32, 20, 0.0, torch.float32, True),
                                                              (4, 64, 48, 6, 1.0, torch.bfloat16, True)])
def test_experts_triton_equals_grouped_experts(E, D, I, tokens, limit, dtype, shared, monkeypatch):
    """A decode step's routed experts, rows sorted by expert (expert 1 has none), against grouped_experts' aten path
    and Expert.forward per expert in fp64; with shared, also the shared expert on the tokens' own rows, as one more
    expert of the kernels (20 tokens: two programs of 16 rows), against Expert.forward on them (its own weights, no
    routing weight). D 40 and I 24 are not multiples of the kernels' blocks (masked edges); 20 tokens x top-2 of 3
    experts give 40 rows, more than 16 an expert for one. limit 1.0 clamps most of the gate and up values (x scaled by
    4), 0.0 none. fp32: to 1e-5 of the largest output; bf16 to two roundings."""
    g = torch.Generator().manual_seed(D)
    experts = [Expert(D, I, limit) for _ in range(E + 1)]  # the last: the shared expert
    for e in experts:
        for w in (e.w1, e.w2, e.w3):
            w.weight.data = (torch.randn(w.weight.shape, generator=g) / w.weight.shape[1] ** 0.5).to(dtype)
    idx = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(tokens)]).flatten()
    idx[idx == 1] = 0
    counts = torch.bincount(idx, minlength=E)
    xs = (torch.randn(len(idx), D, generator=g) * 4).to(dtype)
    ws = torch.rand(len(idx), generator=g)
    x = (torch.randn(tokens, D, generator=g) * 4).to(dtype)
    experts = [e.to(DEV) for e in experts]
    experts, sh = experts[:E], experts[E]
    xs, ws, counts, x = xs.to(DEV), ws.to(DEV), counts.to(DEV), x.to(DEV)
    w13, w2 = dsv4_kernels.fast.stack(experts)
    with torch.no_grad():
        out = experts_triton(xs, ws, counts.cumsum(0).to(torch.int32), w13, w2, limit,
                             *((x, sh.w1.weight, sh.w3.weight, sh.w2.weight) if shared else ()))
        monkeypatch.setattr(dsv4_kernels.fast, "has_triton", lambda t: False)
        ref = dsv4_kernels.fast.grouped_experts(experts, xs, ws, counts, limit)
        ends = counts.cumsum(0).tolist()
        exact = torch.cat([copy.deepcopy(e).double()(xs[a:b].double(), ws[a:b].double())
                           for e, a, b in zip(experts, [0] + ends[:-1], ends)])
        if shared:
            ref, exact = torch.cat([ref, sh(x)]), torch.cat([exact, copy.deepcopy(sh).double()(x.double())])
    assert out.shape == ref.shape == (len(idx) + tokens * shared, D) and out.dtype == dtype
    top = exact.abs().max()
    if dtype == torch.float32:
        assert (out.double() - ref.double()).abs().max() <= 1e-5 * top
    else:
        assert (ref.double() - exact).abs().max() <= 2 ** -6 * top
        assert (out.double() - exact).abs().max() <= 2 ** -6 * top


@pytest.mark.slow
@pytest.mark.parametrize("ratio,d,dtype", [(4, 40, torch.float32), (16, 24, torch.float32),
                                           (128, 24, torch.float32), (4, 64, torch.bfloat16)])
def test_compress_step_triton_equals_compressor_step(ratio, d, dtype):
    """A decode step's compressor in one kernel against KVCache._compressor_step's reference (the rows written,
    every window pooled and kept where complete, Compressor.finish, the writes): ratio 4 (CSA: overlapping windows,
    one cache row with no window before: -inf scores), 16 and 128 (HCA, 128 rows in passes of COMPRESS_ROWS); head
    dims 40 and 24 with RoPE on the last 16 (not powers of two); 5 sequences in cache rows out of order, each stepped
    ratio + 2 times from its own position, so that each completes a window (one at the first step); the rows read
    as strided slices, as the fused projections give them. The five caches after every step: the partial windows and
    the overlap exactly; the entries in fp32 to 1e-5 of the largest, in bf16 a rounding apart (2^-8 of the largest),
    four under the interpreter, which truncates where the GPU rounds."""
    g = torch.Generator().manual_seed(ratio + d)
    args = replace(TINY, qk_rope_head_dim=16)
    comp = Compressor(SimpleNamespace(hidden_size=8, rms_norm_eps=1e-6), ratio, d)
    comp.ape.data, comp.norm.weight.data = torch.randn(comp.ape.shape, generator=g), torch.rand(d, generator=g) + 0.5
    comp.wkv.weight.data = comp.wkv.weight.data.to(dtype)  # finish rounds the entries to the compressor's dtype
    coff, rows, n_out = 2 if comp.overlap else 1, 7, 8
    rnd = lambda *shape: torch.randn(*shape, generator=g)
    c = {"comp": rnd(rows, n_out, d).to(dtype), "comp_kv": rnd(rows, ratio, coff * d),
         "comp_score": rnd(rows, ratio, coff * d) * 3, "comp_prev_kv": rnd(rows, ratio, d),
         "comp_prev_score": rnd(rows, ratio, d) * 3}
    c["comp_prev_score"][6] = float("-inf")  # no window before
    comp, c = comp.to(DEV), {k: v.to(DEV) for k, v in c.items()}
    slots, start = torch.tensor([4, 0, 6, 2, 5], device=DEV), torch.tensor([ratio - 1, 0, 3, 5 * ratio - 2, 1]).to(DEV)
    ours, ref = c, {k: v.clone() for k, v in c.items()}
    cache = SimpleNamespace(args=args)
    for step in range(ratio + 2):
        wide = rnd(5, 1, 2 * coff * d + 3).to(DEV) * 3
        proj = (wide[..., 3:3 + coff * d], wide[..., 3 + coff * d:])
        pos = start + step
        rope = {("start", ratio): rope_cos_sin(args, ratio, (pos + 1 - ratio)[:, None])}  # KVCache.step_rope's
        with torch.no_grad():
            for fast, caches in ((True, ours), (False, ref)):
                kv_cache.KVCache._compressor_step(cache, comp, None, caches, "comp", slots, pos, fast, proj, rope)
        for k in c:
            if k != "comp":
                assert torch.equal(ours[k], ref[k]), (step, k)
        tol = 1e-5 if dtype == torch.float32 else 2 ** -6 if INTERPRETED else 2 ** -8
        err = (ours["comp"].float() - ref["comp"].float()).abs().max()
        assert err <= tol * ref["comp"].float().abs().max(), (step, err)


@pytest.mark.slow
def test_model_without_grad_on_triton_experts_equals_reference(monkeypatch):
    """A decode step's MoE (one token a sequence, without grad) takes the experts' kernels through
    dsv4_kernels.fast.grouped_experts (with few rows an expert): four of TINY's layers on 20 sequences of 1 token
    against the same model on aten's grouped GEMM, fp32 to 1e-5 of the largest logit (on a GPU bf16, which aten's
    grouped GEMM needs there, to 2e-2); each layer's MoE called the kernels once. A prefill's rows (2 sequences of 10
    tokens, as few an expert) never do: a branch on their count would make the compiled prefill compile again after
    the warm-up."""
    calls, dtype = [], torch.bfloat16 if DEV == "cuda" else torch.float32
    monkeypatch.setattr(dsv4_kernels.fast, "has_triton", lambda t: True)
    monkeypatch.setattr(dsv4_kernels.fast, "experts_triton", lambda *a: calls.append(1) or experts_triton(*a))
    model = randomize_(Transformer(copy.deepcopy(FOUR), dtype=dtype), FOUR.n_routed_experts,
                       FOUR.num_experts_per_tok, seed=6).to(DEV).set_kernels(True)
    ids = torch.randint(0, FOUR.vocab_size, (20, 1), generator=torch.Generator().manual_seed(7)).to(DEV)
    with torch.no_grad():
        fast = model(ids)
        assert len(calls) == FOUR.num_hidden_layers
        model(ids.view(2, 10))
        assert len(calls) == FOUR.num_hidden_layers
        monkeypatch.setattr(dsv4_kernels.fast, "has_triton", lambda t: False)
        ref = model(ids)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (fast - ref).abs().max() <= tol * ref.abs().max(), ((fast - ref).abs().max(), ref.abs().max())


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [64, 300, 8192])
def test_sample_triton_equals_sample_tokens(chunk):
    """The sampler over chunks of the vocabulary (one chunk, several, a last one partial) against engine.sample_tokens
    with no top-p or top-k: 24 rows of 1000 tokens, greedy (0, and 1e-7 below SGLang's greedy threshold) and sampled
    at 0.3-1.6 under seeds up to 2^62: the same tokens, logprobs to 1e-5 (both fp32)."""
    g = torch.Generator().manual_seed(chunk)
    B, V = 24, 1000
    logits = (torch.randn(B, V, generator=g) * 4).to(DEV)
    logits[0, 10] = logits[0, 500] = logits[0].max() + 1  # a tie: the first of equal scores wins, in both
    temp = torch.tensor([0.0, 1e-7, 0.3, 0.7, 1.0, 1.6], dtype=torch.float64).repeat(B // 6).to(DEV)
    params = torch.stack([temp, torch.ones_like(temp), torch.full_like(temp, V)], 1)
    draws = torch.stack([torch.randint(-2 ** 62, 2 ** 62, (B,), generator=g),
                         torch.randint(0, 5000, (B,), generator=g)], 1).to(DEV)
    greedy = temp < engine.GREEDY_T
    ref = engine.sample_tokens(logits, params, draws, False)
    got = sample_triton(logits, torch.where(greedy, 1.0, temp).float(), greedy, draws, chunk)
    assert got[0, 0] == 10 and torch.equal(got[0], ref[0]) and (got[1] - ref[1]).abs().max() <= 1e-5


@pytest.mark.slow
def test_engine_samples_on_triton_as_on_the_reference(monkeypatch):
    """The engine takes sample_triton where the kernels are on and no request filters (top-p, top-k): TINY's requests
    greedy and sampled, then with one top-p request in the batch (the reference for the whole batch), give the tokens
    and logprobs (to 1e-5) of the engine on engine.sample_tokens alone."""
    calls = []
    monkeypatch.setattr(engine, "sample_triton", lambda *a: calls.append(1) or sample_triton(*a))
    model = randomize_(Transformer(copy.deepcopy(TINY), dtype=torch.float32), TINY.n_routed_experts,
                       TINY.num_experts_per_tok, seed=3).to(DEV).set_kernels(True)
    prompts = [[5, 9, 200, 31], [7, 8], [300, 2, 2, 40, 41]]
    plain = [engine.SamplingParams(temperature=t, max_new_tokens=6, ignore_eos=True, seed=i)
             for i, t in enumerate((0.0, 0.8, 1.0))]
    runs = {}
    for on in (True, False):
        monkeypatch.setattr(engine, "has_triton", lambda t: on)
        for top_p in (1.0, 0.9):
            params = plain[:2] + [engine.SamplingParams(temperature=1.0, top_p=top_p, max_new_tokens=6,
                                                        ignore_eos=True, seed=2)]
            runs[on, top_p] = engine.Engine(model, max_batch=4, max_len=32, cuda_graphs=False).generate(prompts, params)
    assert len(calls) == 6  # the admission's draw and 5 decode steps, unfiltered only
    for top_p in (1.0, 0.9):
        for a, b in zip(runs[True, top_p], runs[False, top_p]):
            assert a.output_ids == b.output_ids
            assert max(abs(x - y) for x, y in zip(a.output_logprobs, b.output_logprobs)) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_q_norm_rope_triton_equals_query(dtype, monkeypatch):
    """Attention.query's per-head norm and RoPE in one kernel, which the query takes for one token a sequence without
    grad when the kernels are on: TINY's layer 2 (YaRN RoPE), 5 sequences at their own positions (cos [B, 1, rd/2])
    and one of 3 tokens at positions 0-2 (cos [T, rd/2], as a prefill gives it), against the reference path. fp32:
    to 1e-6 of the largest value; bf16: a rounding apart (2^-8 of the largest value), four under the interpreter,
    which truncates where the GPU rounds (the factor, the product, the rotation)."""
    calls = []
    monkeypatch.setattr(model_dsv4, "has_triton", lambda t: True)
    monkeypatch.setattr(model_dsv4, "q_norm_rope_triton", lambda *a: calls.append(1) or q_norm_rope_triton(*a))
    g = torch.Generator().manual_seed(2)
    attn = randomize_(Attention(2, TINY), TINY.n_routed_experts, TINY.num_experts_per_tok, seed=2).to(DEV, dtype)
    x = torch.randn(5, 1, TINY.hidden_size, generator=g).to(DEV, dtype)
    cos, sin = rope_cos_sin(TINY, attn.ratio, torch.tensor([[3], [70], [5], [0], [1000]]).to(DEV))
    with torch.no_grad():
        got, ref = [], []
        for fast, out in ((True, got), (False, ref)):
            attn.fast = attn.fast_decode = fast
            out.append(attn.query(x, cos, sin)[0])
            c, s = rope_cos_sin(TINY, attn.ratio, torch.arange(3).to(DEV))
            out.append(q_norm_rope_triton(attn.wq_b(attn.q_norm(attn.wq_a(x[:1].expand(1, 3, -1)))).view(
                1, 3, TINY.num_attention_heads, -1), c, s, TINY.rms_norm_eps) if fast else attn.query(
                x[:1].expand(1, 3, -1), c, s)[0])
    assert len(calls) == 1  # the decode-shaped query; the 3-token one above called the op directly
    tol = 1e-6 if dtype == torch.float32 else 2 ** -6 if INTERPRETED else 2 ** -8
    for a, b in zip(got, ref):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert (a.float() - b.float()).abs().max() <= tol * b.float().abs().max(), (a - b).abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_window_kv_triton_equals_window_kv(dtype):
    """A decode step's window key in one kernel: Attention.window_kv (kv_norm with its weight, RoPE at each sequence's
    position) written to the ring buffer's row pos % W of each slot (slots out of order, positions past the window),
    and the position to win_pos, against the reference's writes. The key read as a strided slice, as the fused
    projections give it. Rows not written stay as they were; fp32: to 1e-6 of the largest value; bf16: a rounding
    apart (2^-8 of the largest), four under the interpreter, which truncates where the GPU rounds."""
    g = torch.Generator().manual_seed(3)
    attn = randomize_(Attention(2, TINY), TINY.n_routed_experts, TINY.num_experts_per_tok, seed=3).to(DEV, dtype)
    attn.kv_norm.weight.data = torch.rand(TINY.head_dim, generator=g).to(DEV) + 0.5  # fp32, not all ones
    B, W, d = 5, TINY.sliding_window, TINY.head_dim
    h = torch.randn(B, 1, TINY.hidden_size, generator=g).to(DEV, dtype)
    slots, pos = torch.tensor([4, 0, 2, 5, 1]).to(DEV), torch.tensor([3, 70, 31, 0, 1000]).to(DEV)
    cos, sin = rope_cos_sin(TINY, attn.ratio, pos[:, None])
    win, win_pos = torch.randn(6, W, d, generator=g).to(DEV, dtype), torch.randint(-1, 99, (6, W), generator=g).to(DEV)
    ref_win, ref_pos = win.clone(), win_pos.clone()
    with torch.no_grad():
        ref_win[slots, pos % W] = attn.window_kv(h, cos, sin)[:, 0]
        ref_pos[slots, pos % W] = pos
        wide = torch.cat([torch.randn(B, 1, 7, generator=g).to(DEV, dtype), attn.wkv(h)], -1)  # a strided slice
        window_kv_triton(wide[:, 0, 7:], attn.kv_norm.weight, cos[:, 0], sin[:, 0], win, win_pos, slots, pos,
                         TINY.rms_norm_eps)
    assert torch.equal(win_pos, ref_pos)
    written = torch.zeros(6, W, dtype=torch.bool, device=DEV)
    written[slots, pos % W] = True
    assert torch.equal(win[~written], ref_win[~written])
    tol = 1e-6 if dtype == torch.float32 else 2 ** -6 if INTERPRETED else 2 ** -8
    err = (win.float() - ref_win.float()).abs().max()
    assert err <= tol * ref_win[written].float().abs().max(), err
