"""
mHC's Triton kernels, each beside the plain reference it replaces (tests/test_mhc_kernels.py checks that the two agree,
forward and backward; tests/test_kernel_builds.py compiles them for sm_90 and gfx950):

  - sinkhorn_triton: mHC's Sinkhorn loop (mhc.sinkhorn) as one kernel forward and one backward.
  - hc_post_triton: mHC's write-back of a sublayer into the n streams (model_dsv4.Block.hc_post) as one kernel
    forward and one for the backward's reductions.
  - hc_pre_triton: mHC's pre-mix (model_dsv4.Block.hc_pre: the norm, the mixes, the Sinkhorn, the streams' weighted
    sum, the sublayer's RMSNorm) as two kernels (a split GEMM for the mixes, then the rest a token), for the few
    tokens of a decode step (no backward).
"""
from typing import Optional

import torch

from . import _jit, tl, triton


# ----------------------------------------------------------------------------- mHC's Sinkhorn
# Each token's n x n matrix is 16 numbers (n = 4) put through 39 steps of "divide each column (row) by its sum". As
# tensor ops every step is a reduction over the [T, n, n] tensor, written out and read back: 158 kernels and 170 us
# forward+backward for 4096 tokens on an H200, even compiled. Here a program takes BLOCK tokens, loads their matrices
# once and runs all the steps in registers: one kernel forward and one backward, 20 us together.

BLOCK = 16  # tokens a program: 256 programs for 4096 tokens, enough to fill an H200's 132 SMs


@_jit
def _tile(n_tok, N: tl.constexpr, NP: tl.constexpr, BLOCK: tl.constexpr):
    """Offsets and mask of this program's [BLOCK, NP, NP] tile of a contiguous [n_tok, N, N] tensor (NP: N rounded
    up to a power of two, as tl.arange needs; the padding loads as 0 and stays 0)."""
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    i = tl.arange(0, NP)
    off = t[:, None, None] * N * N + i[None, :, None] * N + i[None, None, :]
    return off, (t[:, None, None] < n_tok) & (i[None, :, None] < N) & (i[None, None, :] < N)


@_jit
def _sums(x, s):
    """x [BLOCK, NP, NP] summed along step s's axis and broadcast back to x's shape: even steps divide each column by
    its sum over the rows (axis 1), odd steps each row (axis 2)."""
    if s % 2 == 0:
        r = tl.broadcast_to(tl.sum(x, 1)[:, None, :], x.shape)
    else:  # (one shape from both branches: Triton's compiler needs that unless s is a constant; its interpreter
        # does not check, tests/test_kernel_builds.py compiles the kernels for that)
        r = tl.broadcast_to(tl.sum(x, 2)[:, :, None], x.shape)
    return r


@_jit
def _sinkhorn_fwd(c_ptr, out_ptr, n_tok, eps, STEPS: tl.constexpr, N: tl.constexpr, NP: tl.constexpr,
                  BLOCK: tl.constexpr):
    off, mask = _tile(n_tok, N, NP, BLOCK)
    c = tl.load(c_ptr + off, mask=mask, other=0.0)
    for s in tl.static_range(STEPS):
        c = c / (_sums(c, s) + eps)
    tl.store(out_ptr + off, c, mask=mask)


@_jit
def _sinkhorn_bwd(c_ptr, dy_ptr, dc_ptr, steps_ptr, n_tok, eps, STEPS: tl.constexpr, N: tl.constexpr,
                  NP: tl.constexpr, BLOCK: tl.constexpr):
    """The forward again, each step's input stored to this program's rows of steps_ptr ([programs, STEPS, BLOCK *
    NP * NP], 10 MB for 4096 tokens: it stays in L2), then from the last step back to the first: y = c / d, d = c
    summed + eps, gives dc = (dy - (dy * y) summed the same way) / d."""
    off, mask = _tile(n_tok, N, NP, BLOCK)
    tile: tl.constexpr = BLOCK * NP * NP
    b, i = tl.arange(0, BLOCK), tl.arange(0, NP)
    mine = (steps_ptr + tl.program_id(0) * STEPS * tile  # this program's [STEPS, BLOCK, NP, NP], step 0's tile
            + (b[:, None, None] * NP + i[None, :, None]) * NP + i[None, None, :])
    c = tl.load(c_ptr + off, mask=mask, other=0.0)
    for s in tl.static_range(STEPS):
        tl.store(mine + s * tile, c)
        c = c / (_sums(c, s) + eps)
    tl.debug_barrier()  # each thread reads back what it stored; the barrier makes that hold for any layout
    g = tl.load(dy_ptr + off, mask=mask, other=0.0)
    for r in tl.static_range(STEPS):
        c = tl.load(mine + (STEPS - 1 - r) * tile)
        d = _sums(c, STEPS - 1 - r) + eps
        g = (g - _sums(g * c / d, STEPS - 1 - r)) / d
    tl.store(dc_ptr + off, g, mask=mask)


def _launch(kernel, iters, eps, *tensors):
    """Run kernel over tensors[0]'s tokens ([..., n, n] fp32); returns the output it writes (shaped like tensors[0])."""
    n, NP, steps = tensors[0].shape[-1], triton.next_power_of_2(tensors[0].shape[-1]), 2 * iters - 1
    tensors = [t.contiguous() for t in tensors]
    out = torch.empty_like(tensors[0])
    n_tok = out.numel() // (n * n)
    grid = triton.cdiv(n_tok, BLOCK)
    if kernel is _sinkhorn_bwd:  # room for each step's input
        tensors.append(torch.empty(grid, steps, BLOCK * NP * NP, device=out.device, dtype=out.dtype))
    kernel[(grid,)](*tensors[:2], out, *tensors[2:], n_tok, eps, STEPS=steps, N=n, NP=NP, BLOCK=BLOCK, num_warps=1)
    return out


@torch.library.custom_op("nano_dsv4::sinkhorn", mutates_args=())
def sinkhorn_triton(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """mhc.sinkhorn(comb, iters, eps) for comb [..., n, n] fp32: a custom op, so torch.compile leaves the
    kernel as it is (and a CUDA graph records it)."""
    return _launch(_sinkhorn_fwd, iters, eps, comb)


@torch.library.custom_op("nano_dsv4::sinkhorn_backward", mutates_args=())
def _sinkhorn_triton_backward(comb: torch.Tensor, dy: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    return _launch(_sinkhorn_bwd, iters, eps, comb, dy)


for _op in (sinkhorn_triton, _sinkhorn_triton_backward):
    _op.register_fake(lambda comb, *rest: torch.empty_like(comb))


def _sinkhorn_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.iters, ctx.eps = inputs[1:]


sinkhorn_triton.register_autograd(
    lambda ctx, dy: (_sinkhorn_triton_backward(ctx.saved_tensors[0], dy, ctx.iters, ctx.eps), None, None),
    setup_context=_sinkhorn_setup)


# ----------------------------------------------------------------------------- mHC's write-back into the streams
# Block.hc_post: y_k = post_k f + sum_j comb[j, k] x_j for each of the n streams k, per token (x [T, n, D] the streams,
# f [T, D] the sublayer's output). The backward needs dx_j = sum_k comb[j, k] dy_k and df = sum_k post_k dy_k, and
# per token dpost_k = <dy_k, f> and dcomb[j, k] = <x_j, dy_k>: 4 + 16 sums over D. Compiled as tensor ops, the
# sums are five kernels that read dy three times (~118 us a sublayer for bench_2b's 4096 tokens on an H200), and
# inductor fuses the forward into the next hc_pre's norm as one 81 us reduction. Here the forward is one pointwise
# kernel and the backward's sums and df one pass over dy, x and f (53 us), each a program a token.
# dx stays tensor ops (hc_post_triton's backward): a pointwise sum over dy that inductor folds into the kernel where
# autograd adds up the streams' gradient, so it is never written out on its own.


@_jit
def _hc_post_fwd(f_ptr, x_ptr, post_ptr, comb_ptr, y_ptr, D, N: tl.constexpr, NP: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    """Token program_id(0) whole (BLOCK_D >= D): y [NP, BLOCK_D] (rows k), each input stream x_j read as a row and
    added in with its column of comb. A program a token, not a block of columns: programs of 512 columns (4 warps)
    take 43 us against 35 for bench_2b's 4096 tokens on an H200."""
    t = tl.program_id(0).to(tl.int64)
    i, d = tl.arange(0, NP), tl.arange(0, BLOCK_D)
    rows, dm = i < N, d < D
    post = tl.load(post_ptr + t * N + i, mask=rows, other=0.0)
    y = post[:, None] * tl.load(f_ptr + t * D + d, mask=dm, other=0.0).to(tl.float32)[None, :]
    for j in tl.static_range(N):
        xj = tl.load(x_ptr + (t * N + j) * D + d, mask=dm, other=0.0).to(tl.float32)
        y += tl.load(comb_ptr + (t * N + j) * N + i, mask=rows, other=0.0)[:, None] * xj[None, :]  # comb[j, k]
    tl.store(y_ptr + (t * N + i[:, None]) * D + d[None, :], y, mask=rows[:, None] & dm[None, :])


@_jit
def _hc_post_bwd(dy_ptr, f_ptr, x_ptr, post_ptr, df_ptr, dpost_ptr, dcomb_ptr, D, N: tl.constexpr,
                 NP: tl.constexpr, BLOCK_D: tl.constexpr):
    """Token program_id(0) whole (BLOCK_D >= D): dy [NP, BLOCK_D] (rows k) read once; df its rows weighted by post;
    dpost and each row j of dcomb one reduction over the columns, a row at a time: all of dcomb from one [NP, NP,
    BLOCK_D] product is slower than the five kernels of tensor ops."""
    t = tl.program_id(0).to(tl.int64)
    i, d = tl.arange(0, NP), tl.arange(0, BLOCK_D)
    rows, dm = i < N, d < D
    dy = tl.load(dy_ptr + (t * N + i[:, None]) * D + d[None, :], mask=rows[:, None] & dm[None, :],
                 other=0.0).to(tl.float32)
    f = tl.load(f_ptr + t * D + d, mask=dm, other=0.0).to(tl.float32)
    post = tl.load(post_ptr + t * N + i, mask=rows, other=0.0)
    tl.store(df_ptr + t * D + d, tl.sum(post[:, None] * dy, 0), mask=dm)
    tl.store(dpost_ptr + t * N + i, tl.sum(dy * f[None, :], 1), mask=rows)
    for j in tl.static_range(N):
        xj = tl.load(x_ptr + (t * N + j) * D + d, mask=dm, other=0.0).to(tl.float32)
        tl.store(dcomb_ptr + (t * N + j) * N + i, tl.sum(xj[None, :] * dy, 1), mask=rows)  # dcomb[j, k]


def _hc_launch(kernel, x, *tensors):
    """Run kernel over x's [..., n, D] tokens, a program a token (8 warps, BLOCK_D >= D)."""
    n, D = x.shape[-2:]
    kernel[(x.numel() // (n * D),)](*tensors, D, N=n, NP=triton.next_power_of_2(n), BLOCK_D=triton.next_power_of_2(D),
                                   num_warps=8)


@torch.library.custom_op("nano_dsv4::hc_post", mutates_args=())
def hc_post_triton(f: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """model_dsv4.Block.hc_post for f [..., D], x [..., n, D] (one dtype), post [..., n] and comb [..., n, n] fp32:
    the n streams after the sublayer, [..., n, D] in x's dtype. Computed in fp32, as the reference."""
    y = torch.empty_like(x)
    _hc_launch(_hc_post_fwd, x, f.contiguous(), x.contiguous(), post.contiguous(), comb.contiguous(), y)
    return y


@torch.library.custom_op("nano_dsv4::hc_post_sums", mutates_args=())
def _hc_post_sums(dy: torch.Tensor, f: torch.Tensor, x: torch.Tensor,
                  post: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hc_post_triton's backward but for dx: (df in f's dtype, dpost [..., n] and dcomb [..., n, n] fp32)."""
    df, dpost = torch.empty_like(f), torch.empty_like(post)
    dcomb = post.new_empty(*post.shape, post.shape[-1])
    _hc_launch(_hc_post_bwd, x, dy.contiguous(), f.contiguous(), x.contiguous(), post.contiguous(),
               df, dpost, dcomb)
    return df, dpost, dcomb


hc_post_triton.register_fake(lambda f, x, post, comb: torch.empty_like(x))
_hc_post_sums.register_fake(lambda dy, f, x, post: (torch.empty_like(f), torch.empty_like(post),
                                                    post.new_empty(*post.shape, post.shape[-1])))


def _hc_post_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _hc_post_backward(ctx, dy):
    f, x, post, comb = ctx.saved_tensors
    df, dpost, dcomb = _hc_post_sums(dy, f, x, post)
    dyf = dy.float()  # dx_j = sum_k comb[j, k] dy_k, pointwise (see above)
    dx = sum((comb[..., :, k, None] * dyf[..., k, None, :] for k in range(1, x.shape[-2])),
             comb[..., :, 0, None] * dyf[..., 0, None, :])
    return df, dx.to(x.dtype), dpost, dcomb


hc_post_triton.register_autograd(_hc_post_backward, setup_context=_hc_post_setup)


# ----------------------------------------------------------------------------- mHC's pre-mix for a few tokens (decode)
# Block.hc_pre collapses a token's n streams into the sublayer's input: an RMSNorm over all n * D values, the 24 mixes
# (fn's rows, an fp32 GEMM), pre / post / comb from them (sigmoids, a softmax, the Sinkhorn loop), and the pre-weighted
# sum of the streams. Compiled as tensor ops that is ~9 kernels of 1-5 us each in a decode step (the GEMM with its
# split-K reduction, the norm's reductions, the Sinkhorn and its set-up, the sum), 24 times a bench_2b step. Here it
# is two kernels, for the few tokens of a decode step (HC_PRE_TOKENS).
# The first splits the GEMM over K = n * D: a program takes 16 tokens and 128 of K, one fp32 tile product and the
# tokens' partial sums of squares, so a step has (tokens / 16) x (K / 128) programs and reads fn about tokens / 16
# times. (A program a token walking all of K is a chain of dependent loads on few SMs: slower than the compiled path.)
# The second takes one token in two programs: each adds the partials it needs in a fixed order (a token's sums do not
# depend on the batch) and the norm; one forms pre, the weighted sum and post, the other comb by the Sinkhorn in
# registers, half of a token's work.
# On an H200 at 64 / 256 tokens: the first 3.3 / 6.9 us (hc_dot's tf32x3), the second 7.3 / 8.1; the compiled path
# 17.6 / 19.1. hc_post stays a kernel of its own: folded into the first kernel it saves a launch a layer, not time.

HC_PRE_TOKENS = 256  # Block.hc_pre takes the kernels without grad for a decode step of at most this many tokens
HC_BT, HC_BK = 16, 128  # the GEMM's tile: tokens x K


@_jit
def _hc_mix_parts(x_ptr, fn_ptr, part_ptr, ss_ptr, T, K, R: tl.constexpr, RP: tl.constexpr, BT: tl.constexpr,
                  BK: tl.constexpr, DOT: tl.constexpr):
    """Tokens block program_id(0), K block s = program_id(1): part[s, t, :R] = x[t, k] @ fn[:, k].T and
    ss[s, t] = sum of x[t, k]^2 over the block's k, fp32 (DOT: tl.dot's input_precision, hc_dot)."""
    s = tl.program_id(1)
    t = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    k, r = s * BK + tl.arange(0, BK), tl.arange(0, RP)
    xv = tl.load(x_ptr + t[:, None] * K + k[None, :], mask=(t < T)[:, None] & (k < K)[None, :], other=0.0)
    xv = xv.to(tl.float32)
    fv = tl.load(fn_ptr + r[:, None] * K + k[None, :], mask=(r < R)[:, None] & (k < K)[None, :], other=0.0)
    tl.store(part_ptr + (s * T + t[:, None]) * RP + r[None, :], tl.dot(xv, tl.trans(fv), input_precision=DOT),
             mask=(t < T)[:, None])
    tl.store(ss_ptr + s * T + t, tl.sum(xv * xv, 1), mask=t < T)


@_jit
def _hc_partials(part_ptr, ss_ptr, t, T, S, N: tl.constexpr, NP: tl.constexpr, RP: tl.constexpr, SB: tl.constexpr,
                 AT: tl.constexpr, WIDE: tl.constexpr):
    """Token t's mixes from AT on (0: pre, N: post, 2 * N: comb), [NP] (or [NP, NP] with WIDE), and the norm's
    factor 1 / rms over all n * D values: the split GEMM's S partials added in the same order for every token, SB
    blocks of K at a time, read in the shapes they are used in."""
    i, sb = tl.arange(0, NP), tl.arange(0, SB)
    im = i < N
    acc = tl.zeros([NP, NP] if WIDE else [NP], dtype=tl.float32)
    ss = tl.zeros([SB], dtype=tl.float32)
    for s0 in range(0, S, SB):
        s = s0 + sb
        row = part_ptr + (s * T + t) * RP + AT
        sm = s < S
        if WIDE:
            acc += tl.sum(tl.load(row[:, None, None] + i[None, :, None] * N + i[None, None, :],
                                  mask=sm[:, None, None] & (im[:, None] & im[None, :])[None, :, :], other=0.0), 0)
        else:
            acc += tl.sum(tl.load(row[:, None] + i[None, :], mask=sm[:, None] & im[None, :], other=0.0), 0)
        ss += tl.load(ss_ptr + s * T + t, mask=sm, other=0.0)
    return acc, ss


@_jit
def _hc_pre(x_ptr, part_ptr, ss_ptr, scale_ptr, base_ptr, nw_ptr, h_ptr, post_ptr, comb_ptr, T, S, D, norm_eps, hc_eps,
            out_eps, N: tl.constexpr, NP: tl.constexpr, RP: tl.constexpr, STEPS: tl.constexpr, SB: tl.constexpr,
            BLOCK_D: tl.constexpr, NORM: tl.constexpr):
    """Token program_id(0), from its S partials, the same steps as mhc.hc_mixes, hc_split_sinkhorn and Block.hc_pre's
    sum. Two programs a token, which run side by side: program_id(1) 0 the sublayer's input h [D] (with NORM, then
    BLOCK_D >= D: through RMSNorm's steps, weight nw and eps out_eps, after its rounding to h's dtype) and post [N];
    1 comb [N, N], the Sinkhorn's 2 * iters - 1 steps in registers (as _sinkhorn_fwd, a tile of one token), half of
    the token's work and so a program of its own. The streams' first BLOCK_D channels (all of them for D <= BLOCK_D)
    are loaded before the partials, so that the two loads overlap."""
    t = tl.program_id(0).to(tl.int64)
    i, d = tl.arange(0, NP), tl.arange(0, BLOCK_D)
    im, cm = i < N, (i[:, None] < N) & (i[None, :] < N)
    K = N * D
    if tl.program_id(1) == 0:
        x0 = tl.load(x_ptr + t * K + i[:, None] * D + d[None, :], mask=im[:, None] & (d < D)[None, :], other=0.0)
        pre, ss = _hc_partials(part_ptr, ss_ptr, t, T, S, N, NP, RP, SB, 0, False)
        post, _ = _hc_partials(part_ptr, ss_ptr, t, T, S, N, NP, RP, SB, N, False)
        norm = tl.rsqrt(tl.sum(ss, 0) / K + norm_eps)
        pre = tl.sigmoid(pre * norm * tl.load(scale_ptr) + tl.load(base_ptr + i, mask=im, other=0.0)) + hc_eps
        # the sublayer's input: the streams weighted by pre, summed in fp32
        h = tl.sum(pre[:, None] * x0.to(tl.float32), 0).to(h_ptr.dtype.element_ty)
        if NORM:
            hf = h.to(tl.float32)
            r = tl.rsqrt(tl.sum(hf * hf, 0) / D + out_eps)
            h = (hf * r * tl.load(nw_ptr + d, mask=d < D, other=0.0)).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + t * D + d, h, mask=d < D)
        for d0 in range(BLOCK_D, D, BLOCK_D):
            dd = d0 + d
            xv = tl.load(x_ptr + t * K + i[:, None] * D + dd[None, :], mask=im[:, None] & (dd < D)[None, :],
                         other=0.0)
            tl.store(h_ptr + t * D + dd, tl.sum(pre[:, None] * xv.to(tl.float32), 0).to(h_ptr.dtype.element_ty),
                     mask=dd < D)
        post = 2 * tl.sigmoid(post * norm * tl.load(scale_ptr + 1) + tl.load(base_ptr + N + i, mask=im, other=0.0))
        tl.store(post_ptr + t * N + i, post, mask=im)
    else:
        c, ss = _hc_partials(part_ptr, ss_ptr, t, T, S, N, NP, RP, SB, 2 * N, True)
        norm = tl.rsqrt(tl.sum(ss, 0) / K + norm_eps)
        at = 2 * N + i[:, None] * N + i[None, :]  # comb's logits, a softmax over each row (padding: -inf, then 0)
        c = tl.where(cm, c * norm * tl.load(scale_ptr + 2) + tl.load(base_ptr + at, mask=cm, other=0.0),
                     float("-inf"))
        e = tl.where(cm, tl.exp(c - tl.where(im, tl.max(c, 1), 0.0)[:, None]), 0.0)
        c = tl.where(cm, e / tl.where(im, tl.sum(e, 1), 1.0)[:, None] + hc_eps, 0.0)[None, :, :]
        for step in tl.static_range(STEPS):  # Sinkhorn, as _sinkhorn_fwd
            c = c / (_sums(c, step) + hc_eps)
        tl.store(comb_ptr + t * N * N + (i[:, None] * N + i[None, :])[None, :, :], c, mask=cm[None, :, :])


def hc_dot(backend):
    """The mixes' tl.dot precision on a backend: on CUDA "tf32x3", three tf32 products to ~fp32, 3.3 us a call at
    64 tokens against fp32's ("ieee") 10.7 on an H200; AMD's compiler has no tf32x3, so "ieee" there."""
    return "tf32x3" if backend == "cuda" else "ieee"


@torch.library.custom_op("nano_dsv4::hc_pre", mutates_args=())
def hc_pre_triton(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, iters: int,
                  hc_eps: float, norm_eps: float, weight: Optional[torch.Tensor] = None,
                  out_eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block.hc_pre without grad: x [..., n, D] -> the sublayer's input [..., D] (x's dtype), post [..., n] and
    comb [..., n, n] (fp32); fn [(2+n)*n, n*D], scale [3], base [(2+n)*n] fp32. weight [D] fp32: the input through
    RMSNorm(weight, out_eps), as Block.hc_pre's norm does (one kernel less a sublayer in a decode step)."""
    *lead, n, D = x.shape
    xf = x.reshape(-1, n * D).contiguous()
    (T, K), R = xf.shape, fn.shape[0]
    RP, S = max(16, triton.next_power_of_2(R)), triton.cdiv(K, HC_BK)  # tl.dot's tiles are 16 wide at least
    part, ss = xf.new_empty(S, T, RP, dtype=torch.float32), xf.new_empty(S, T, dtype=torch.float32)
    _hc_mix_parts[(triton.cdiv(T, HC_BT), S)](xf, fn.contiguous(), part, ss, T, K, R=R, RP=RP, BT=HC_BT, BK=HC_BK,
                                             DOT=hc_dot("hip" if torch.version.hip else "cuda"), num_warps=4)
    post, comb = xf.new_empty(T, n, dtype=torch.float32), xf.new_empty(T, n, n, dtype=torch.float32)
    h = x.new_empty(T, D)
    norm = weight is not None
    block = triton.next_power_of_2(D) if norm else min(2048, triton.next_power_of_2(D))  # the norm: all of D at once
    _hc_pre[(T, 2)](xf, part, ss, scale.contiguous(), base.contiguous(), weight.contiguous() if norm else scale, h,
                    post, comb, T, S, D, norm_eps, hc_eps, out_eps, N=n, NP=triton.next_power_of_2(n), RP=RP,
                    STEPS=2 * iters - 1, SB=min(64, triton.next_power_of_2(S)), BLOCK_D=block, NORM=norm,
                    num_warps=4 if block <= 2048 else 8)
    return h.view(*lead, D), post.view(*lead, n), comb.view(*lead, n, n)


hc_pre_triton.register_fake(lambda x, fn, scale, base, iters, hc_eps, norm_eps, weight=None, out_eps=0.0: (
    x.new_empty(*x.shape[:-2], x.shape[-1]), x.new_empty(x.shape[:-1], dtype=torch.float32),
    x.new_empty(*x.shape[:-1], x.shape[-2], dtype=torch.float32)))
