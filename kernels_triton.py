"""
The project's Triton kernels, each beside the plain reference it replaces (tests/test_triton.py checks that the two
agree, forward and backward, and compiles the kernels for sm_90 and gfx950):

  - sinkhorn_triton: mHC's Sinkhorn loop (model_dsv4.sinkhorn) as one kernel forward and one backward.
  - hc_post_triton: mHC's write-back of a sublayer into the n streams (model_dsv4.Block.hc_post) as one kernel
    forward and one for the backward's reductions.
  - decode_attention_triton: the engine's decode attention (kv_cache.py; model_dsv4.sink_attention over each
    sequence's cached window keys and compressed entries) as one kernel that reads the keys in place.
  - experts_triton: a decode step's routed experts (kernels.grouped_experts with few rows an expert) as two kernels,
    the up projection with the SwiGLU and the down projection.
  - compress_pool_triton: a decode step's compressor pooling (model_dsv4.Compressor.pool over each sequence's cached
    window) for the sequences whose window completes at this token, reading nothing for the others.

Each is a torch.library custom op, so torch.compile keeps it as it is and a CUDA graph records it. Triton ships with
torch's GPU builds (CUDA and ROCm). Without a GPU, Triton's interpreter runs the same kernels on CPU tensors: the
tests use that; the model takes the reference there (has_triton).
"""
import os
from typing import Optional

import torch

if not torch.accelerator.is_available():  # no GPU (the tests on a CPU): Triton's interpreter runs its kernels on CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")  # tensors in numpy. Each @triton.jit reads this when it runs,
    # triton.language's own at its import: so this module is imported before triton (model_dsv4 does)
try:
    import triton
    import triton.language as tl
except ImportError:  # torch's CPU build comes without Triton: model_dsv4.sinkhorn's loop runs instead
    triton = tl = None

# ----------------------------------------------------------------------------- mHC's Sinkhorn
# Each token's n x n matrix is 16 numbers (n = 4) put through 39 steps of "divide each column (row) by its sum". As
# tensor ops every step is a reduction over the [T, n, n] tensor, written out and read back: 158 kernels and 170 us
# forward+backward for 4096 tokens on an H200 even compiled. Here a program takes BLOCK tokens, loads their matrices
# once and runs all the steps in registers: 2 kernels, 20 us with the backward's (bench/RESULTS.md, session 14).

_jit = triton.jit if triton else (lambda fn: fn)
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
        # does not check, tests/test_triton.py compiles the kernels for that)
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
    """model_dsv4.sinkhorn(comb, iters, eps) for comb [..., n, n] fp32: a custom op, so torch.compile leaves the
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
# sums took five kernels that read dy three times (~118 us a sublayer for 4096 tokens of bench_2b on an H200), and
# the forward fused into the next hc_pre's norm as one 81 us reduction (bench/RESULTS.md, session 21). Here the
# forward is one pointwise kernel (39 us for those 4096 tokens; 28 us a token a program, session 22), and the
# backward's sums and df one pass over dy, x and f with a program a token (53 us). With MoE's new combine, bench_2b's
# training step went from 64-65 to 62 ms.
# dx stays tensor ops (hc_post_triton's backward): a pointwise sum over dy that inductor folds into the kernel where
# autograd adds up the streams' gradient, so it is never written out on its own.


@_jit
def _hc_post_fwd(f_ptr, x_ptr, post_ptr, comb_ptr, y_ptr, D, N: tl.constexpr, NP: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    """Token program_id(0) whole (BLOCK_D >= D): y [NP, BLOCK_D] (rows k), each input stream x_j read as a row and
    added in with its column of comb. (Programs of 512 columns, 4 warps, as this was before session 22: 43.1 us
    against 35.3 us alone for bench_2b's 4096 tokens on an H200, bench/probe_hc_post.py.)"""
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
    dpost and each row j of dcomb one reduction over the columns. (The first version formed dcomb from an [NP, NP,
    BLOCK_D] product a block of columns: 117 us a sublayer, more than the five kernels it replaced.)"""
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


# ----------------------------------------------------------------------------- decode attention
# A decode step attends one query token per sequence (H heads, one shared K = V head of dim d) to the sequence's cached
# window keys and compressed entries. As tensor ops that was a gather of each sequence's keys from its cache slot and
# a concatenation (written out, fp32: 25 us a CSA layer of bench_2b at batch 64 on an H200), an fp32 GEMM on it (43
# us), the masked softmax and a bf16 GEMM (25 us): ~100 us of a CSA layer, ~40 us of a window or HCA layer, ~0.8 ms
# of the 5.4 ms step. Here a program takes a sequence and 16 heads and reads its keys where they are, a block at a
# time, skipping blocks with no key to attend (compressed entries not yet written, or not picked by the indexer):
# 8-17 us a layer, the step 4.4 ms (bench/RESULTS.md, session 23). Two passes over the keys, so that the
# probabilities are the reference's, rounded to the keys' dtype after the division: the row max and denominator
# (online), then the probabilities times the keys.

HEADS = 16  # heads a program: tl.dot's smallest M
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@_jit
def _dot(a, b, F32: tl.constexpr):
    """tl.dot(a, b) in fp32. F32 multiplies fp32 copies in full fp32 ("ieee", not the tensor cores' tf32): for fp32
    inputs, and in Triton's interpreter, whose bf16 dot returns garbage in Triton 3.9 (the same exact products of
    bf16 numbers, summed in fp32 as the tensor cores sum them)."""
    if F32:
        r = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        r = tl.dot(a, b)
    return r


@_jit
def _decode_keep(mask_ptr, b, start, L, BLOCK_N: tl.constexpr):
    """Which of keys start.. start+BLOCK_N-1 sequence b attends (its mask row), and whether any."""
    n = start + tl.arange(0, BLOCK_N)
    keep = tl.load(mask_ptr + b * L + n, mask=n < L, other=0) != 0
    return n, keep, tl.max(keep.to(tl.int32), 0) > 0


@_jit
def _decode_block(q, win_ptr, comp_ptr, slot, n, keep, W, D, n_comp, scale, d, dm, F32: tl.constexpr):
    """Keys n of cache row slot (the window's W, then the compressed entries), those kept loaded (the rest 0):
    (keys [BLOCK_N, DP], logits [HEADS, BLOCK_N] fp32, -inf where not kept)."""
    rows = tl.where(n < W, win_ptr + (slot * W + n) * D, comp_ptr + (slot * n_comp + n - W) * D)
    k = tl.load(rows[:, None] + d[None, :], mask=keep[:, None] & dm[None, :], other=0.0)
    return k, tl.where(keep[None, :], _dot(q, tl.trans(k), F32) * scale, float("-inf"))


@_jit
def _decode_attn(q_ptr, win_ptr, comp_ptr, slot_ptr, mask_ptr, sink_ptr, out_ptr, scale, H, D, W, S, n_comp,
                 HEADS: tl.constexpr, DP: tl.constexpr, BLOCK_N: tl.constexpr, F32: tl.constexpr):
    """Sequence program_id(0), heads program_id(1) * HEADS on: q [HEADS, DP] against the L = W + S keys whose mask
    byte is set, and the sink."""
    b, h = tl.program_id(0).to(tl.int64), tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    d = tl.arange(0, DP)
    hm, dm, L = h < H, d < D, W + S
    q = tl.load(q_ptr + (b * H + h[:, None]) * D + d[None, :], mask=hm[:, None] & dm[None, :], other=0.0)
    sink = tl.load(sink_ptr + h, mask=hm, other=0.0)
    mx, den = sink, tl.zeros([HEADS], dtype=tl.float32)  # the sink is in the row max and the denominator
    for start in range(0, L, BLOCK_N):
        n, keep, some = _decode_keep(mask_ptr, b, start, L, BLOCK_N)
        if some:
            k, logits = _decode_block(q, win_ptr, comp_ptr, slot, n, keep, W, D, n_comp, scale, d, dm, F32)
            new = tl.maximum(mx, tl.max(logits, 1))
            den = den * tl.exp(mx - new) + tl.sum(tl.exp(logits - new[:, None]), 1)
            mx = new
    den += tl.exp(sink - mx)
    acc = tl.zeros([HEADS, DP], dtype=tl.float32)
    for start in range(0, L, BLOCK_N):
        n, keep, some = _decode_keep(mask_ptr, b, start, L, BLOCK_N)
        if some:
            k, logits = _decode_block(q, win_ptr, comp_ptr, slot, n, keep, W, D, n_comp, scale, d, dm, F32)
            p = tl.exp(logits - mx[:, None]) / den[:, None]
            acc += _dot(p.to(k.dtype), k, F32)
    tl.store(out_ptr + (b * H + h[:, None]) * D + d[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=hm[:, None] & dm[None, :])


@torch.library.custom_op("nano_dsv4::decode_attention", mutates_args=())
def decode_attention_triton(q: torch.Tensor, win: torch.Tensor, comp: Optional[torch.Tensor], slots: torch.Tensor,
                            mask: torch.Tensor, sink: torch.Tensor, scale: float) -> torch.Tensor:
    """sink_attention for one query token per sequence, reading its keys from the caches: q [B, H, d]; win
    [slots, W, d] and comp [slots, n, d] (or None) the caches (contiguous, q's dtype: bf16, or fp32 for the tests),
    slots [B] each sequence's row, mask bool [B, W + S]: which of the row's W window keys and first S compressed
    entries to attend; sink [H] fp32 -> [B, H, d] in q's dtype."""
    B, H, D = q.shape
    W = win.shape[1]
    comp = win if comp is None else comp  # not read: S = 0
    assert win.is_contiguous() and comp.is_contiguous() and q.dtype == win.dtype == comp.dtype
    assert q.dtype in (torch.bfloat16, torch.float32), q.dtype
    out = torch.empty_like(q)
    _decode_attn[(B, triton.cdiv(H, HEADS))](
        q.contiguous(), win, comp, slots.contiguous(), mask.contiguous().view(torch.uint8), sink.float().contiguous(),
        out, scale, H, D, W, mask.shape[1] - W, comp.shape[1], HEADS=HEADS, DP=triton.next_power_of_2(D),
        BLOCK_N=DECODE_BLOCK_N, F32=INTERPRETED or q.dtype == torch.float32, num_warps=4)
    return out


DECODE_BLOCK_N = 32
decode_attention_triton.register_fake(lambda q, *rest: torch.empty_like(q))


def has_triton(t):
    """Whether the model takes the Triton kernels for t: Triton is installed and t is on a GPU. (On a CPU the
    references are faster than Triton's interpreter, which the tests run the kernels through.)"""
    return triton is not None and t.is_cuda


# ----------------------------------------------------------------------------- a decode step's routed experts
# A decode step's experts are bound by reading their weights: 64 tokens x top-6 of bench_2b's 64 experts hit every
# expert with 1-10 rows, 302 MB a layer, which aten's grouped GEMM (kernels.grouped_experts) read at 2.2 TB/s in
# 139 us. Here a program takes one expert and a block of BLOCK_N output columns, and runs the expert's rows past
# them BLOCK_M at a time: the up kernel the gate and up rows of w13 with the clamped SwiGLU and the routing weight
# (h, in the rows' dtype), the down kernel h times w2. 80-99 us at 64 and 256 tokens against aten's 139 and 146
# (bench/probe_moe_decode.py, RESULTS.md session 24). An expert with no rows reads nothing. For many rows an expert
# (prefill, training) aten's tiles are the better choice: grouped_experts picks by rows an expert (EXPERT_ROWS).

@_jit
def _experts_up(x_ptr, w13_ptr, ws_ptr, offs_ptr, h_ptr, D, I, limit, CLAMP: tl.constexpr, F32: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Expert program_id(0), columns program_id(1) * BLOCK_N on of h [R, I] = silu(g) * u * ws, g and u its rows
    times w13's gate rows (0..I-1) and up rows (I..2I-1), each rounded to h's dtype as the grouped GEMM's output is."""
    e = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < I
    start, end = tl.load(offs_ptr + e - 1, mask=e > 0, other=0), tl.load(offs_ptr + e)
    gate = w13_ptr + (e * 2 * I + n[:, None]) * D
    for m0 in range(start, end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        rm = rows < end
        g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, D, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            km = k < D
            x = tl.load(x_ptr + rows[:, None].to(tl.int64) * D + k[None, :], mask=rm[:, None] & km[None, :], other=0.)
            wm = nm[:, None] & km[None, :]
            g += _dot(x, tl.trans(tl.load(gate + k[None, :], mask=wm, other=0.0)), F32)
            u += _dot(x, tl.trans(tl.load(gate + I * D + k[None, :], mask=wm, other=0.0)), F32)
        g = g.to(h_ptr.dtype.element_ty).to(tl.float32)
        u = u.to(h_ptr.dtype.element_ty).to(tl.float32)
        if CLAMP:
            g, u = tl.minimum(g, limit), tl.minimum(tl.maximum(u, -limit), limit)
        w = tl.load(ws_ptr + rows, mask=rm, other=0.0)
        h = g * tl.sigmoid(g) * u * w[:, None]
        tl.store(h_ptr + rows[:, None].to(tl.int64) * I + n[None, :], h.to(h_ptr.dtype.element_ty),
                 mask=rm[:, None] & nm[None, :])


@_jit
def _experts_down(h_ptr, w2_ptr, offs_ptr, out_ptr, D, I, F32: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Expert program_id(0), columns program_id(1) * BLOCK_N on of out [R, D] = h times the expert's w2 [D, I]."""
    e = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < D
    start, end = tl.load(offs_ptr + e - 1, mask=e > 0, other=0), tl.load(offs_ptr + e)
    w = w2_ptr + (e * D + n[:, None]) * I
    for m0 in range(start, end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        rm = rows < end
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            km = k < I
            h = tl.load(h_ptr + rows[:, None].to(tl.int64) * I + k[None, :], mask=rm[:, None] & km[None, :], other=0.)
            acc += _dot(h, tl.trans(tl.load(w + k[None, :], mask=nm[:, None] & km[None, :], other=0.0)), F32)
        tl.store(out_ptr + rows[:, None].to(tl.int64) * D + n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=rm[:, None] & nm[None, :])


EXPERT_ROWS = 32  # grouped_experts takes these kernels up to this many rows an expert on average
EXPERTS_BLOCK_N, EXPERTS_BLOCK_K = 64, 128


@torch.library.custom_op("nano_dsv4::experts", mutates_args=())
def experts_triton(xs: torch.Tensor, ws: torch.Tensor, offs: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                   limit: float) -> torch.Tensor:
    """kernels.grouped_experts' math: xs [R, D] rows sorted by expert (bf16, or fp32 for the tests), ws [R] fp32
    routing weights, offs [e] int32 each expert's end row, w13 [e, 2I, D], w2 [e, D, I] (contiguous, xs' dtype),
    limit the SwiGLU clamp (0: none) -> [R, D]."""
    E, I, D = w13.shape[0], w13.shape[1] // 2, w13.shape[2]
    assert w13.is_contiguous() and w2.is_contiguous() and xs.dtype == w13.dtype == w2.dtype, (xs.dtype, w13.dtype)
    xs = xs.contiguous()
    h, out = xs.new_empty(xs.shape[0], I), torch.empty_like(xs)
    bm = 16 if xs.shape[0] <= 16 * E else 32  # tl.dot's smallest M while the experts have few rows
    f32 = INTERPRETED or xs.dtype == torch.float32
    bn, bk = EXPERTS_BLOCK_N, EXPERTS_BLOCK_K
    _experts_up[(E, triton.cdiv(I, bn))](xs, w13, ws.float().contiguous(), offs.contiguous(), h, D, I, float(limit),
                                         CLAMP=bool(limit), F32=f32, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                                         num_warps=4, num_stages=4)
    _experts_down[(E, triton.cdiv(D, bn))](h, w2, offs, out, D, I, F32=f32, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                                           num_warps=4, num_stages=4)
    return out


experts_triton.register_fake(lambda xs, *rest: torch.empty_like(xs))


# ----------------------------------------------------------------------------- a decode step's compressor pooling
# Each decode step adds one row to every sequence's partial compression window, and a sequence's window completes
# once every `ratio` tokens. The reference (kv_cache._compressor_step) gathers every sequence's whole window out of
# the cache and pools it, keeping the result only where the window completed: static shapes for CUDA graphs, but at
# batch 64 an HCA layer (ratio 128) read 64 x 128 rows of 2 x 512 fp32 values a step, 27.7 us a layer on an H200
# (session 24's trace). Here a program takes a sequence and a block of channels, and returns at once when that
# sequence's window is not complete (its output zeros, which the caller discards).

@_jit
def _compress_pool(kv_ptr, score_ptr, prev_kv_ptr, prev_score_ptr, ape_ptr, slot_ptr, full_ptr, out_ptr, m, d,
                   OVERLAP: tl.constexpr, MP: tl.constexpr, BLOCK_D: tl.constexpr):
    """Sequence program_id(0), channels program_id(1) * BLOCK_D on: softmax over the window's rows (and, with
    OVERLAP, the previous window's first-half rows) of score + ape, per channel, times kv, summed."""
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    cm = c < d
    out = out_ptr + b * d + c
    if tl.load(full_ptr + b) == 0:
        tl.store(out, tl.zeros([BLOCK_D], dtype=tl.float32), mask=cm)
        return
    slot = tl.load(slot_ptr + b).to(tl.int64)
    r = tl.arange(0, MP)
    rm = (r < m)[:, None] & cm[None, :]
    width = 2 * d if OVERLAP else d  # the cache's channels a row: the window's own are the second half with OVERLAP
    col = (d if OVERLAP else 0) + c
    at = (slot * m + r[:, None]) * width + col[None, :]
    kv = tl.load(kv_ptr + at, mask=rm, other=0.0)
    score = tl.load(score_ptr + at, mask=rm, other=float("-inf")) + tl.load(ape_ptr + r[:, None] * width + col[None, :],
                                                                          mask=rm, other=0.0)
    mx = tl.max(score, 0)
    if OVERLAP:  # the window before's first-half rows, ape already added
        at = (slot * m + r[:, None]) * d + c[None, :]
        pkv = tl.load(prev_kv_ptr + at, mask=rm, other=0.0)
        pscore = tl.load(prev_score_ptr + at, mask=rm, other=float("-inf"))
        mx = tl.maximum(mx, tl.max(pscore, 0))
        p = tl.exp(pscore - mx[None, :])
        den, acc = tl.sum(p, 0), tl.sum(p * pkv, 0)
    else:
        den, acc = tl.zeros([BLOCK_D], dtype=tl.float32), tl.zeros([BLOCK_D], dtype=tl.float32)
    p = tl.exp(score - mx[None, :])
    den += tl.sum(p, 0)
    acc += tl.sum(p * kv, 0)
    tl.store(out, acc / den, mask=cm)


POOL_BLOCK_D = 32


@torch.library.custom_op("nano_dsv4::compress_pool", mutates_args=())
def compress_pool_triton(kv: torch.Tensor, score: torch.Tensor, prev_kv: torch.Tensor, prev_score: torch.Tensor,
                         ape: torch.Tensor, slots: torch.Tensor, full: torch.Tensor, overlap: bool) -> torch.Tensor:
    """Compressor.pool of each sequence's cached window where full: kv, score [rows, m, coff*d] the caches' partial
    windows (score without ape), prev_kv, prev_score [rows, m, d] (overlap: the window before's first-half rows, ape
    added), ape [m, coff*d], slots [B] each sequence's cache row, full bool [B] -> fp32 [B, d] (zeros where not
    full)."""
    m, d = kv.shape[1], prev_kv.shape[2]
    assert kv.is_contiguous() and score.is_contiguous() and prev_kv.is_contiguous() and prev_score.is_contiguous()
    out = kv.new_empty(slots.shape[0], d)
    _compress_pool[(slots.shape[0], triton.cdiv(d, POOL_BLOCK_D))](
        kv, score, prev_kv, prev_score, ape.contiguous(), slots.contiguous(), full.contiguous().view(torch.uint8), out,
        m, d, OVERLAP=overlap, MP=triton.next_power_of_2(m), BLOCK_D=POOL_BLOCK_D, num_warps=4)
    return out


compress_pool_triton.register_fake(lambda kv, score, prev_kv, prev_score, ape, slots, full, overlap:
                                   kv.new_empty(slots.shape[0], prev_kv.shape[2]))
