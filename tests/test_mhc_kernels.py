"""dsv4_kernels/mhc_triton.py's kernels against the code they replace: sinkhorn_triton (mHC's Sinkhorn loop as one
Triton kernel forward and one backward) against mhc.sinkhorn, hc_post_triton (mHC's write-back into the streams)
against model_dsv4.Block.hc_post: values and gradients, eager and under torch.compile, and in the whole model;
hc_pre_triton (mHC's pre-mix for decode) against Block.hc_pre's reference, alone and in a model's forward without
grad (every kernel of the project compiled for sm_90 and gfx950: test_kernel_builds.py).
Without a GPU, Triton's interpreter runs the kernels on CPU tensors (the same kernel code, executed in numpy): the
package's __init__ turns it on."""
import copy
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from dsv4_kernels.mhc_triton import (hc_post_triton, hc_pre_triton,  # before triton: without a GPU the package
                                     sinkhorn_triton)                 # turns on the interpreter
import mhc
import model_dsv4
import parallel
from conftest import SMALL, TINY, randomize_
from mhc import sinkhorn
from model_dsv4 import Block, Transformer

pytest.importorskip("triton", reason="Triton comes with torch's GPU builds; requirements.txt installs it for the CPU")

DEV = "cuda" if torch.cuda.is_available() else "cpu"
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


@pytest.mark.slow
@pytest.mark.parametrize("args,T", [(FOUR, 20), (SMALL, 16)], ids=["tiny-4-layers", "small"])
def test_model_on_triton_kernels_equals_reference(args, T, monkeypatch):
    """The whole model as it trains on a GPU, the Triton kernels in (Sinkhorn, hc_post; without a GPU has_triton is
    forced on and the interpreter runs them), with the trainer's activation recompute (parallel.stage_forward): the
    logits and every parameter's gradient against the reference model's, fp32, as test_fast_paths.py's whole-model test
    (hc_mult 4 and 2). Four of TINY's layers and one sequence of 20 or 16 tokens: the interpreter takes ~15 ms a
    program, and hc_post's kernels run a program a token."""
    calls, sinks = [], []
    monkeypatch.setattr(model_dsv4, "has_triton", lambda t: True)
    monkeypatch.setattr(mhc, "has_triton", lambda t: True)
    monkeypatch.setattr(model_dsv4, "hc_post_triton", lambda *a: calls.append(1) or hc_post_triton(*a))
    monkeypatch.setattr(mhc, "sinkhorn_triton", lambda *a: sinks.append(1) or sinkhorn_triton(*a))
    ref = randomize_(Transformer(copy.deepcopy(args), dtype=torch.float32), args.n_routed_experts,
                     args.num_experts_per_tok, seed=4).to(DEV)
    fast = copy.deepcopy(ref).set_kernels(True)
    ids = torch.randint(0, args.vocab_size, (1, T), generator=torch.Generator().manual_seed(5)).to(DEV)
    out = []
    for m in (fast, ref):
        logits = m.logits(parallel.stage_forward(m, None, ids, recompute=m is fast))
        logits.log_softmax(-1)[..., 0].sum().backward()
        out.append((logits, {n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
    assert len(calls) == len(sinks) == 2 * 2 * args.num_hidden_layers  # two sublayers a layer, forward and recomputed
    assert (out[0][0] - out[1][0]).abs().max() <= 1e-5 * out[1][0].abs().max()
    assert out[0][1].keys() == out[1][1].keys()
    top = max(b.abs().max() for b in out[1][1].values())  # a floor: a scalar summed over every token (hc_head_scale
    for n, a in out[0][1].items():                        # at 16 tokens: 1.6e-3, 1.5e-7 apart) cancels to little
        b = out[1][1][n]
        assert (a - b).abs().max() <= 5e-5 * b.abs().max() + 1e-6 * top, n


@pytest.mark.parametrize("n,D,T,dtype,norm", [(4, 40, 7, torch.float32, False), (3, 24, 7, torch.float32, True),
                                              (2, 40, 7, torch.float32, False), (4, 2100, 37, torch.float32, False),
                                              (4, 2100, 5, torch.float32, True), (4, 64, 7, torch.bfloat16, False),
                                              (4, 64, 7, torch.bfloat16, True)])
def test_hc_pre_triton_equals_reference(n, D, T, dtype, norm):
    """mHC's pre-mix for T tokens of one position: the sublayer's input, post and comb against Block.hc_pre's reference
    path (hc_mixes' fp32 GEMM, hc_split_sinkhorn's loop, the weighted sum), fn, scale and base random. D 40 and n 3
    leave the kernels' blocks and n x n tile partly masked; n 2 has 8 mixes in a tile of 16; D 2100 at 37 tokens
    splits K = 8400 into 66 blocks (more than the second kernel adds at once, the last one partial), D into two
    blocks and the tokens into 3, the last ones partial. norm: the input through the sublayer's RMSNorm (a random
    weight) in the kernel, against Block.hc_pre with the norm (D 2100: all of D in one block of 4096). fp32: to 1e-5
    of the largest value (on CUDA the mixes' products are tf32x3's, ~fp32); bf16: the input one rounding apart (the
    same fp32 sum, rounded once; with the norm, two)."""
    g = torch.Generator().manual_seed(D)
    args = replace(TINY, hc_mult=n, hidden_size=D)
    block = Block(0, args).to(DEV)
    R = (2 + n) * n
    fn = (torch.randn(R, n * D, generator=g) / (n * D) ** 0.5).to(DEV)
    scale, base = (torch.rand(3, generator=g) + 0.5).to(DEV), (torch.randn(R, generator=g) * 0.5).to(DEV)
    x = torch.randn(T, 1, n, D, generator=g).to(DEV, dtype)
    rms = block.attn_norm if norm else None
    if norm:
        rms.weight.data = (torch.rand(D, generator=g) + 0.5).to(DEV)
    with torch.no_grad():
        got = hc_pre_triton(x, fn, scale, base, args.hc_sinkhorn_iters, args.hc_eps, args.rms_norm_eps,
                            *((rms.weight, rms.eps) if norm else ()))
        ref = block.hc_pre(x, fn, scale, base, rms)  # fast off: the reference
    tol = (1e-5, 1e-5, 1e-5) if dtype == torch.float32 else (2 ** -7 if norm else 2 ** -8, 1e-5, 1e-5)
    for a, b, t, name in zip(got, ref, tol, ("input", "post", "comb")):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert (a.float() - b.float()).abs().max() <= t * b.float().abs().max(), (name, (a - b).abs().max())


@pytest.mark.slow
def test_model_without_grad_on_hc_pre_triton_equals_reference(monkeypatch):
    """A decode-shaped forward without grad (one position, few tokens) takes hc_pre_triton for every sublayer: TINY's
    layers on 5 sequences of one token, fp32, against the same model's reference hc_pre, to 1e-5 of the largest
    logit; a prefill's inputs never take it, few tokens (2 x 10) or many (5 x 60): a branch on their count would make
    the compiled prefill compile again after Engine.warm_up."""
    calls = []
    monkeypatch.setattr(model_dsv4, "has_triton", lambda t: True)
    monkeypatch.setattr(model_dsv4, "hc_pre_triton", lambda *a: calls.append(1) or hc_pre_triton(*a))
    model = randomize_(Transformer(copy.deepcopy(TINY), dtype=torch.float32), TINY.n_routed_experts,
                       TINY.num_experts_per_tok, seed=4).to(DEV)
    for m in model.modules():  # only the blocks' fast flag: the rest stays on the reference
        if isinstance(m, Block):
            m.fast = True
    ids = torch.randint(0, TINY.vocab_size, (5, 1), generator=torch.Generator().manual_seed(5)).to(DEV)
    with torch.no_grad():
        fast = model(ids)
        assert len(calls) == 2 * TINY.num_hidden_layers
        model(ids.repeat(1, 60)[:, :60])  # 300 tokens: over HC_PRE_TOKENS
        model(ids.repeat(1, 10)[:2])  # 20 tokens, under it
        assert len(calls) == 2 * TINY.num_hidden_layers
        monkeypatch.setattr(model_dsv4, "has_triton", lambda t: False)
        ref = model(ids)
    assert (fast - ref).abs().max() <= 1e-5 * ref.abs().max(), ((fast - ref).abs().max(), ref.abs().max())
