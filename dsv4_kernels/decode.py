"""
The engine's decode-step kernels, each beside the plain reference it replaces (tests/test_decode_kernels.py checks that
the two agree, alone and in the engine; tests/test_kernel_builds.py compiles them for sm_90 and gfx950):

  - experts_triton: a decode step's routed experts (dsv4_kernels.fast.grouped_experts with few rows an expert) as two
    kernels, the up projection with the SwiGLU and the down projection.
  - compress_step_triton: a decode step's whole compressor step (kv_cache.KVCache._compressor_step: the row's
    write, the pooling, Compressor.finish's norm and RoPE, the entry's write, the overlap's roll).
  - sample_triton: the engine's sampler (engine.sample_tokens without top-p and top-k) over chunks of the vocabulary.
  - q_norm_rope_triton: the query's per-head norm and RoPE in a decode step (the end of model_dsv4.Attention.query).
  - window_kv_triton: a decode step's window key (model_dsv4.Attention.window_kv: its norm and RoPE) written into
    the cache's ring buffer with its position (kv_cache.KVCache._attn_decode).

The decode attention's kernels are in dsv4_kernels/decode_attention.py, the router's in dsv4_kernels/route.py.

All but the sampler are torch.library custom ops, as mhc_triton.py's are (compiled layers call them); the sampler runs
outside compiled code. Without a GPU the package's __init__ turns on Triton's interpreter before triton is imported.
"""
from typing import Optional

import torch

from . import INTERPRETED, _dot, _jit, tl, triton


# ----------------------------------------------------------------------------- a decode step's routed experts
# A decode step's experts are bound by reading their weights: 64 tokens x top-6 of bench_2b's 64 experts hit every
# expert with 1-10 rows, 302 MB a layer, which aten's grouped GEMM (fast.grouped_experts) reads at 2.2 TB/s in 139 us.
# Here a program takes one expert and a block of BLOCK_N output columns, and runs the expert's rows past them BLOCK_M
# at a time: the up kernel the gate and up rows of w13 with the clamped SwiGLU and the routing weight (h, in the rows'
# dtype), the down kernel h times w2. It beat aten's at 64 and 256 tokens on an H200 (the one-off probe that timed
# it, bench/probe_moe_decode.py, is in git history). An expert with no rows reads nothing. For many rows an expert
# (prefill, training) aten's tiles are the better choice: grouped_experts takes these for decode steps only, up to
# EXPERT_ROWS rows an expert. The shared expert rides along as one more expert, its rows the tokens themselves: that
# adds 3 MB to the 302 MB the kernels read, where on its own it is 3-4 kernels a layer of 1.6-3.6 us each.

@_jit
def _expert_rows(offs_ptr, e, R, NT, SB, SHARED: tl.constexpr, BLOCK_M: tl.constexpr):
    """Program e's rows [start, end) and routed expert ex. SHARED: programs e < SB (ex < 0) take the shared expert's
    rows R.. R + NT (a row for each of the NT tokens, after the R routed ones), BLOCK_M each, the others routed
    expert ex = e - SB's rows from offs."""
    ex = e - SB
    if SHARED and e < SB:
        start = R + e * BLOCK_M
        end = tl.minimum(start + BLOCK_M, R + NT)
    else:
        start = tl.load(offs_ptr + ex - 1, mask=ex > 0, other=0).to(tl.int64)
        end = tl.load(offs_ptr + ex).to(tl.int64)
    return start, end, ex


@_jit
def _experts_up(x_ptr, w13_ptr, ws_ptr, offs_ptr, h_ptr, tok_ptr, s1_ptr, s3_ptr, D, I, R, NT, SB, limit,
                CLAMP: tl.constexpr, F32: tl.constexpr, SHARED: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Expert program_id(0), columns program_id(1) * BLOCK_N on of h [R (+ NT), I] = silu(g) * u * ws, g and u its
    rows times w13's gate rows (0..I-1) and up rows (I..2I-1), each rounded to h's dtype as the grouped GEMM's output
    is. SHARED: the first SB programs are the shared expert's, its rows the tokens tok [NT, D], its weights s1 and s3
    [I, D], its routing weight 1 (h rows R.. R + NT)."""
    e = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < I
    start, end, ex = _expert_rows(offs_ptr, e, R, NT, SB, SHARED, BLOCK_M)
    if SHARED and e < SB:
        src, gate, up = tok_ptr - R * D, s1_ptr + n[:, None] * D, s3_ptr + n[:, None] * D  # src row r: token r - R
    else:
        src, gate = x_ptr, w13_ptr + (ex * 2 * I + n[:, None]) * D
        up = gate + I * D
    for m0 in range(start, end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        rm = rows < end
        g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, D, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            km = k < D
            x = tl.load(src + rows[:, None] * D + k[None, :], mask=rm[:, None] & km[None, :], other=0.)
            wm = nm[:, None] & km[None, :]
            g += _dot(x, tl.trans(tl.load(gate + k[None, :], mask=wm, other=0.0)), F32)
            u += _dot(x, tl.trans(tl.load(up + k[None, :], mask=wm, other=0.0)), F32)
        g = g.to(h_ptr.dtype.element_ty).to(tl.float32)
        u = u.to(h_ptr.dtype.element_ty).to(tl.float32)
        if CLAMP:
            g, u = tl.minimum(g, limit), tl.minimum(tl.maximum(u, -limit), limit)
        w = tl.load(ws_ptr + rows, mask=rm & (rows < R), other=1.0)  # the shared expert's rows: 1
        h = g * tl.sigmoid(g) * u * w[:, None]
        tl.store(h_ptr + rows[:, None] * I + n[None, :], h.to(h_ptr.dtype.element_ty), mask=rm[:, None] & nm[None, :])


@_jit
def _experts_down(h_ptr, w2_ptr, offs_ptr, out_ptr, s2_ptr, D, I, R, NT, SB, F32: tl.constexpr, SHARED: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Expert program_id(0), columns program_id(1) * BLOCK_N on of out [R (+ NT), D] = h times the expert's w2
    [D, I]; SHARED: the first SB programs the shared expert's rows R.. R + NT times s2 [D, I]."""
    e = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < D
    start, end, ex = _expert_rows(offs_ptr, e, R, NT, SB, SHARED, BLOCK_M)
    if SHARED and e < SB:
        w = s2_ptr + n[:, None] * I
    else:
        w = w2_ptr + (ex * D + n[:, None]) * I
    for m0 in range(start, end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        rm = rows < end
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            km = k < I
            h = tl.load(h_ptr + rows[:, None] * I + k[None, :], mask=rm[:, None] & km[None, :], other=0.)
            acc += _dot(h, tl.trans(tl.load(w + k[None, :], mask=nm[:, None] & km[None, :], other=0.0)), F32)
        tl.store(out_ptr + rows[:, None] * D + n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=rm[:, None] & nm[None, :])


EXPERT_ROWS = 32  # grouped_experts takes these kernels for a decode step up to this many rows an expert on average
EXPERTS_BLOCK_N, EXPERTS_BLOCK_K = 64, 128


@torch.library.custom_op("nano_dsv4::experts", mutates_args=())
def experts_triton(xs: torch.Tensor, ws: torch.Tensor, offs: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                   limit: float, x: Optional[torch.Tensor] = None, s1: Optional[torch.Tensor] = None,
                   s3: Optional[torch.Tensor] = None, s2: Optional[torch.Tensor] = None) -> torch.Tensor:
    """fast.grouped_experts' math: xs [R, D] rows sorted by expert (bf16, or fp32 for the tests), ws [R] fp32
    routing weights, offs [e] int32 each expert's end row, w13 [e, 2I, D], w2 [e, D, I] (contiguous, xs' dtype),
    limit the SwiGLU clamp (0: none) -> [R, D]. With x [N, D] and the shared expert's w1, w3 [I, D] and w2 [D, I]
    (s1, s3, s2): that expert too, as one more expert whose rows are x's (Expert.forward without a routing weight)
    -> [R + N, D], its output the last N rows."""
    E, I, D = w13.shape[0], w13.shape[1] // 2, w13.shape[2]
    assert w13.is_contiguous() and w2.is_contiguous() and xs.dtype == w13.dtype == w2.dtype, (xs.dtype, w13.dtype)
    shared = x is not None
    if shared:
        x, s1, s3, s2 = (t.contiguous() for t in (x, s1, s3, s2))
        assert x.dtype == s1.dtype == s3.dtype == s2.dtype == xs.dtype, (x.dtype, s1.dtype, xs.dtype)
    xs, R, NT = xs.contiguous(), xs.shape[0], x.shape[0] if shared else 0
    h, out = xs.new_empty(R + NT, I), xs.new_empty(R + NT, D)
    bm = 16 if R <= 16 * E else 32  # tl.dot's smallest M while the experts have few rows
    f32 = INTERPRETED or xs.dtype == torch.float32
    bn, bk = EXPERTS_BLOCK_N, EXPERTS_BLOCK_K
    tok, s1, s3, s2 = (x, s1, s3, s2) if shared else (xs, xs, xs, xs)  # not read without the shared expert
    # the shared expert's rows in blocks of bm, a program each, launched first: as one program it would run its
    # rows' blocks one after another and finish last (bench_2b, batch 64: 104 us a layer against 80)
    SB = triton.cdiv(NT, bm)
    _experts_up[(SB + E, triton.cdiv(I, bn))](xs, w13, ws.float().contiguous(), offs.contiguous(), h, tok, s1, s3,
                                              D, I, R, NT, SB, float(limit), CLAMP=bool(limit), F32=f32,
                                              SHARED=shared, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=4,
                                              num_stages=4)
    _experts_down[(SB + E, triton.cdiv(D, bn))](h, w2, offs, out, s2, D, I, R, NT, SB, F32=f32, SHARED=shared,
                                                BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=4, num_stages=4)
    return out


experts_triton.register_fake(lambda xs, ws, offs, w13, w2, limit, x=None, *rest: xs.new_empty(
    xs.shape[0] + (0 if x is None else x.shape[0]), xs.shape[1]))


# ----------------------------------------------------------------------------- sampling
# The engine samples a token a row (engine.sample_tokens: log_softmax over the vocabulary, then greedy argmax or the
# Gumbel-max draw of engine.gumbel's noise). Compiled, that is one reduction kernel with a program a row, each running
# all 129280 tokens of V4's vocabulary: 174 us (greedy) and 175 us (temperature 1) of a bench_2b step at batch 64 on
# an H200. Here a program takes a (row, chunk of 8192 tokens): its max and sum of exponentials, then, with the row's
# log-sum-exp from every chunk, the chunk's first best token by logprob (+ the same Gumbel noise for sampled rows);
# the chunks' best are compared in torch: 42 and 107 us. The engine takes it on a GPU when no request filters by
# top-p or top-k.

@_jit
def _srl(x, k: tl.constexpr):
    """x >> k as a logical shift of an int64 (engine.gumbel's srl)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


@_jit
def _sample_sums(logits_ptr, temp_ptr, part_ptr, V, CHUNK, S, BLOCK: tl.constexpr):
    """Row program_id(0), chunk program_id(1): the max and sum of exp(x - max) of x = logits / temperature."""
    b, s = tl.program_id(0).to(tl.int64), tl.program_id(1)
    t, end = tl.load(temp_ptr + b), tl.minimum(V, s * CHUNK + CHUNK)
    mx = tl.full([BLOCK], float("-inf"), tl.float32)
    z = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(s * CHUNK, end, BLOCK):
        j = start + tl.arange(0, BLOCK)
        x = tl.load(logits_ptr + b * V + j, mask=j < end, other=float("-inf")) / t
        new = tl.maximum(mx, x)
        ref = tl.where(new > float("-inf"), new, 0.0)  # a lane with no token yet: exp(-inf) = 0, not exp(nan)
        z = z * tl.exp(mx - ref) + tl.exp(x - ref)
        mx = new
    m = tl.max(mx, 0)
    tl.store(part_ptr + (b * S + s) * 2, m)
    tl.store(part_ptr + (b * S + s) * 2 + 1, tl.sum(z * tl.exp(mx - m), 0))


@_jit
def _sample_pick(logits_ptr, temp_ptr, greedy_ptr, draws_ptr, part_ptr, best_ptr, idx_ptr, lp_ptr, V, CHUNK, S,
                 SP: tl.constexpr, BLOCK: tl.constexpr):
    """Row program_id(0), chunk program_id(1): the row's log-sum-exp from the chunks' sums, then the chunk's first
    token with the highest score (logprob, + Gumbel noise when sampled), the score and the token's logprob."""
    b, s = tl.program_id(0).to(tl.int64), tl.program_id(1)
    i = tl.arange(0, SP)
    m_i = tl.load(part_ptr + (b * S + i) * 2, mask=i < S, other=float("-inf"))
    z_i = tl.load(part_ptr + (b * S + i) * 2 + 1, mask=i < S, other=0.0)
    m = tl.max(m_i, 0)
    lse = m + tl.log(tl.sum(z_i * tl.exp(m_i - m), 0))
    t, greedy = tl.load(temp_ptr + b), tl.load(greedy_ptr + b) != 0
    seed, count = tl.load(draws_ptr + b * 2), tl.load(draws_ptr + b * 2 + 1)
    row = (seed * -7046029254386353131 + count) * -3335678366873096957  # engine.gumbel's constants, signed
    end = tl.minimum(V, s * CHUNK + CHUNK)
    best, best_j, best_lp = tl.full((), float("-inf"), tl.float64), s * CHUNK, tl.full((), 0.0, tl.float32)
    for start in range(s * CHUNK, end, BLOCK):
        j = start + tl.arange(0, BLOCK)
        lp = tl.load(logits_ptr + b * V + j, mask=j < end, other=float("-inf")) / t - lse
        score = lp.to(tl.float64)
        if not greedy:
            x = (row + j.to(tl.int64)) * -7046029254386353131
            x = (x ^ _srl(x, 30)) * -4658895280553007687
            x = (x ^ _srl(x, 27)) * -7723592293110705685
            u = (_srl(x ^ _srl(x, 31), 11).to(tl.float64) + 0.5) * 1.1102230246251565e-16  # 2 ** -53
            score = tl.where(j < end, score - tl.log(-tl.log(u)), float("-inf"))
        k = tl.argmax(score, 0)
        top = tl.max(score, 0)
        if top > best:  # strictly: the first of equal scores stays
            best, best_j = top, start + k
            best_lp = tl.sum(tl.where(tl.arange(0, BLOCK) == k, lp, 0.0), 0)
    tl.store(best_ptr + b * S + s, best)
    tl.store(idx_ptr + b * S + s, best_j)
    tl.store(lp_ptr + b * S + s, best_lp)


SAMPLE_CHUNK, SAMPLE_BLOCK = 8192, 1024  # 16 chunks of 129280 tokens: 1024 programs at batch 64


def sample_triton(logits, temp, greedy, draws, chunk=SAMPLE_CHUNK):
    """engine.sample_tokens without top-p and top-k: logits fp32 [B, V], temp fp32 [B] (1 for greedy rows), greedy
    bool [B], draws int64 [B, 2] (seed, token index), chunk tokens a program -> fp64 [2, B]: the tokens and their
    logprobs."""
    B, V = logits.shape
    block = min(SAMPLE_BLOCK, triton.next_power_of_2(chunk))
    S = triton.cdiv(V, chunk)
    part = logits.new_empty(B, S, 2)
    best, idx, lp = logits.new_empty(B, S, dtype=torch.float64), draws.new_empty(B, S), logits.new_empty(B, S)
    args = (logits.contiguous(), temp.float().contiguous())
    _sample_sums[(B, S)](*args, part, V, chunk, S, BLOCK=block, num_warps=4)
    _sample_pick[(B, S)](*args, greedy.contiguous().view(torch.uint8), draws.contiguous(), part, best, idx, lp, V,
                         chunk, S, SP=triton.next_power_of_2(S), BLOCK=block, num_warps=4)
    j = best.argmax(1, keepdim=True)  # the first chunk of equal scores
    return torch.stack([idx.gather(1, j)[:, 0].double(), lp.gather(1, j)[:, 0].double()])


# ----------------------------------------------------------------------------- a decode step's query norm and RoPE
# Attention.query ends with a per-head RMSNorm of q (no weight; the factor rounded to q's dtype, as the reference
# multiplies in it) and RoPE on each head's last rd dims. Inductor writes that as a reduction and a pointwise kernel,
# 4.8 us an HCA layer, or 17.7 us where the config its first call times comes out badly. Here a program takes one
# token's block of heads: the rows for the norm, then the rope dims again as even and odd halves, rotated pairwise by
# the token's cos and sin.

@_jit
def _q_norm_rope(q_ptr, cos_ptr, sin_ptr, out_ptr, H, d, eps, RH: tl.constexpr, DP: tl.constexpr,
                 HB: tl.constexpr):
    """Token program_id(0), heads program_id(1) * HB..: q [N, H, d] -> out [N, H, d]; cos, sin [N, RH] fp32 (RH pairs
    on the last 2 * RH dims)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * HB + tl.arange(0, HB)
    c, j = tl.arange(0, DP), tl.arange(0, RH)
    hm = h < H
    row = q_ptr + (t * H + h[:, None]) * d
    x = tl.load(row + c[None, :], mask=hm[:, None] & (c < d)[None, :], other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, 1) / d + eps).to(out_ptr.dtype.element_ty).to(tl.float32)[:, None]
    dt = out_ptr.dtype.element_ty
    base = out_ptr + (t * H + h[:, None]) * d
    tl.store(base + c[None, :], (x * r).to(dt), mask=hm[:, None] & (c < d - 2 * RH)[None, :])  # no rotation
    even = d - 2 * RH + 2 * j[None, :]
    x0 = (tl.load(row + even, mask=hm[:, None], other=0.0).to(tl.float32) * r).to(dt).to(tl.float32)
    x1 = (tl.load(row + even + 1, mask=hm[:, None], other=0.0).to(tl.float32) * r).to(dt).to(tl.float32)
    cos, sin = tl.load(cos_ptr + t * RH + j)[None, :], tl.load(sin_ptr + t * RH + j)[None, :]
    tl.store(base + even, (x0 * cos - x1 * sin).to(dt), mask=hm[:, None])
    tl.store(base + even + 1, (x0 * sin + x1 * cos).to(dt), mask=hm[:, None])


@torch.library.custom_op("nano_dsv4::q_norm_rope", mutates_args=())
def q_norm_rope_triton(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float) -> torch.Tensor:
    """Attention.query's end: q [B, T, H, d] -> q * rsqrt(mean(q^2) + eps) per head (the factor in q's dtype), then
    RoPE on the last 2 * cos.shape[-1] dims (apply_rope); cos, sin fp32, [B, T, rd/2] or [T, rd/2]."""
    B, T, H, d = q.shape
    cos, sin = (a.expand(B, T, a.shape[-1]).reshape(B * T, -1).float().contiguous() for a in (cos, sin))
    out = torch.empty_like(q)
    hb = min(4, triton.next_power_of_2(H))
    _q_norm_rope[(B * T, triton.cdiv(H, hb))](q.contiguous(), cos, sin, out, H, d, eps, RH=cos.shape[1],
                                              DP=triton.next_power_of_2(d), HB=hb, num_warps=4)
    return out


q_norm_rope_triton.register_fake(lambda q, *rest: torch.empty_like(q))


# ----------------------------------------------------------------------------- a decode step's window key
# The step's new key (= value) of every sequence: kv_norm, RoPE at its position, and the write into the window's ring
# buffer with its position are five small inductor kernels a layer (~10 us). Here one program takes a sequence and
# does all of it: the norm in fp32 with its weight, rounded once, as RMSNorm; RoPE on the last 2 * RH dims in fp32,
# rounded, as apply_rope.

@_jit
def _window_kv(kv_ptr, w_ptr, cos_ptr, sin_ptr, win_ptr, wpos_ptr, slot_ptr, pos_ptr, row, W, d, eps,
               RH: tl.constexpr, DP: tl.constexpr):
    """Sequence program_id(0): kv [B, d] (rows `row` apart) -> win[slot, pos % W] ([slots, W, d]), and pos into
    win_pos[slot, pos % W]; w [d] fp32, cos, sin [B, RH] fp32."""
    t = tl.program_id(0).to(tl.int64)
    slot, pos = tl.load(slot_ptr + t), tl.load(pos_ptr + t)
    c, j = tl.arange(0, DP), tl.arange(0, RH)
    x = tl.load(kv_ptr + t * row + c, mask=c < d, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, 0) / d + eps)
    dt = win_ptr.dtype.element_ty
    dst = win_ptr + (slot * W + pos % W) * d
    tl.store(dst + c, (x * r * tl.load(w_ptr + c, mask=c < d, other=0.0)).to(dt), mask=c < d - 2 * RH)  # no rotation
    even = d - 2 * RH + 2 * j
    x0 = (tl.load(kv_ptr + t * row + even).to(tl.float32) * r * tl.load(w_ptr + even)).to(dt).to(tl.float32)
    x1 = (tl.load(kv_ptr + t * row + even + 1).to(tl.float32) * r * tl.load(w_ptr + even + 1)).to(dt).to(tl.float32)
    cos, sin = tl.load(cos_ptr + t * RH + j), tl.load(sin_ptr + t * RH + j)
    tl.store(dst + even, (x0 * cos - x1 * sin).to(dt))
    tl.store(dst + even + 1, (x0 * sin + x1 * cos).to(dt))
    tl.store(wpos_ptr + slot * W + pos % W, pos)


@torch.library.custom_op("nano_dsv4::window_kv", mutates_args=("win", "win_pos"))
def window_kv_triton(kv: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, win: torch.Tensor,
                     win_pos: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor, eps: float) -> None:
    """kv [B, d] (wkv's output, rows may be strided), weight [d] the norm's, cos, sin [B, rd/2] fp32, win [slots, W,
    d] and win_pos [slots, W] int64 the ring buffer (contiguous), slots, pos int64 [B]: each sequence's key into
    win[slots, pos % W], its position into win_pos."""
    B, d = kv.shape
    assert win.is_contiguous() and win_pos.is_contiguous() and win.dtype == kv.dtype, (win.dtype, kv.dtype)
    kv = kv if kv.stride(1) == 1 else kv.contiguous()
    cos, sin = cos.reshape(B, -1).float().contiguous(), sin.reshape(B, -1).float().contiguous()
    _window_kv[(B,)](kv, weight.float().contiguous(), cos, sin, win, win_pos, slots.contiguous(), pos.contiguous(),
                     kv.stride(0), win.shape[1], d, eps, RH=cos.shape[1], DP=triton.next_power_of_2(d), num_warps=4)


window_kv_triton.register_fake(lambda *args: None)


# ----------------------------------------------------------------------------- a decode step's compressor
# Each decode step adds one kv / score row to every sequence's partial compression window, and a sequence's window
# completes once every `ratio` tokens: then it is pooled into a compressed entry (a softmax over the window's rows of
# score + ape, per channel, times kv), which is normed and rotated (Compressor.finish) and written to the entries'
# cache; with ratio 4's overlap the window's first-half rows (ape added) become the next window's. As tensor ops
# (kv_cache.KVCache._compressor_step) that is the row writes, a pooling of every sequence's window kept only where
# complete (static shapes), the norm, the RoPE and the writes: ~10 kernels and ~10 us a compressor, 17 compressors a
# bench_2b step. Here one program takes a sequence: it writes its row and returns unless its
# window is complete, else it pools the window (two passes over its rows: their max, then the weighted sum, as the
# reference's softmax), norms, rotates and writes the entry, and rolls the overlap.

@_jit
def _pool(st_kv_ptr, st_score_ptr, prev_kv_ptr, prev_score_ptr, ape_ptr, slot, m, d, ch, OVERLAP: tl.constexpr,
          MP: tl.constexpr, BR: tl.constexpr):
    """Compressor.pool of cache row slot's window for channels ch (a vector; those < d): fp32, 0 past d."""
    cm = ch < d
    width = 2 * d if OVERLAP else d  # the cache's channels a row: the window's own are the second half with OVERLAP
    col = (d if OVERLAP else 0) + ch
    mx = tl.full(ch.shape, float("-inf"), tl.float32)
    r = tl.arange(0, MP)
    if OVERLAP:  # the window before's first-half rows, ape already added
        pat = (slot * m + r[:, None]) * d + ch[None, :]
        pm = (r < m)[:, None] & cm[None, :]
        pscore = tl.load(prev_score_ptr + pat, mask=pm, other=float("-inf"))
        mx = tl.maximum(mx, tl.max(pscore, 0))
    for r0 in range(0, m, BR):  # the row max
        rows = r0 + tl.arange(0, BR)
        rm = (rows < m)[:, None] & cm[None, :]
        s = tl.load(st_score_ptr + (slot * m + rows[:, None]) * width + col[None, :], mask=rm, other=float("-inf"))
        mx = tl.maximum(mx, tl.max(s + tl.load(ape_ptr + rows[:, None] * width + col[None, :], mask=rm, other=0.0), 0))
    mx = tl.where(cm, mx, 0.0)
    den, acc = tl.zeros(ch.shape, dtype=tl.float32), tl.zeros(ch.shape, dtype=tl.float32)
    if OVERLAP:
        p = tl.exp(pscore - mx[None, :])
        den, acc = tl.sum(p, 0), tl.sum(p * tl.load(prev_kv_ptr + pat, mask=pm, other=0.0), 0)
    for r0 in range(0, m, BR):  # the weighted sum
        rows = r0 + tl.arange(0, BR)
        rm = (rows < m)[:, None] & cm[None, :]
        at = (slot * m + rows[:, None]) * width + col[None, :]
        s = tl.load(st_score_ptr + at, mask=rm, other=float("-inf"))
        p = tl.exp(s + tl.load(ape_ptr + rows[:, None] * width + col[None, :], mask=rm, other=0.0) - mx[None, :])
        den += tl.sum(p, 0)
        acc += tl.sum(p * tl.load(st_kv_ptr + at, mask=rm, other=0.0), 0)
    return tl.where(cm, acc / tl.where(cm, den, 1.0), 0.0)


@_jit
def _compress_step(kv_ptr, score_ptr, st_kv_ptr, st_score_ptr, prev_kv_ptr, prev_score_ptr, ape_ptr, w_ptr, cos_ptr,
                   sin_ptr, out_ptr, slot_ptr, pos_ptr, row, m, d, n_out, eps, OVERLAP: tl.constexpr,
                   WP: tl.constexpr, DP: tl.constexpr, MP: tl.constexpr, BR: tl.constexpr, RH: tl.constexpr):
    """Sequence program_id(0): its kv, score rows ([B, width], `row` apart) to its window's row pos % m; if that
    completes the window, the pooled entry normed (weight w), rotated by cos, sin ([B, RH], the window's first
    position) into out[slot, pos // m] ([slots, n_out, d]), and with OVERLAP the window's first-half rows to prev."""
    t = tl.program_id(0).to(tl.int64)
    slot, pos = tl.load(slot_ptr + t), tl.load(pos_ptr + t)
    width = 2 * d if OVERLAP else d
    cw = tl.arange(0, WP)
    wm = cw < width
    at = (slot * m + pos % m) * width + cw
    tl.store(st_kv_ptr + at, tl.load(kv_ptr + t * row + cw, mask=wm, other=0.0), mask=wm)
    tl.store(st_score_ptr + at, tl.load(score_ptr + t * row + cw, mask=wm, other=0.0), mask=wm)
    if pos % m == m - 1:
        tl.debug_barrier()  # the row just written, read below by other threads of the program
        dt = out_ptr.dtype.element_ty
        c, j = tl.arange(0, DP), tl.arange(0, RH)
        x = _pool(st_kv_ptr, st_score_ptr, prev_kv_ptr, prev_score_ptr, ape_ptr, slot, m, d, c, OVERLAP, MP, BR)
        x = x.to(dt).to(tl.float32)  # Compressor.finish: the entry in the model's dtype, then its norm
        r = tl.rsqrt(tl.sum(x * x, 0) / d + eps)
        dst = out_ptr + (slot * n_out + pos // m) * d
        tl.store(dst + c, (x * r * tl.load(w_ptr + c, mask=c < d, other=0.0)).to(dt), mask=c < d - 2 * RH)
        even = d - 2 * RH + 2 * j  # RoPE's pairs: their channels pooled again (64 of bench_2b's 512)
        x0 = _pool(st_kv_ptr, st_score_ptr, prev_kv_ptr, prev_score_ptr, ape_ptr, slot, m, d, even, OVERLAP, MP, BR)
        x1 = _pool(st_kv_ptr, st_score_ptr, prev_kv_ptr, prev_score_ptr, ape_ptr, slot, m, d, even + 1, OVERLAP, MP,
                   BR)
        x0 = (x0.to(dt).to(tl.float32) * r * tl.load(w_ptr + even)).to(dt).to(tl.float32)
        x1 = (x1.to(dt).to(tl.float32) * r * tl.load(w_ptr + even + 1)).to(dt).to(tl.float32)
        cos, sin = tl.load(cos_ptr + t * RH + j), tl.load(sin_ptr + t * RH + j)
        tl.store(dst + even, (x0 * cos - x1 * sin).to(dt))
        tl.store(dst + even + 1, (x0 * sin + x1 * cos).to(dt))
        if OVERLAP:  # the window's first-half rows, ape added, become the next window's (after the pool's reads)
            tl.debug_barrier()
            rr = tl.arange(0, MP)
            rm = (rr < m)[:, None] & (c < d)[None, :]
            src = (slot * m + rr[:, None]) * width + c[None, :]
            dst2 = (slot * m + rr[:, None]) * d + c[None, :]
            tl.store(prev_kv_ptr + dst2, tl.load(st_kv_ptr + src, mask=rm, other=0.0), mask=rm)
            tl.store(prev_score_ptr + dst2, tl.load(st_score_ptr + src, mask=rm, other=0.0)
                     + tl.load(ape_ptr + rr[:, None] * width + c[None, :], mask=rm, other=0.0), mask=rm)


@torch.library.custom_op("nano_dsv4::compress_step", mutates_args=("st_kv", "st_score", "prev_kv", "prev_score", "out"))
def compress_step_triton(kv: torch.Tensor, score: torch.Tensor, st_kv: torch.Tensor, st_score: torch.Tensor,
                         prev_kv: torch.Tensor, prev_score: torch.Tensor, ape: torch.Tensor, weight: torch.Tensor,
                         cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor, slots: torch.Tensor,
                         pos: torch.Tensor, eps: float) -> None:
    """kv_cache.KVCache._compressor_step for one token a sequence: kv, score [B, coff*d] fp32 (the step's rows; may be
    strided), st_kv, st_score [slots, m, coff*d] the partial windows, prev_kv, prev_score [slots, m, d] (overlap, m
    4: the window before's first-half rows, ape added), ape [m, coff*d], weight [d] the norm's, cos, sin [B, rd/2]
    fp32 at each window's first position, out [slots, n, d] the entries (model dtype), slots, pos int64 [B]."""
    (B, width), (m, d) = kv.shape, (st_kv.shape[1], out.shape[2])
    assert all(t.is_contiguous() for t in (st_kv, st_score, prev_kv, prev_score, out)), "the caches, contiguous"
    kv, score = (t if t.stride(1) == 1 else t.contiguous() for t in (kv, score))
    assert kv.stride(0) == score.stride(0), (kv.stride(), score.stride())
    cos, sin = cos.reshape(B, -1).float().contiguous(), sin.reshape(B, -1).float().contiguous()
    MP = triton.next_power_of_2(m)
    _compress_step[(B,)](kv, score, st_kv, st_score, prev_kv, prev_score, ape.contiguous(), weight.float().contiguous(),
                         cos, sin, out, slots.contiguous(), pos.contiguous(), kv.stride(0), m, d, out.shape[1], eps,
                         OVERLAP=width == 2 * d, WP=triton.next_power_of_2(width), DP=triton.next_power_of_2(d),
                         MP=MP, BR=min(MP, COMPRESS_ROWS), RH=cos.shape[1], num_warps=4)


COMPRESS_ROWS = 16  # rows of the window a pooling pass loads at once
compress_step_triton.register_fake(lambda *args: None)
