"""Pieces of a bench_2b training layer under inductor on a GPU, forward+backward (the indexer: forward), each in its
current form and the alternative tried in session 12, with each one's first call (a cold cache compiles):
  - mHC's Sinkhorn (hc_split_sinkhorn with autograd, 4096 tokens, n=4, 20 iterations): the batched loop against
    an op (one tensor per entry, its backward written out, compiled once on its own; below);
  - a CSA layer's attention (window_attention at 4096 tokens, 16 heads of 512, 1024 compressed entries of which
    512 picked): the softmax over [window | compressed | sink] as one concatenated row (before) against two parts
    sharing one max and one denominator (kernels_torch.window_attention since session 12). Session 22 timed the query
    blocks in 1, 2, 4 and 8 groups, each against the compressed entries its last query sees, with this probe at
    commit 613d108: slower (bench/RESULTS.md), so taken out again;
  - the indexer's score (16 heads of 128 against 1024 entries, ReLU, weighted sum over heads): einsum against a
    product and a sum that inductor can fuse with the ReLU;
  - the attention's output (inverse RoPE on the values' rope slice, then the grouped wo_a): einsum against bmm
    on a transposed view.
python bench/probe_layer.py [sinkhorn] [attention] [indexer] [output] (all four without an argument)"""
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kernels_torch  # noqa: E402
import model_dsv4 as m  # noqa: E402
from probe_timing import timed  # noqa: E402

# Session 12 (2026-12-02, H200, torch 2.11.0+cu130, bench/calls/gpu_session12.sh) kept the two-part softmax and the
# fused indexer score, and left the Sinkhorn op (2.1x slower and 134 s of compile) and the bmm output (1.2x slower).


BACKEND = os.environ.get("PROBE_BACKEND", "inductor")  # aot_eager: the CPU smoke test
sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)


def first_call(fn):
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


# ---- the op tried for mHC's Sinkhorn (kernels_torch.py in session 12's first try; measured slower, not kept) ----
# hc_split_sinkhorn's loop with each of the n x n entries as its own tensor (c[i][j]: row i,
# column j) and each row or column sum written as additions: pointwise work only, which inductor fuses into one
# kernel, where the batched loop's 2 * iters small reductions compile to some 40 kernels of ~1 µs each, and their
# backward to some 80 (on an H200: most of the kernels of a decode step, and ~3,000 of a bench_2b training step's
# ~6,700). Eager, the batched loop is faster. Step k normalises the columns for even k, the rows for odd k.

def _entries(t):  # [..., n, n] -> c[i][j]
    return [list(row.unbind(-1)) for row in t.unbind(-2)]


def _join(c):  # c[i][j] -> [..., n, n]
    return torch.stack([torch.stack(row, -1) for row in c], -2)


def _sums(c, cols, eps):  # the column sums (cols) or the row sums of c, plus eps, added in a fixed order
    lines = zip(*c) if cols else c
    return [sum(line[1:], line[0]) + eps for line in lines]


def _each(c, s, cols, op):  # op(c[i][j], s[j]) against column sums, op(c[i][j], s[i]) against row sums
    return [[op(x, s[j] if cols else s[i]) for j, x in enumerate(row)] for i, row in enumerate(c)]


def sinkhorn_entries(comb, iters, eps, steps=None):
    """The forward: comb [..., n, n] -> [..., n, n]. Compiled code without autograd (the engine's decode) calls it
    inline. `steps`, a list, receives each of the 2 * iters - 1 steps' input."""
    c = _entries(comb)
    for k in range(2 * iters - 1):
        if steps is not None:
            steps.append(_join(c))
        c = _each(c, _sums(c, k % 2 == 0, eps), k % 2 == 0, torch.div)
    return _join(c)


def _sinkhorn_forward(comb, iters, eps):
    steps = []
    out = sinkhorn_entries(comb, iters, eps, steps)
    return out, torch.stack(steps, -3)


def _sinkhorn_backward(xs, grad, eps):
    """For a step y = x / s along an axis, s = sum(x) + eps along it: dx = (dy - sum(dy * y)) / s along the same
    axis. xs [..., 2 * iters - 1, n, n]: each step's input; grad [..., n, n] -> [..., n, n]"""
    g = _entries(grad)
    for k in reversed(range(xs.shape[-3])):
        cols, x = k % 2 == 0, _entries(xs[..., k, :, :])
        s = _sums(x, cols, eps)
        y = _each(x, s, cols, torch.div)
        d = _sums([[a * b for a, b in zip(ga, ya)] for ga, ya in zip(g, y)], cols, 0)
        g = _each(_each(g, d, cols, torch.sub), s, cols, torch.div)
    return _join(g)


_compiled = {}


def _run(fn, *args):
    """fn compiled once for all layers and lengths on a GPU (inductor takes minutes over these thousands of
    pointwise ops: inside every layer's graph they would be compiled once per kind of layer and per sublayer),
    eager elsewhere (the CPU tests of compiled layers)."""
    if not args[0].is_cuda:
        return fn(*args)
    if fn not in _compiled:
        _compiled[fn] = torch.compile(fn, dynamic=True, fullgraph=True)
    return _compiled[fn](*args)


@torch.library.custom_op("probe_layer::sinkhorn", mutates_args=())
def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """hc_split_sinkhorn's loop in compiled training: comb [..., n, n] -> (the result, each step's input
    [..., 2 * iters - 1, n, n] for the backward: 40 KB per token at n=4, 20 iterations). An op of its own, opaque
    to the compiled layers, so that its compiled code is shared by all of them."""
    return _run(_sinkhorn_forward, comb, iters, eps)


@torch.library.custom_op("probe_layer::sinkhorn_backward", mutates_args=())
def sinkhorn_backward(xs: torch.Tensor, grad: torch.Tensor, eps: float) -> torch.Tensor:
    return _run(_sinkhorn_backward, xs, grad, eps)


@sinkhorn.register_fake
def _(comb, iters, eps):
    return torch.empty_like(comb), comb.new_empty(*comb.shape[:-2], 2 * iters - 1, *comb.shape[-2:])


@sinkhorn_backward.register_fake
def _(xs, grad, eps):
    return torch.empty_like(grad)


def _sinkhorn_setup(ctx, inputs, output):
    ctx.eps = inputs[2]
    ctx.save_for_backward(output[1])


sinkhorn.register_autograd(lambda ctx, grad, _: (sinkhorn_backward(ctx.saved_tensors[0], grad, ctx.eps), None, None),
                           setup_context=_sinkhorn_setup)


def concat_softmax_attention(q, kv, ckv, cmask, sink, scale, window):
    """kernels_torch.window_attention as it was before session 12 (T a multiple of the window): the softmax over one row
    of [window logits | compressed logits | sink], concatenated."""
    B, T, H, d = q.shape
    w, dt = window, kv.dtype
    nb = T // w
    qb = q.reshape(B * nb, w * H, d)
    kvp = F.pad(kv, (0, 0, w, 0))
    keys = torch.cat([kvp[:, :-w].reshape(B, nb, w, d), kvp[:, w:].reshape(B, nb, w, d)], dim=2).flatten(0, 1)
    logits = kernels_torch.matmul_f32(qb, keys.transpose(1, 2)).view(B * nb, w, H, 2 * w) * scale
    t = torch.arange(nb * w, device=q.device).view(nb, w, 1)
    j = (t - t % w - w) + torch.arange(2 * w, device=q.device)
    band = ((j <= t) & (j > t - w) & (j >= 0)).view(1, nb, w, 1, 2 * w)
    logits = logits.view(B, nb, w, H, 2 * w).masked_fill(~band, float("-inf")).view(B * nb, w, H, 2 * w)
    clog = kernels_torch.matmul_f32(q.reshape(B, T * H, d), ckv.transpose(1, 2)).view(B, T, H, -1) * scale
    clog = clog.masked_fill(~cmask[:, :, None], float("-inf")).view(B * nb, w, H, -1)
    sinks = sink.float().view(1, 1, H, 1).expand(B * nb, w, H, 1)
    probs = torch.cat([logits, clog, sinks], dim=-1).softmax(dim=-1).to(dt)
    out = (probs[..., :2 * w].reshape(B * nb, w * H, 2 * w) @ keys).view(B, T, H, d)
    return out + (probs[..., 2 * w:-1].reshape(B, T * H, -1) @ ckv).view(B, T, H, d)


def main(parts=("sinkhorn", "attention", "indexer", "output")):
    dev, bf = "cuda" if torch.cuda.is_available() else "cpu", torch.bfloat16  # the CPU: a smoke test, 1/16 size
    T = 4096 if dev == "cuda" else 256
    g = torch.Generator(device=dev).manual_seed(0)
    # Sinkhorn
    n, iters = 4, 20
    mixes = torch.randn(1, T, (2 + n) * n, device=dev, generator=g).requires_grad_()
    scale, base = torch.rand(3, device=dev, generator=g), torch.randn((2 + n) * n, device=dev, generator=g)
    wt = torch.randn(1, T, n, n, device=dev, generator=g)

    def loop(mx):  # the batched loop, as eager code runs it
        pre, post, comb = mx.split([n, n, n * n], dim=-1)
        comb = (comb.unflatten(-1, (n, n)) * scale[2] + base[2 * n:].view(n, n)).softmax(-1) + 1e-6
        comb = comb / (comb.sum(dim=-2, keepdim=True) + 1e-6)
        for _ in range(iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + 1e-6)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + 1e-6)
        return comb

    def entries(mx):
        pre, post, comb = mx.split([n, n, n * n], dim=-1)
        comb = (comb.unflatten(-1, (n, n)) * scale[2] + base[2 * n:].view(n, n)).softmax(-1) + 1e-6
        return sinkhorn(comb, iters, 1e-6)[0]
    ref = None
    for name, f in (("batched loop", loop), ("the op", entries)) if "sinkhorn" in parts else ():
        cf = torch.compile(f, backend=BACKEND)
        step = lambda: torch.autograd.grad((cf(mixes) * wt).sum(), mixes)[0]
        c = first_call(step)
        got = step()
        ref = got if ref is None else ref
        print(f"Sinkhorn {name:16s} fwd+bwd {timed(step):6.3f} ms   first call (compile) {c:5.1f} s   "
              f"grad vs loop {((got - ref).norm() / ref.norm()).item():.1e}", flush=True)
    # a CSA layer's attention
    H, d, S, w = 16, 512, T // 4, 128
    q = torch.randn(1, T, H, d, device=dev, dtype=bf, generator=g).requires_grad_()
    kv = torch.randn(1, T, d, device=dev, dtype=bf, generator=g).requires_grad_()
    ckv = torch.randn(1, S, d, device=dev, dtype=bf, generator=g).requires_grad_()
    sink = torch.randn(H, device=dev, generator=g).requires_grad_()
    visible = torch.arange(S, device=dev)[None] < ((torch.arange(T, device=dev) + 1) // 4)[:, None]
    score = torch.rand(1, T, S, device=dev, generator=g).masked_fill(~visible, -1)
    idx = score.topk(S // 2, dim=-1).indices
    cmask = torch.zeros_like(score, dtype=torch.bool).scatter_(-1, idx, True) & visible
    go = torch.randn(1, T, H, d, device=dev, dtype=bf, generator=g)
    ref = None
    variants = (("concatenated row", concat_softmax_attention), ("two parts", kernels_torch.window_attention))
    for name, f in variants if "attention" in parts else ():
        cf = torch.compile(f, backend=BACKEND)
        step = lambda: torch.autograd.grad((cf(q, kv, ckv, cmask, sink, d ** -0.5, w).float() * go).sum(),
                                           (q, kv, ckv, sink))
        c = first_call(step)
        got = torch.cat([x.float().flatten() for x in step()])
        ref = got if ref is None else ref
        print(f"CSA attention {name:16s} fwd+bwd {timed(step):6.3f} ms   first call (compile) {c:5.1f} s   "
              f"grads vs the row {((got - ref).norm() / ref.norm()).item():.1e}", flush=True)

    # the indexer's score
    qi = torch.randn(1, T, 16, 128, device=dev, dtype=bf, generator=g)
    ki = torch.randn(1, S, 128, device=dev, dtype=bf, generator=g)
    wi = torch.randn(1, T, 16, device=dev, generator=g)

    def einsum_form():
        s = kernels_torch.matmul_f32(qi.flatten(1, 2), ki.transpose(1, 2)).view(1, T, 16, -1).relu()
        return torch.einsum("bths,bth->bts", s, wi)

    def sum_form():
        s = kernels_torch.matmul_f32(qi.flatten(1, 2), ki.transpose(1, 2)).view(1, T, 16, -1).relu()
        return (s * wi[..., None]).sum(2)
    ref = None
    for name, f in (("einsum", einsum_form), ("product and sum", sum_form)) if "indexer" in parts else ():
        cf = torch.compile(f, backend=BACKEND)
        c = first_call(cf)
        got = cf()
        ref = got if ref is None else ref
        print(f"indexer score {name:16s} forward {timed(cf):6.3f} ms   first call (compile) {c:5.1f} s   "
              f"vs einsum {((got - ref).norm() / ref.norm()).item():.1e}", flush=True)
    # the attention's output: inverse RoPE, grouped wo_a
    o = torch.randn(1, T, H, d, device=dev, dtype=bf, generator=g).requires_grad_()
    wo_a = (torch.randn(4 * 512, H * d // 4, device=dev, dtype=bf, generator=g) * 0.02).requires_grad_()
    cos, sin = m.rope_cos_sin(m.ModelArgs(), 0, torch.arange(T, device=dev))
    gu = torch.randn(1, T, 4 * 512, device=dev, dtype=bf, generator=g)

    def out_einsum(o, wo_a):
        o = m.apply_rope(o, cos[:, None], -sin[:, None])
        return torch.einsum("btgi,goi->btgo", o.reshape(1, T, 4, -1), wo_a.view(4, 512, -1)).flatten(2)

    def out_bmm(o, wo_a):
        o = m.apply_rope(o, cos[:, None], -sin[:, None])
        u = torch.bmm(o.reshape(T, 4, -1).transpose(0, 1), wo_a.view(4, 512, -1).transpose(1, 2))  # [g, T, o_rank]
        return u.transpose(0, 1).reshape(1, T, -1)
    ref = None
    for name, f in (("einsum", out_einsum), ("bmm", out_bmm)) if "output" in parts else ():
        cf = torch.compile(f, backend=BACKEND)
        step = lambda: torch.autograd.grad((cf(o, wo_a).float() * gu).sum(), (o, wo_a))
        c = first_call(step)
        got = torch.cat([x.float().flatten() for x in step()])
        ref = got if ref is None else ref
        print(f"attention output {name:13s} fwd+bwd {timed(step):6.3f} ms   first call (compile) {c:5.1f} s   "
              f"grads vs einsum {((got - ref).norm() / ref.norm()).item():.1e}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ("sinkhorn", "attention", "indexer", "output"))
