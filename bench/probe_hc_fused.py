"""hc_pre's forward (model_dsv4.Block.hc_pre) as one Triton kernel, against the compiled model code it would replace,
at bench_2b's sizes (4096 tokens, n = 4 streams of 1536, bf16): a candidate for the next step of the speed issue,
measured before any of it goes into the model. What the compiled code runs for a sublayer's hc_pre: the mixes' GEMM
(bf16 tensor cores, fn in three exact bf16 parts), a separate reduction over each token's n * D values for the
norm, the pre / post / comb activations, the Triton Sinkhorn, and the weighted sum of the streams: the streams are
read three times. Here one program takes BT tokens: a loop over their n * D values feeds the nine small dots (three
parts of fn x three groups of rows: pre, post, comb, each padded to 16 rows) and the sum of squares at once; the
activations and Sinkhorn run in registers; a second loop over D forms the weighted sum (the same rows again, from
L2 when they fit). The backward is torch code (hc_pre_op's _backward: compiled with the rest of a compiled caller's
backward), the same formulas autograd derives for the model's hc_pre, with kernels_torch.hc_mixes_grads and the Triton
Sinkhorn's backward; or (DX_KERNEL) with dx written by a second Triton kernel, _hc_pre_dx, which forms dz @ fn in
registers where the compiled code writes it out as an fp32 [T, n * D] tensor (100 MB here) and reads it back.
A third kernel, _hc_post_bwd, takes Block.hc_post's backward in one pass over dy, f and x (HcPost: the compiled
forward as in the model, this backward).
python bench/probe_hc_fused.py   prints the values and gradients against Block.hc_pre; on a GPU then the forward
alone (also at a decode step's 64 tokens) and a sublayer's forward+backward (hc_pre, the identity, hc_post), each
compiled: the model's code, the fused forward, the fused forward with the dx kernel, and that with hc_post's one-pass
backward.
(On a CPU: Triton's interpreter, PROBE_TOKENS=32, the checks only.)
Written in session 14 without a GPU. Run on the H200 in session 15 (bench/RESULTS.md): each kernel 3-10x slower than
the inductor code it would replace (the forward 250 us against 56, at 64 tokens 166 against 16; the dx kernel 205
against 71; hc_post's backward 245 against 57 + 28), so none went into the model. On the dev CPU (Triton 3.9.0's interpreter) post and comb
match Block.hc_pre to 2.6e-7 and 4.8e-7 of their largest values; h is within 7.6e-3 of the fp32 sum's scale where
the model's h is within 3.9e-3 (one bf16 rounding), because the interpreter cuts fp32 to bf16 instead of rounding
(a kernel that only converts shows 7.5e-3). Given the same gradients of (h, post, comb), dfn, dscale and dbase
match the model's to 1.7e-7, 7.7e-7 and 2.5e-7, dx to 4.6e-3 (bf16), with or without the dx kernel (its norm
term's sign flipped: 1.1e-2). hc_post's one-pass backward against autograd's: dpost and dcomb to 1.4e-7 and
1.7e-7, df and dx to 6.0e-3 and 5.1e-3 (bf16; dcomb transposed: 1.2). The interpreter also gets dots of bf16
operands wrong, so the dots take fp32 ones. The three kernels compile for sm_90 and gfx950 (as tests/test_triton.py
checks its kernels); under torch.compile (aot_eager, fullgraph) a sublayer's values and gradients equal eager's
(dx to 1.8e-4 with the dx kernel, exactly with hc_post's backward too)."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import model_dsv4 as m  # noqa: E402  (before triton: with no GPU, kernels_triton.py switches Triton to its interpreter)
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
import kernels_torch  # noqa: E402
from kernels_torch import split_bf16  # noqa: E402
from kernels_triton import _sinkhorn_triton_backward, _sums  # noqa: E402
from probe_mhc import measure, mhc_inputs  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
T = int(os.environ.get("PROBE_TOKENS", 4096 if CUDA else 32))


@triton.jit
def _hc_pre_fwd(x_ptr, f_ptr, scale_ptr, base_ptr, h_ptr, post_ptr, comb_ptr, a_ptr, r_ptr, n_tok, eps_norm, eps_hc,
                D: tl.constexpr, N: tl.constexpr, STEPS: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                BD: tl.constexpr):
    """x [T, N * D] bf16; f [3 parts, 3 groups, 16, N * D] bf16 (group 0: fn's pre rows, 1: post, 2: comb, each
    padded with zero rows to 16); writes h [T, D] bf16, post [T, N] and comb [T, N, N] fp32, and for the backward
    the mixes a [T, (2 + N) * N] and the norm's r [T] (fp32). N = 4."""
    K: tl.constexpr = N * D
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    tm = t < n_tok
    k, r16 = tl.arange(0, BK), tl.arange(0, 16)
    a_pre = tl.zeros((BT, 16), tl.float32)
    a_post = tl.zeros((BT, 16), tl.float32)
    a_comb = tl.zeros((BT, 16), tl.float32)
    ss = tl.zeros((BT,), tl.float32)
    for k0 in range(0, K, BK):
        xf = tl.load(x_ptr + t[:, None] * K + k0 + k[None, :], mask=tm[:, None], other=0.0).to(tl.float32)  # [BT, BK]
        ss += tl.sum(xf * xf, 1)
        for part in tl.static_range(3):  # fn's rows, transposed: [BK, 16] of each group. The dots take fp32
            rows = f_ptr + part * 3 * 16 * K + r16[None, :] * K + k0 + k[:, None]  # operands (TF32 on a GPU, exact
            a_pre = tl.dot(xf, tl.load(rows).to(tl.float32), a_pre)  # for bf16 values): Triton's interpreter gets
            a_post = tl.dot(xf, tl.load(rows + 16 * K).to(tl.float32), a_post)  # bf16 dots wrong (3.9.0)
            a_comb = tl.dot(xf, tl.load(rows + 2 * 16 * K).to(tl.float32), a_comb)
    r = tl.rsqrt(ss / K + eps_norm)[:, None]
    tl.store(r_ptr + t[:, None], r, mask=tm[:, None])
    row, R = a_ptr + t[:, None] * (2 + N) * N + r16[None, :], (2 + N) * N
    tl.store(row, a_pre * r, mask=tm[:, None] & (r16[None, :] < N))
    tl.store(row + N, a_post * r, mask=tm[:, None] & (r16[None, :] < N))
    tl.store(row + 2 * N, a_comb * r, mask=tm[:, None] & (r16[None, :] < R - 2 * N))
    s0, s1, s2 = tl.load(scale_ptr), tl.load(scale_ptr + 1), tl.load(scale_ptr + 2)
    b_pre = tl.load(base_ptr + r16, mask=r16 < N, other=0.0)
    b_post = tl.load(base_ptr + N + r16, mask=r16 < N, other=0.0)
    b_comb = tl.load(base_ptr + 2 * N + r16)
    pre = tl.sigmoid(a_pre * r * s0 + b_pre[None, :]) + eps_hc  # [BT, 16], columns < N
    post = 2 * tl.sigmoid(a_post * r * s1 + b_post[None, :])
    tl.store(post_ptr + t[:, None] * N + r16[None, :], post, mask=tm[:, None] & (r16[None, :] < N))
    c = tl.reshape(a_comb * r * s2 + b_comb[None, :], (BT, N, N))  # softmax over each row, + eps, then Sinkhorn
    c = tl.exp(c - tl.max(c, 2)[:, :, None])
    c = c / tl.sum(c, 2)[:, :, None] + eps_hc
    for s in tl.static_range(STEPS):
        c = c / (_sums(c, s) + eps_hc)
    i = tl.arange(0, N)
    tl.store(comb_ptr + t[:, None, None] * N * N + i[None, :, None] * N + i[None, None, :], c, mask=tm[:, None, None])
    pre = tl.sum(tl.where(i[None, :, None] == 0, tl.reshape(pre, (BT, N, N)), 0.0), 1)  # [BT, N]: columns 0..N-1
    dd = tl.arange(0, BD)
    for d0 in range(0, D, BD):  # h = sum_i pre_i x_i
        x3 = tl.load(x_ptr + t[:, None, None] * K + i[None, :, None] * D + d0 + dd[None, None, :],
                     mask=tm[:, None, None], other=0.0)
        h = tl.sum(pre[:, :, None] * x3.to(tl.float32), 1)
        tl.store(h_ptr + t[:, None] * D + d0 + dd[None, :], h.to(tl.bfloat16), mask=tm[:, None])


def fn_groups(fn, n):
    """fn fp32 [(2 + n) * n, n * D] -> [3 parts, 3 groups, 16, n * D] bf16, as _hc_pre_fwd reads it."""
    K = fn.shape[1]
    out = torch.zeros(3, 3, 16, K, dtype=torch.bfloat16, device=fn.device)
    for p, part in enumerate(split_bf16(fn)):
        out[p, 0, :n], out[p, 1, :n], out[p, 2, :n * n] = part[:n], part[n:2 * n], part[2 * n:]
    return out


@torch.library.custom_op("probe_hc::hc_pre", mutates_args=())
def hc_pre_op(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, eps_norm: float,
              eps_hc: float, iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block.hc_pre as one kernel: x [B, T, n, D] bf16 -> (h [B, T, D] bf16, post [B, T, n], comb [B, T, n, n], and
    for the backward the mixes [B, T, (2 + n) * n] and r [B, T])."""
    B, T, n, D = x.shape
    h = torch.empty(B, T, D, dtype=x.dtype, device=x.device)
    post, comb = torch.empty(B, T, n, device=x.device), torch.empty(B, T, n, n, device=x.device)
    a, r = torch.empty(B, T, (2 + n) * n, device=x.device), torch.empty(B, T, device=x.device)
    BT, BK, BD = 16, 64, 128
    assert D % BD == 0 and BD % BK == 0, f"hidden_size ({D}) must divide by {BD}"  # the loops have no masks along D
    _hc_pre_fwd[(triton.cdiv(B * T, BT),)](x.contiguous(), fn_groups(fn, n), scale, base, h, post, comb, a, r, B * T,
                                           eps_norm, eps_hc, D=D, N=n, STEPS=2 * iters - 1, BT=BT, BK=BK, BD=BD)
    return h, post, comb, a, r


@hc_pre_op.register_fake
def _(x, fn, scale, base, eps_norm, eps_hc, iters):
    B, T, n, D = x.shape
    f32 = lambda *shape: x.new_empty(*shape, dtype=torch.float32)
    return x.new_empty(B, T, D), f32(B, T, n), f32(B, T, n, n), f32(B, T, (2 + n) * n), f32(B, T)


@triton.jit
def _hc_pre_dx(x_ptr, dh_ptr, pre_ptr, c_ptr, g_ptr, f_ptr, dx_ptr, n_tok, D: tl.constexpr, N: tl.constexpr,
               BT: tl.constexpr, BK: tl.constexpr):
    """hc_pre's dx in one pass: dx = pre_i dh (for stream i) + dz @ fn - c x, with dz [T, 32] in three bf16 parts
    g [3, T, 32] and fn in three, f [3, 32, N * D] (all nine products: fp32 accuracy), c [T] the norm's term.
    The compiled torch code writes dz @ fn out as an fp32 [T, N * D] tensor and reads it back."""
    K: tl.constexpr = N * D
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    tm = t < n_tok
    k, r32 = tl.arange(0, BK), tl.arange(0, 32)
    g = g_ptr + t[:, None] * 32 + r32[None, :]
    g0 = tl.load(g, mask=tm[:, None], other=0.0).to(tl.float32)  # fp32 operands: see _hc_pre_fwd's dots
    g1 = tl.load(g + n_tok * 32, mask=tm[:, None], other=0.0).to(tl.float32)
    g2 = tl.load(g + 2 * n_tok * 32, mask=tm[:, None], other=0.0).to(tl.float32)
    c = tl.load(c_ptr + t, mask=tm, other=0.0)[:, None]
    for k0 in range(0, K, BK):
        i = k0 // D  # the stream of this chunk (BK divides D)
        x = tl.load(x_ptr + t[:, None] * K + k0 + k[None, :], mask=tm[:, None], other=0.0).to(tl.float32)
        dh = tl.load(dh_ptr + t[:, None] * D + k0 - i * D + k[None, :], mask=tm[:, None], other=0.0).to(tl.float32)
        acc = tl.load(pre_ptr + t * N + i, mask=tm, other=0.0)[:, None] * dh - c * x
        for q in tl.static_range(3):
            fq = tl.load(f_ptr + q * 32 * K + r32[:, None] * K + k0 + k[None, :]).to(tl.float32)  # [32, BK]
            acc = tl.dot(g2, fq, tl.dot(g1, fq, tl.dot(g0, fq, acc)))
        tl.store(dx_ptr + t[:, None] * K + k0 + k[None, :], acc.to(tl.bfloat16), mask=tm[:, None])


@torch.library.custom_op("probe_hc::hc_pre_dx", mutates_args=())
def hc_pre_dx_op(x: torch.Tensor, dh: torch.Tensor, pre: torch.Tensor, c: torch.Tensor, g: torch.Tensor,
                 f: torch.Tensor) -> torch.Tensor:
    """x [M, n * D] bf16, dh [M, D], pre [M, n], c [M], g [3, M, 32], f [3, 32, n * D] -> dx [M, n * D] bf16."""
    M, n, D = x.shape[0], pre.shape[1], dh.shape[1]
    dx = torch.empty_like(x)
    BT, BK = 16, 64
    assert D % BK == 0, f"hidden_size ({D}) must divide by {BK}"
    _hc_pre_dx[(triton.cdiv(M, BT),)](x, dh.contiguous(), pre.contiguous(), c.contiguous(), g.contiguous(),
                                      f.contiguous(), dx, M, D=D, N=n, BT=BT, BK=BK)
    return dx


hc_pre_dx_op.register_fake(lambda x, *rest: torch.empty_like(x))
DX_KERNEL = False  # the backward's dx: _hc_pre_dx (True) or the torch code of kernels_torch.hc_mixes_grads (False)


def _setup(ctx, inputs, output):
    x, fn, scale, base, ctx.eps_norm, ctx.eps_hc, ctx.iters = inputs
    ctx.save_for_backward(x, fn, scale, base, output[3], output[4])


def _backward(ctx, dh, dpost, dcomb, _da, _dr):
    """Torch code (compiled with the rest of a compiled caller's backward): through pre / post / the softmax and
    Sinkhorn (kernels_torch.py's Triton backward) to the mixes, then kernels_torch.hc_mixes_grads, plus pre's part of
    dx."""
    x, fn, scale, base, a, r = ctx.saved_tensors
    B, T, n, D = x.shape
    xs, a, r = x.reshape(-1, n, D), a.reshape(-1, (2 + n) * n), r.reshape(-1, 1)
    dh16, dpost, dcomb = dh.reshape(-1, D), dpost.reshape(-1, n), dcomb.reshape(-1, n, n)
    dh = dh16.float()
    s = torch.cat([scale[0].expand(n), scale[1].expand(n), scale[2].expand(n * n)])  # each mix's scale
    u = a * s + base
    sig_pre, sig_post = torch.sigmoid(u[:, :n]), torch.sigmoid(u[:, n:2 * n])
    p = u[:, 2 * n:].view(-1, n, n).softmax(-1)
    du_pre = (dh[:, None, :] * xs.float()).sum(-1) * sig_pre * (1 - sig_pre)
    du_post = dpost * 2 * sig_post * (1 - sig_post)
    dp = _sinkhorn_triton_backward(p + ctx.eps_hc, dcomb.contiguous(), ctx.iters, ctx.eps_hc)
    du = torch.cat([du_pre, du_post, (p * (dp - (dp * p).sum(-1, keepdim=True))).flatten(1)], 1)
    dscale = torch.stack([(du * a)[:, :n].sum(), (du * a)[:, n:2 * n].sum(), (du * a)[:, 2 * n:].sum()])
    pre = sig_pre + ctx.eps_hc
    if DX_KERNEL:  # what hc_mixes_grads does, with dz @ fn inside the kernel that writes dx
        R = fn.shape[0]
        g = torch.stack(split_bf16(torch.nn.functional.pad(du * s * r, (0, 32 - R))))  # [3, M, 32]
        f = torch.stack(split_bf16(torch.nn.functional.pad(fn, (0, 0, 0, 32 - R))))  # [3, 32, K]
        c = (du * s * a).sum(-1) * r[:, 0] ** 2 / (n * D)
        dx = hc_pre_dx_op(x.reshape(-1, n * D), dh16, pre, c, g, f)
        dfn = kernels_torch.mm_f32(g.transpose(1, 2).reshape(-1, g.shape[1]), x.reshape(-1, n * D)).view(3, 32, -1)
        return dx.view(x.shape), dfn.sum(0)[:R], dscale, du.sum(0), None, None, None
    R, Rp = fn.shape[0], fn.shape[0] + -fn.shape[0] % 8
    f = torch.cat(split_bf16(torch.nn.functional.pad(fn, (0, 0, 0, Rp - R))))  # as _HcMixes keeps it
    dx, dfn = kernels_torch.hc_mixes_grads(x.reshape(-1, n * D), f, a / r, r, du * s)
    dx = dx.view(-1, n, D) + pre[:, :, None] * dh[:, None, :]
    return dx.to(x.dtype).view(x.shape), dfn, dscale, du.sum(0), None, None, None


hc_pre_op.register_autograd(_backward, setup_context=_setup)


# ----------------------------------------------------------------------------- hc_post's backward in one pass

@triton.jit
def _hc_post_bwd(dy_ptr, f_ptr, x_ptr, post_ptr, comb_ptr, df_ptr, dx_ptr, dpost_ptr, dcomb_ptr, n_tok,
                 D: tl.constexpr, N: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    """Block.hc_post, y_k = post_k f + sum_j comb_jk x_j, backward in one pass over dy, f and x (dy, x [T, N, D] and
    f [T, D] bf16; post [T, N], comb [T, N, N] fp32): df = sum_k post_k dy_k and dx_j = sum_k comb_jk dy_k written
    as it goes, dpost_k = <dy_k, f> and dcomb_jk = <x_j, dy_k> summed over D in registers."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    tm = t < n_tok
    i, dd = tl.arange(0, N), tl.arange(0, BD)
    post = tl.load(post_ptr + t[:, None] * N + i[None, :], mask=tm[:, None], other=0.0)  # [BT, N]
    nn = t[:, None, None] * N * N + i[None, :, None] * N + i[None, None, :]
    comb = tl.load(comb_ptr + nn, mask=tm[:, None, None], other=0.0)  # [BT, N (j), N (k)]
    dpost = tl.zeros((BT, N), tl.float32)
    dcomb = tl.zeros((BT, N, N), tl.float32)
    for d0 in range(0, D, BD):
        nd = t[:, None, None] * N * D + i[None, :, None] * D + d0 + dd[None, None, :]  # [BT, N, BD]
        dy = tl.load(dy_ptr + nd, mask=tm[:, None, None], other=0.0).to(tl.float32)
        x = tl.load(x_ptr + nd, mask=tm[:, None, None], other=0.0).to(tl.float32)
        f = tl.load(f_ptr + t[:, None] * D + d0 + dd[None, :], mask=tm[:, None], other=0.0).to(tl.float32)
        tl.store(df_ptr + t[:, None] * D + d0 + dd[None, :], tl.sum(post[:, :, None] * dy, 1).to(tl.bfloat16),
                 mask=tm[:, None])
        dx = tl.sum(comb[:, :, :, None] * dy[:, None, :, :], 2)  # [BT, N (j), BD]: the sum over k
        tl.store(dx_ptr + nd, dx.to(tl.bfloat16), mask=tm[:, None, None])
        dpost += tl.sum(dy * f[:, None, :], 2)
        dcomb += tl.sum(x[:, :, None, :] * dy[:, None, :, :], 3)
    tl.store(dpost_ptr + t[:, None] * N + i[None, :], dpost, mask=tm[:, None])
    tl.store(dcomb_ptr + nn, dcomb, mask=tm[:, None, None])


@torch.library.custom_op("probe_hc::hc_post_backward", mutates_args=())
def hc_post_backward_op(dy: torch.Tensor, f: torch.Tensor, x: torch.Tensor, post: torch.Tensor,
                        comb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (df, dx, dpost, dcomb), each shaped as its tensor."""
    n, D = x.shape[-2:]
    M = x.numel() // (n * D)
    df, dx, dpost, dcomb = (torch.empty_like(t) for t in (f, x, post, comb))
    BT, BD = 4, 128
    assert D % BD == 0, f"hidden_size ({D}) must divide by {BD}"
    _hc_post_bwd[(triton.cdiv(M, BT),)](dy.contiguous(), f.contiguous(), x.contiguous(), post.contiguous(),
                                        comb.contiguous(), df, dx, dpost, dcomb, M, D=D, N=n, BT=BT, BD=BD)
    return df, dx, dpost, dcomb


hc_post_backward_op.register_fake(lambda dy, f, x, post, comb: tuple(torch.empty_like(t) for t in (f, x, post, comb)))


class HcPost(torch.autograd.Function):
    """Block.hc_post (its compiled form: the sum over streams as additions, which inductor fuses) with the backward
    above."""
    @staticmethod
    def forward(ctx, f, x, post, comb):
        ctx.save_for_backward(f, x, post, comb)
        y = post.unsqueeze(-1) * f.float().unsqueeze(-2)
        for j in range(x.shape[-2]):
            y = y + comb[..., j, :].unsqueeze(-1) * x[..., j, None, :].float()
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        return hc_post_backward_op(dy, *ctx.saved_tensors)


def rel(a, b):
    """Largest difference over largest value."""
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def hc_pre_fused(block, x, fn, scale, base):
    """Block.hc_pre's signature and results."""
    a = block.args
    return hc_pre_op(x, fn, scale, base, a.rms_norm_eps, a.hc_eps, a.hc_sinkhorn_iters)[:3]


if __name__ == "__main__":
    block, fn, scale, base, x, dy, g = mhc_inputs(T)
    block.fast, args = True, block.args
    n, D = args.hc_mult, args.hidden_size
    print(f"{torch.cuda.get_device_name() if CUDA else 'cpu'}, torch {torch.__version__}, triton {triton.__version__},"
          f" {T} tokens")
    with torch.no_grad():
        ref = block.hc_pre(x, fn, scale, base)  # eager, the fast kernels on (on a CPU: the Sinkhorn loop)
        got = hc_pre_fused(block, x, fn, scale, base)
        for name, a, b in zip(("h", "post", "comb"), got, ref):
            print(f"  fused against Block.hc_pre: {name} {rel(a, b):.1e} of its largest value")
        pre = m.hc_split_sinkhorn(m.hc_mixes(x, fn, args.rms_norm_eps), scale, base, n, args.hc_sinkhorn_iters,
                                  args.hc_eps)[0]
        h32, size = ((pre.unsqueeze(-1) * t).sum(2) for t in (x.float(), x.float().abs()))  # h before its rounding
        print("  h against the fp32 sum, largest error over the sum of its terms' sizes (one bf16 rounding: 3.9e-3 at"
              " most): fused " + " and model ".join(f"{((a.float() - h32).abs() / size).max():.1e}"
                                                      for a in (got[0], ref[0])))

    fused = lambda *t: hc_pre_fused(block, *t)
    forms = (("model", block.hc_pre, False), ("fused", fused, False), ("fused, dx kernel", fused, True))
    outs, back = {}, {}
    for name, pre_of, dx_kernel in forms:  # the same gradients of (h, post, comb) back through each
        DX_KERNEL = dx_kernel
        outs[name] = pre_of(x, fn, scale, base)
        if name == "model":
            douts = [torch.randn(t.shape, device=DEV, generator=g).to(t.dtype) for t in outs[name]]
        back[name] = torch.autograd.grad(outs[name], [x, fn, scale, base], douts)
        if name != "model":
            print(f"  the same gradients of (h, post, comb) back through hc_pre, {name} against model, largest "
                  "difference over largest value: dx, dfn, dscale, dbase "
                  + " ".join(f"{rel(a, b):.1e}" for a, b in zip(back[name], back["model"])))

    # hc_post alone: the one-pass backward against autograd's, for the same dy
    f_in = torch.randn(1, T, D, device=DEV, generator=g).bfloat16().requires_grad_()
    post_in = (torch.rand(1, T, n, device=DEV, generator=g) * 2).requires_grad_()
    comb_in = torch.rand(1, T, n, n, device=DEV, generator=g).requires_grad_()
    ins = [f_in, x, post_in, comb_in]
    want = torch.autograd.grad(block.hc_post(*ins), ins, dy)
    have = torch.autograd.grad(HcPost.apply(*ins), ins, dy)
    print("  hc_post's backward in one pass against autograd's, largest difference over largest value: df, dx, dpost,"
          " dcomb " + " ".join(f"{rel(a, b):.1e}" for a, b in zip(have, want)))

    def sublayer(x, fn, scale, base, pre_of, post_of):  # hc_pre, the identity as the sublayer, hc_post
        h, post, comb = pre_of(x, fn, scale, base)
        return post_of(h, x, post, comb)
    forms = [(name, pre_of, dx_kernel, block.hc_post) for name, pre_of, dx_kernel in forms]
    forms.append(("fused, dx kernel, hc_post backward in one pass", fused, True, HcPost.apply))
    grads = {}
    for name, pre_of, dx_kernel, post_of in forms:  # eager: the gradients
        DX_KERNEL = dx_kernel
        y = sublayer(x, fn, scale, base, pre_of, post_of)
        grads[name] = (y, *torch.autograd.grad(y, [x, fn, scale, base], dy))
        if name != "model":
            print(f"  sublayer, {name} against model, largest difference over largest value: out, dx, dfn, dscale, "
                  "dbase " + " ".join(f"{rel(a, b):.1e}" for a, b in zip(grads[name], grads["model"])))
    if CUDA:
        for name, pre_of, _, _ in forms[:2]:  # at training's token count, and at a decode step's (batch 64)
            with torch.no_grad():
                for xt in (x, x[:, :64].contiguous()):
                    torch._dynamo.reset()
                    f = torch.compile(lambda x, pre_of=pre_of: pre_of(x, fn, scale, base))
                    measure(f"hc_pre forward, {xt.shape[1]} tokens, {name}, compiled", lambda: f(xt), top=8)
        for name, pre_of, dx_kernel, post_of in forms:
            torch._dynamo.reset()
            DX_KERNEL = dx_kernel  # read when the backward is traced, at the first call
            f = torch.compile(lambda x, fn, scale, base, pre_of=pre_of, post_of=post_of:
                              sublayer(x, fn, scale, base, pre_of, post_of))
            measure(f"sublayer forward+backward, {name}, compiled",
                    lambda: torch.autograd.grad(f(x, fn, scale, base), [x, fn, scale, base], dy), top=8)
