"""kernels_triton.py's kernels against the code they replace: sinkhorn_triton (mHC's Sinkhorn loop as one Triton kernel
forward and one backward) against model_dsv4.sinkhorn, hc_post_triton (mHC's write-back into the streams) against
model_dsv4.Block.hc_post: values and gradients, eager and under torch.compile; decode_attention_triton against
model_dsv4.sink_attention on the gathered keys, alone and in the engine's decode; experts_triton against
kernels.grouped_experts and Expert.forward, alone and in the model's forward without grad; compress_pool_triton
against Compressor.pool, alone and in the engine's decode. Without a GPU,
kernels_triton.py runs Triton's interpreter on CPU tensors (the same kernel code, executed in numpy)."""
import copy
import os
import subprocess
import sys
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from kernels_triton import (compress_pool_triton, decode_attention_triton,  # before triton: without a GPU it turns
                            experts_triton, hc_post_triton, sinkhorn_triton)  # on the interpreter
import kernels
import kv_cache
import model_dsv4
import parallel
from conftest import SMALL, TINY, randomize_
from model_dsv4 import Block, Compressor, Expert, Transformer, sink_attention, sinkhorn

pytest.importorskip("triton", reason="Triton comes with torch's GPU builds; requirements.txt installs it for the CPU")

DEV = "cuda" if torch.cuda.is_available() else "cpu"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EPS = 1e-6


def comb(shape, n, dtype, seed):
    """Positive [*shape, n, n] matrices with entries over four orders of magnitude, as a softmax gives."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, n, n, generator=g, dtype=torch.float64) * 3).softmax(-1).add(EPS).to(DEV, dtype)


@pytest.mark.parametrize("n,iters,dtype", [(4, 20, torch.float64), (4, 20, torch.float32), (2, 6, torch.float32),
                                           (3, 6, torch.float32)])
def test_sinkhorn_triton_equals_loop(n, iters, dtype):
    """Forward and gradient equal the loop's, for 2 x 19 tokens (not a multiple of the kernel's block of tokens) and
    n = 3, which the kernel pads to 4. fp64: to ~1e-14 (the same operations; only the order of a sum of n may
    differ). fp32: to a few roundings of the result's largest value."""
    x = comb((2, 19), n, dtype, seed=n).requires_grad_()
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(1), dtype=dtype).to(DEV)
    y, ref = sinkhorn_triton(x, iters, EPS), sinkhorn(x, iters, EPS)
    (dx,), (dref,) = (torch.autograd.grad(t, x, dy) for t in (y, ref))
    tol = 1e-13 if dtype == torch.float64 else 2e-6
    assert y.shape == ref.shape and y.dtype == dtype
    assert (y - ref).abs().max() <= tol * ref.abs().max(), (y - ref).abs().max()
    assert (dx - dref).abs().max() <= tol * 10 * dref.abs().max(), ((dx - dref).abs().max(), dref.abs().max())
    # and the loop ran to its last step, which divides each column by its sum
    torch.testing.assert_close(y.detach().sum(-2), torch.ones_like(y[..., 0]), atol=1e-5, rtol=0)


def test_sinkhorn_triton_under_compile():
    """Inside a compiled function (the layers are compiled in training), the op keeps its forward and backward: its
    fake implementation gives the graph its shape, and autograd reaches the backward kernel. The CPU runs compile's
    graphs without code generation (aot_eager); a GPU through inductor."""
    backend = "inductor" if DEV == "cuda" else "aot_eager"

    def f(logits, w):  # as hc_split_sinkhorn: a softmax + eps, the loop, then something downstream
        return (sinkhorn_triton(logits.softmax(-1) + EPS, 20, EPS) * w).sum(-1)

    g = torch.Generator().manual_seed(0)
    logits, w = (torch.randn(*s, generator=g).to(DEV).requires_grad_() for s in ((37, 4, 4), (4, 4)))
    ref = sinkhorn(logits.softmax(-1) + EPS, 20, EPS)
    out = torch.compile(f, backend=backend, fullgraph=True)(logits, w)
    grads = torch.autograd.grad(out.square().sum(), (logits, w))
    refs = torch.autograd.grad(((ref * w).sum(-1)).square().sum(), (logits, w))
    torch.testing.assert_close(out, (ref * w).sum(-1), atol=1e-5, rtol=1e-5)
    for a, b in zip(grads, refs):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def hc_inputs(n, D, dtype, seed, T=19):
    """Block.hc_post's inputs for 2 x T tokens: the sublayer's output f [2, T, D] and the streams x [2, T, n, D] in
    dtype, post [2, T, n] in (0, 2) and a doubly stochastic comb [2, T, n, n] in fp32, each needing a gradient."""
    g = torch.Generator().manual_seed(seed)
    f, x = torch.randn(2, T, D, generator=g), torch.randn(2, T, n, D, generator=g)
    post = 2 * torch.rand(2, T, n, generator=g)
    c = sinkhorn(comb((2, T), n, torch.float32, seed).cpu(), 20, EPS)
    return [t.to(DEV, dt).requires_grad_() for t, dt in ((f, dtype), (x, dtype), (post, torch.float32),
                                                          (c, torch.float32))]


REF = SimpleNamespace(fast=False)  # Block.hc_post's own self: with the kernels off it takes the reference


def assert_near(a, b, name=""):
    """fp32: within a few roundings of b's largest value. bf16: each element within one rounding of its own (2^-7 of
    it: Triton's interpreter truncates where the GPU rounds to nearest), the fp32 work before it aside."""
    assert a.shape == b.shape and a.dtype == b.dtype, name
    err, scale = (a.float() - b.float()).abs(), b.float().abs().max()
    bound = 2e-5 * scale if a.dtype == torch.float32 else 2 ** -7 * b.float().abs() + 2e-5 * scale
    assert (err <= bound).all(), (name, err.max().item(), scale.item())


@pytest.mark.parametrize("n,D,dtype", [(4, 40, torch.float32), (4, 40, torch.bfloat16), (3, 700, torch.float32)])
def test_hc_post_triton_equals_reference(n, D, dtype):
    """Forward and the gradients of all four inputs equal Block.hc_post's (eager, its batched matmul). n = 3 pads to
    4 rows; D = 700 is a block of 1024 columns, partly masked."""
    ins = hc_inputs(n, D, dtype, seed=D + n)
    y, ref = hc_post_triton(*ins), Block.hc_post(REF, *ins)
    assert_near(y, ref, "y")
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(2)).to(DEV, dtype)
    grads, refs = (torch.autograd.grad(t, ins, dy) for t in (y, ref))
    for name, a, b in zip(("df", "dx", "dpost", "dcomb"), grads, refs):
        assert_near(a, b, name)


def test_hc_post_triton_under_compile():
    """In a compiled function, as in the compiled layers: the op keeps its kernels, its backward's dx is traced as
    tensor ops beside the sums' op, and the gradients equal eager Block.hc_post's; with the length symbolic (as the
    trainer compiles its layers), a second length runs the same graph."""
    backend = "inductor" if DEV == "cuda" else "aot_eager"
    w = torch.randn(4, 64, generator=torch.Generator().manual_seed(4)).to(DEV)
    loss = lambda post_fn, ins: (post_fn(*ins) * w).square().sum()
    compiled = torch.compile(lambda ins: loss(hc_post_triton, ins), backend=backend, fullgraph=True, dynamic=True)
    torch._dynamo.utils.counters.clear()
    for T in (19, 23):
        ins = hc_inputs(4, 64, torch.float32, seed=T, T=T)
        out, ref = compiled(ins), loss(lambda *a: Block.hc_post(REF, *a), ins)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=0)
        for a, b in zip(torch.autograd.grad(out, ins), torch.autograd.grad(ref, ins)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


FOUR = replace(TINY, num_hidden_layers=4, compress_ratios=[0, 0, 4, 16, 0])  # hash, window, CSA, HCA layers and MTP


@pytest.mark.parametrize("args,T", [(FOUR, 20), (SMALL, 16)], ids=["tiny-4-layers", "small"])
def test_model_on_triton_kernels_equals_reference(args, T, monkeypatch):
    """The whole model as it trains on a GPU, the Triton kernels in (Sinkhorn, hc_post; without a GPU has_triton is
    forced on and the interpreter runs them), with the trainer's activation recompute (parallel.stage_forward): the
    logits and every parameter's gradient against the reference model's, fp32, as test_kernels.py's whole-model test
    (hc_mult 4 and 2). Four of TINY's layers and one sequence of 20 or 16 tokens: the interpreter takes ~15 ms a
    program, and hc_post's kernels run a program a token."""
    calls = []
    monkeypatch.setattr(model_dsv4, "has_triton", lambda t: True)
    monkeypatch.setattr(model_dsv4, "hc_post_triton", lambda *a: calls.append(1) or hc_post_triton(*a))
    ref = randomize_(Transformer(copy.deepcopy(args), dtype=torch.float32), args.n_routed_experts,
                     args.num_experts_per_tok, seed=4).to(DEV)
    fast = copy.deepcopy(ref).set_kernels(True)
    ids = torch.randint(0, args.vocab_size, (1, T), generator=torch.Generator().manual_seed(5)).to(DEV)
    out = []
    for m in (fast, ref):
        logits = m.logits(parallel.stage_forward(m, None, ids, recompute=m is fast))
        logits.log_softmax(-1)[..., 0].sum().backward()
        out.append((logits, {n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
    assert len(calls) == 2 * 2 * args.num_hidden_layers  # two sublayers a layer, forward and recomputed
    assert (out[0][0] - out[1][0]).abs().max() <= 1e-5 * out[1][0].abs().max()
    assert out[0][1].keys() == out[1][1].keys()
    top = max(b.abs().max() for b in out[1][1].values())  # a floor: a scalar summed over every token (hc_head_scale
    for n, a in out[0][1].items():                        # at 16 tokens: 1.6e-3, 1.5e-7 apart) cancels to little
        b = out[1][1][n]
        assert (a - b).abs().max() <= 5e-5 * b.abs().max() + 1e-6 * top, n


@pytest.mark.parametrize("H,D,compressed,dtype", [(3, 40, True, torch.float32), (20, 32, False, torch.float32),
                                                   (16, 64, True, torch.bfloat16)])
def test_decode_attention_triton_equals_sink_attention(H, D, compressed, dtype):
    """One query token per sequence against its cache rows (slots out of order, one cache row never read), the
    window's 8 keys and the first 50 of 60 compressed entries (two blocks of keys: one row attends nothing in the
    second, one nothing at all), against sink_attention on the keys gathered and concatenated, and exact attention
    in fp64. Heads 3 and 20 (padded to blocks of 16), head dims 40 and 32 (padded to a power of two). fp32: to 1e-5
    of the largest output. bf16 (the engine's): the reference to a rounding, the kernel to two (the interpreter
    truncates where the GPU rounds: probabilities and output)."""
    g = torch.Generator().manual_seed(H)
    B, W, n_comp, S = 5, 8, 60, 50 if compressed else 0
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(DEV, dtype)
    q, win, comp, sink = rnd(B, H, D) * 2, rnd(B + 1, W, D), rnd(B + 1, n_comp, D) if compressed else None, rnd(H)
    slots = torch.randperm(B + 1, generator=g)[:B].to(DEV)
    mask = torch.rand(B, W + S, generator=g).to(DEV) < 0.6
    mask[1] = False
    mask[2, 32:] = False
    out = decode_attention_triton(q, win, comp, slots, mask, sink.float(), D ** -0.5)
    keys = torch.cat([win[slots], comp[slots, :S]], 1) if compressed else win[slots]
    ref = sink_attention(q[:, None], keys, mask[:, None], sink.float(), D ** -0.5)[:, 0]
    exact = sink_attention(q[:, None].double(), keys.double(), mask[:, None], sink.double(), D ** -0.5)[:, 0]
    assert out.shape == ref.shape and out.dtype == dtype and (out[1] == 0).all()  # the sink took all of row 1
    top = exact.abs().max()
    if dtype == torch.float32:
        assert (out.double() - exact).abs().max() <= 1e-5 * top
    else:
        assert (ref.double() - exact).abs().max() <= 2 ** -8 * top
        assert (out.double() - exact).abs().max() <= 2 ** -6 * top


@pytest.mark.parametrize("E,D,I,tokens,limit,dtype", [(4, 40, 24, 5, 1.0, torch.float32),
                                                       (3, 64, 32, 20, 0.0, torch.float32),
                                                       (4, 64, 48, 6, 1.0, torch.bfloat16)])
def test_experts_triton_equals_grouped_experts(E, D, I, tokens, limit, dtype, monkeypatch):
    """A decode step's routed experts, rows sorted by expert (expert 1 has none), against grouped_experts' aten path
    and Expert.forward per expert in fp64. D 40 and I 24 are not multiples of the kernels' blocks (masked edges);
    20 tokens x top-2 of 3 experts give 40 rows > 16 an expert (blocks of 32 rows). limit 1.0 clamps most of the
    gate and up values (x scaled by 4), 0.0 none. fp32: to 1e-5 of the largest output; bf16 to two roundings."""
    g = torch.Generator().manual_seed(D)
    experts = [Expert(D, I, limit) for _ in range(E)]
    for e in experts:
        for w in (e.w1, e.w2, e.w3):
            w.weight.data = (torch.randn(w.weight.shape, generator=g) / w.weight.shape[1] ** 0.5).to(dtype)
    idx = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(tokens)]).flatten()
    idx[idx == 1] = 0
    counts = torch.bincount(idx, minlength=E)
    xs = (torch.randn(len(idx), D, generator=g) * 4).to(dtype)
    ws = torch.rand(len(idx), generator=g)
    experts = [e.to(DEV) for e in experts]
    xs, ws, counts = xs.to(DEV), ws.to(DEV), counts.to(DEV)
    w13, w2 = kernels.stack(experts)
    with torch.no_grad():
        out = experts_triton(xs, ws, counts.cumsum(0).to(torch.int32), w13, w2, limit)
        monkeypatch.setattr(kernels, "has_triton", lambda t: False)
        ref = kernels.grouped_experts(experts, xs, ws, counts, limit)
        ends = counts.cumsum(0).tolist()
        exact = torch.cat([copy.deepcopy(e).double()(xs[a:b].double(), ws[a:b].double())
                           for e, a, b in zip(experts, [0] + ends[:-1], ends)])
    assert out.shape == ref.shape and out.dtype == dtype
    top = exact.abs().max()
    if dtype == torch.float32:
        assert (out.double() - ref.double()).abs().max() <= 1e-5 * top
    else:
        assert (ref.double() - exact).abs().max() <= 2 ** -6 * top
        assert (out.double() - exact).abs().max() <= 2 ** -6 * top


@pytest.mark.parametrize("ratio,d", [(4, 40), (16, 32), (128, 24)])
def test_compress_pool_triton_equals_pool(ratio, d):
    """A decode step's pooling of each sequence's cached window, against Compressor.pool on the rows gathered: ratio 4
    (CSA: overlapping windows, the previous window's first-half rows in, one sequence with none yet: -inf scores),
    16 and 128 (HCA); head dims 40 and 24 (not multiples of the kernel's channel block); 5 sequences in cache rows out
    of order, 2 of them not complete (zeros). fp32, to 1e-5 of the largest entry."""
    g = torch.Generator().manual_seed(ratio)
    comp = Compressor(SimpleNamespace(hidden_size=8, rms_norm_eps=1e-6), ratio, d)
    comp.ape.data = torch.randn(comp.ape.shape, generator=g)
    coff, rows = 2 if comp.overlap else 1, 7
    kv, score = torch.randn(rows, ratio, coff * d, generator=g), torch.randn(rows, ratio, coff * d, generator=g) * 3
    prev_kv, prev_score = torch.randn(rows, ratio, d, generator=g), torch.randn(rows, ratio, d, generator=g) * 3
    slots = torch.tensor([4, 0, 6, 2, 5])
    prev_score[6] = float("-inf")  # no window before
    full = torch.tensor([True, False, True, True, False])
    comp, kv, score, prev_kv, prev_score, slots, full = (t.to(DEV) for t in (comp, kv, score, prev_kv, prev_score,
                                                                              slots, full))
    out = compress_pool_triton(kv, score, prev_kv, prev_score, comp.ape, slots, full, comp.overlap)
    with torch.no_grad():
        ref = comp.pool(kv[slots, None], score[slots, None], prev_kv[slots], prev_score[slots])[:, 0]
    assert out.shape == (5, d) and (out[~full] == 0).all()
    assert (out[full] - ref[full]).abs().max() <= 1e-5 * ref[full].abs().max()


def test_engine_decode_on_triton_attention_equals_reference(monkeypatch):
    """The engine's decode with the kernel (static caches, read whole and masked, as under CUDA graphs) against the
    reference path (each sequence's entries up to its own count, gathered): TINY's window, CSA and HCA layers decode
    14 tokens in cache rows 2, 0, 3 after prompts of 3, 20 and 37 tokens (past the 32-token window and across CSA
    and HCA windows), both sides fed the same tokens. fp32, so that a wrong key or mask is not lost in bf16's noise
    (which this random model amplifies: the bf16 reference alone, static against not, parts by 0.7 on logits of 4.8);
    7e-6 apart on the CPU. (The experts' kernels in the interpreter would make this a minute: the next test.)"""
    monkeypatch.setattr(kv_cache, "has_triton", lambda t: True)
    model = randomize_(Transformer(copy.deepcopy(TINY), dtype=torch.float32), TINY.n_routed_experts,
                       TINY.num_experts_per_tok, seed=2).to(DEV)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, TINY.vocab_size, (n,), generator=g).tolist() for n in (3, 20, 37)]
    tokens = torch.randint(2, TINY.vocab_size, (14, 3), generator=g).to(DEV)
    slots = torch.tensor([2, 0, 3], device=DEV)
    logits = []
    for fast in (True, False):
        for layer in model.layers.values():
            layer.attn.fast = fast
        cache = kv_cache.KVCache(model, 4, 64, DEV, static=fast)
        out = []
        with torch.no_grad():
            cache.prefill(model, slots.tolist(), prompts)
            for i, t in enumerate(tokens):
                out.append(cache.decode(model, slots, t, torch.tensor([len(p) + i for p in prompts], device=DEV)))
        logits.append(torch.stack(out).float())
    fast, ref = logits
    assert (fast - ref).abs().max() <= 1e-5 * ref.abs().max(), ((fast - ref).abs().max(), ref.abs().max())


def test_model_without_grad_on_triton_experts_equals_reference(monkeypatch):
    """A forward without grad (the engine's prefill and decode) takes the experts' kernels through
    kernels.grouped_experts (with few rows an expert): four of TINY's layers on 2 sequences of 10 tokens against the
    same model on aten's grouped GEMM, fp32, to 1e-5 of the largest logit; each layer's MoE called the kernels once."""
    calls = []
    monkeypatch.setattr(kernels, "has_triton", lambda t: True)
    monkeypatch.setattr(kernels, "experts_triton", lambda *a: calls.append(1) or experts_triton(*a))
    model = randomize_(Transformer(copy.deepcopy(FOUR), dtype=torch.float32), FOUR.n_routed_experts,
                       FOUR.num_experts_per_tok, seed=6).to(DEV).set_kernels(True)
    ids = torch.randint(0, FOUR.vocab_size, (2, 10), generator=torch.Generator().manual_seed(7)).to(DEV)
    with torch.no_grad():
        fast = model(ids)
        monkeypatch.setattr(kernels, "has_triton", lambda t: False)
        ref = model(ids)
    assert len(calls) == FOUR.num_hidden_layers
    assert (fast - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_kernels_compile_for_h200_and_mi355x():
    """Triton's interpreter runs code that its compiler refuses (session 14's first kernel passed the tests above on
    the CPU and failed to compile on the GPU: an `if` whose branches gave two shapes). So every kernel is also
    compiled here, without a GPU, to machine code for the H200 (sm_90, a cubin) and the MI355X (gfx950, a hsaco), as
    the launchers call them: Sinkhorn on 4 x 4 matrices, 20 iterations; hc_post on bf16 streams of bench_2b's width
    (D 1536: a block of 2048, a token a program); decode attention at head dim 512; the experts' two kernels; the
    compressor's pooling with and without overlap. In a subprocess: this process's kernels are interpreted."""
    code = """
import kernels_triton as kt, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
# (kernel, constexprs, scalar arguments, bf16 pointers (the others fp32), warps)
kernels = [(fn, {"STEPS": 39, "N": 4, "NP": 4, "BLOCK": kt.BLOCK}, {"n_tok": "i32", "eps": "fp32"}, (), 1)
           for fn in (kt._sinkhorn_fwd, kt._sinkhorn_bwd)]
kernels += [(fn, {"N": 4, "NP": 4, "BLOCK_D": 2048}, {"D": "i32"}, ("f_ptr", "x_ptr", "y_ptr", "dy_ptr", "df_ptr"),
             8) for fn in (kt._hc_post_fwd, kt._hc_post_bwd)]
kernels += [(kt._decode_attn, {"HEADS": kt.HEADS, "DP": 512, "BLOCK_N": kt.DECODE_BLOCK_N, "F32": False},
             {"scale": "fp32", **{a: "i32" for a in ("H", "D", "W", "S", "n_comp")}, "slot_ptr": "*i64",
              "mask_ptr": "*u8"}, ("q_ptr", "win_ptr", "comp_ptr", "out_ptr"), 4)]
blocks = {"F32": False, "BLOCK_M": 16, "BLOCK_N": kt.EXPERTS_BLOCK_N, "BLOCK_K": kt.EXPERTS_BLOCK_K}
kernels += [(kt._compress_pool, {"OVERLAP": o, "MP": m, "BLOCK_D": kt.POOL_BLOCK_D},
             {"m": "i32", "d": "i32", "slot_ptr": "*i64", "full_ptr": "*u8"}, (), 4)
            for o, m in ((True, 4), (False, 128))]
kernels += [(fn, consts, {"D": "i32", "I": "i32", "limit": "fp32", "offs_ptr": "*i32"},
             ("x_ptr", "w13_ptr", "h_ptr", "w2_ptr", "out_ptr"), 4)
            for fn, consts in ((kt._experts_up, {"CLAMP": True, **blocks}), (kt._experts_down, blocks))]
for target, binary in ((GPUTarget("cuda", 90, 32), "cubin"), (GPUTarget("hip", "gfx950", 64), "hsaco")):
    for fn, consts, scalars, bf16, warps in kernels:
        ptrs = {a: "*bf16" if a in bf16 else scalars.get(a, "*fp32") for a in fn.arg_names if a.endswith("_ptr")}
        sig = {**ptrs, **{a: t for a, t in scalars.items() if a in fn.arg_names}}
        sig.update({a: "constexpr" for a in consts})
        src = ASTSource(fn, sig, constexprs=consts)
        assert binary in triton.compile(src, target=target, options={"num_warps": warps}).asm, (target, fn)
        print(target.arch, fn.__name__, "compiled")
"""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("compiled") == 18, out.stdout
