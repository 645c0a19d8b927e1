"""dsv4_kernels/fast.py's fast paths against the plain references they replace: the block-wise window attention vs
sink_attention with a band mask, grouped GEMM experts vs the per-expert loop, the whole model both ways
(forward and every gradient), and on a GPU the bf16 fp32-result matmul vs an fp32 GEMM."""
import copy

import pytest
import torch

from conftest import SMALL, TINY, randomize_
from dsv4_kernels.fast import grouped_experts, hc_mixes_bf16, linear_f32, matmul_f32, split_bf16, window_attention
from mhc import hc_mixes
from model_dsv4 import Transformer, sink_attention

CUDA = torch.cuda.is_available()


def band_reference(q, kv, ckv, cmask, sink, scale, w):
    T = q.shape[1]
    pos = torch.arange(T)
    mask = ((pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - w))[None]
    if ckv is not None:
        kv, mask = torch.cat([kv, ckv], 1), torch.cat([mask.expand(cmask.shape[0], -1, -1), cmask], -1)
    return sink_attention(q, kv, mask, sink, scale)


@pytest.mark.parametrize("T,S", [(40, 0), (64, 16), (77, 19), (5, 1)])
def test_window_attention_equals_band_mask(T, S):
    """Forward and gradients (q, keys, sinks) equal the reference's, for T a multiple of the window or not."""
    g = torch.Generator().manual_seed(T)
    B, H, d, w = 2, 3, 16, 16
    q, kv, sink = (torch.randn(*s, generator=g, requires_grad=True) for s in ((B, T, H, d), (B, T, d), (H,)))
    ckv = torch.randn(B, S, d, generator=g, requires_grad=True) if S else None
    cmask = torch.rand(B, T, S, generator=g) < 0.5 if S else None
    outs = []
    for fn in (window_attention, band_reference):
        y = fn(q, kv, ckv, cmask, sink, 0.25, w)
        grads = torch.autograd.grad((y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum(),
                                    [t for t in (q, kv, sink, ckv) if t is not None])
        outs.append((y, *grads))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_split_bf16_is_exact_eager_and_compiled():
    """Three bf16 parts sum to the fp32 value exactly, over 40 decades, also under torch.compile (inductor drops a
    fp32 -> bf16 -> fp32 round trip, which would leave a rounded split's later parts zero)."""
    t = torch.randn(4000, generator=torch.Generator().manual_seed(1)) * torch.logspace(-20, 20, 4000)
    for parts in (split_bf16(t), torch.compile(split_bf16)(t)):
        assert all(p.dtype == torch.bfloat16 for p in parts) and (parts[1] != 0).float().mean() > 0.9
        assert torch.equal(parts[0].float() + parts[1].float() + parts[2].float(), t)


@pytest.mark.parametrize("R", [24, 4])
def test_hc_mixes_bf16_as_accurate_as_fp32(R):
    """mHC's mixes from bf16 streams with fn in three bf16 parts, against fp64: the mixes and dfn within 1e-5 of their
    largest value, and on the CPU within 2x the fp32 reference's error (an H200's tensor cores accumulate less
    exactly than its fp32 FFMA GEMM: ~8x the reference's error there); dx (bf16, as the streams) the
    exact value's rounding but for rare one-step flips. On a GPU the GEMMs run on tensor cores, eager and compiled
    by inductor (the training layers' form); on the CPU the same parts in fp32 GEMMs. R = 4 takes the padding to 8
    rows."""
    dev = "cuda" if CUDA else "cpu"
    g = torch.Generator().manual_seed(R)
    x = torch.randn(2, 96, 4, 256, generator=g).mul(3).bfloat16().to(dev).requires_grad_()
    fn = (torch.randn(R, 4 * 256, generator=g) * 0.05).to(dev).requires_grad_()
    dy = torch.randn(2, 96, R, generator=g).to(dev)
    exact = lambda xd, fd: (xd @ fd.T) * torch.rsqrt(xd.square().mean(-1, keepdim=True) + 1e-6)
    outs = {}
    forms = {"fast": lambda: hc_mixes_bf16(x.flatten(2), fn, 1e-6), "ref": lambda: hc_mixes(x, fn, 1e-6),
             "exact": lambda: exact(x.double().flatten(2), fn.double())}
    if CUDA:
        forms["compiled"] = lambda: torch.compile(hc_mixes_bf16)(x.flatten(2), fn, 1e-6)
    for name, f in forms.items():
        y = f()
        outs[name] = (y, *torch.autograd.grad((y * dy).sum(), [x, fn]))
    err = lambda a, b: (a.double() - b).abs().max().item()
    for name in ("fast", "compiled") if CUDA else ("fast",):
        y, dx, dfn = outs[name]
        assert y.dtype == torch.float32 and dx.dtype == torch.bfloat16 and dfn.dtype == torch.float32
        for i in (0, 2):  # the largest error within 1e-5 of the largest value (bf16 streams carry 4e-3), and on the
            e_fast, e_ref = err(outs[name][i], outs["exact"][i]), err(outs["ref"][i], outs["exact"][i])  # CPU, where
            assert e_fast < 1e-5 * outs["exact"][i].abs().max().item(), (name, i, e_fast, e_ref)  # both accumulate
            assert CUDA or e_fast <= 2 * e_ref + 1e-12, (i, e_fast, e_ref)  # as fp32 GEMMs, within 2x the reference's
        # dx is bf16 on all three: the fp32-level differences before its rounding flip a rare element by one bf16 step
        dx0 = outs["exact"][1]
        flips = (dx != dx0).float().mean().item()
        assert flips < 2e-3 and err(dx, dx0) <= 2 ** -7 * dx0.abs().max().item(), (name, flips)


def test_grouped_experts_equal_loop():
    """Groups of 0, 1, odd and larger sizes; fp32 on the CPU, so the two must agree to rounding."""
    model = randomize_(Transformer(copy.deepcopy(SMALL), dtype=torch.float32), SMALL.n_routed_experts,
                       SMALL.num_experts_per_tok)
    moe = model.layers["0"].ffn
    counts = torch.tensor([0, 1, 3, 0, 8, 5, 2, 13])
    g = torch.Generator().manual_seed(0)
    xs = torch.randn(int(counts.sum()), SMALL.hidden_size, generator=g, requires_grad=True)
    ws = torch.rand(xs.shape[0], generator=g)
    limit = 0.5  # low: the clamps are active
    for e in moe.experts.values():
        e.limit = limit
    fast = grouped_experts(list(moe.experts.values()), xs, ws, counts, limit)
    ref, _ = moe.run_experts(xs, ws, counts.tolist())
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-6)
    gw = [e.w1.weight for e in moe.experts.values()]
    ga = torch.autograd.grad(fast.square().sum(), [xs] + gw)
    gb = torch.autograd.grad(ref.square().sum(), [xs] + gw)
    for a, b in zip(ga, gb):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("args,T", [(TINY, 100), (SMALL, 300)], ids=["tiny", "small"])
def test_model_fast_equals_reference(args, T):
    """The whole model with set_kernels(True) vs (False): logits and every parameter's gradient, fp32."""
    ref = randomize_(Transformer(copy.deepcopy(args), dtype=torch.float32), args.n_routed_experts,
                     args.num_experts_per_tok, seed=4)
    fast = copy.deepcopy(ref).set_kernels(True)
    ids = torch.randint(0, args.vocab_size, (2, T), generator=torch.Generator().manual_seed(5))
    out = []
    for m in (fast, ref):
        logits = m(ids)
        logits.log_softmax(-1)[..., 0].sum().backward()
        out.append((logits, {n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
    # logits relative to the largest one (~4.8): 1.6e-5 apart at most on the H200 host's CPU, 1.0e-5 on the dev box
    # (the softmax in two parts; 0.7e-5 with the concatenated row), fp32 rounding carried through 8 layers
    assert (out[0][0] - out[1][0]).abs().max() <= 1e-5 * out[1][0].abs().max()
    assert out[0][1].keys() == out[1][1].keys()
    for n, a in out[0][1].items():  # relative to the tensor's largest entry: sums of many terms cancel (the
        b = out[1][1][n]            # hc scales' gradients sum over every token: 1.1e-5 seen on the H200 host's CPU)
        assert (a - b).abs().max() <= 5e-5 * b.abs().max(), n


def test_matmul_f32_gradient_comes_in_the_operand_layout():
    """matmul_f32's backward (its GPU path, called directly: the CPU has no bf16 GEMM with an fp32 result): the
    gradients are g @ b.T and a.T @ g, b's in b's memory layout, so linear_f32's weight (b = w.t()) gets a
    contiguous gradient, which needs no copy into the parameter's layout."""
    from types import SimpleNamespace
    from dsv4_kernels.fast import _MatmulF32
    g = torch.Generator().manual_seed(0)
    for a, w, dy in (((6, 5), (4, 5), (6, 4)), ((3, 6, 5), (3, 4, 5), (3, 6, 4))):
        a, w, dy = (torch.randn(*s, generator=g) for s in (a, w, dy))
        for b in (w.transpose(-1, -2), w.transpose(-1, -2).contiguous()):
            ga, gb = _MatmulF32.backward(SimpleNamespace(saved_tensors=(a, b)), dy)
            torch.testing.assert_close(ga, dy @ b.transpose(-1, -2))
            torch.testing.assert_close(gb, a.transpose(-1, -2) @ dy)
            assert gb.stride() == b.stride()


@pytest.mark.skipif(not CUDA, reason="bf16 tensor-core GEMM with an fp32 result: CUDA only")
def test_matmul_f32_on_gpu():
    """bf16 operands, fp32 result: equals the fp32 GEMM of the same (bf16) values to fp32 rounding."""
    a = torch.randn(3, 256, 512, device="cuda").bfloat16().requires_grad_()
    b = torch.randn(3, 512, 128, device="cuda").bfloat16().requires_grad_()
    y = matmul_f32(a, b)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, a.float() @ b.float(), rtol=1e-5, atol=1e-4)
    ga, gb = torch.autograd.grad(y.sum(), [a, b])
    torch.testing.assert_close(ga.float(), (torch.ones_like(y) @ b.float().transpose(1, 2)), rtol=1e-2, atol=1e-2)
    w = torch.randn(64, 512, device="cuda").bfloat16().requires_grad_()  # linear_f32: b = w.t()
    x = a[0].detach()
    gw, = torch.autograd.grad(linear_f32(x, w).square().sum(), [w])
    assert gw.is_contiguous()
    ref = 2 * (x.float() @ w.float().t()).t() @ x.float()  # its gradient rounded to bf16 (2^-9): ~0.3% of the norm
    assert (gw.float() - ref).norm() <= 1e-2 * ref.norm()


@pytest.mark.skipif(not CUDA, reason="the bf16 fast path on a GPU")
def test_model_fast_bf16_as_accurate_as_reference_gpu():
    """On the GPU in bf16 the two paths round differently: the fast one must be as close to the fp32 model as the
    reference is (mean |Δ logprob| over the vocabulary, within 1.5x)."""
    m32 = randomize_(Transformer(copy.deepcopy(SMALL), dtype=torch.float32), SMALL.n_routed_experts,
                     SMALL.num_experts_per_tok, seed=4).cuda()
    ref = copy.deepcopy(m32).set_dtype(torch.bfloat16)
    fast = copy.deepcopy(ref).set_kernels(True)
    ids = torch.randint(0, SMALL.vocab_size, (2, 300), device="cuda")
    with torch.no_grad():
        exact = m32(ids).log_softmax(-1)
        err_ref, err_fast = ((m(ids).log_softmax(-1) - exact).abs().mean().item() for m in (ref, fast))
    assert err_fast <= 1.5 * err_ref + 1e-4, (err_fast, err_ref)
