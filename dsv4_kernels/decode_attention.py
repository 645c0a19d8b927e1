"""
The engine's decode attention as Triton kernels (kv_cache.KVCache._attn_decode calls decode_attention_triton), beside
the reference it replaces: model_dsv4.sink_attention over each sequence's cached window keys and compressed entries,
gathered, then Attention.output's RoPE undone. tests/test_decode_attention.py checks that the two agree, alone and in
the engine; tests/test_kernel_builds.py compiles the kernels for sm_90 and gfx950.

A torch.library custom op, as mhc_triton.py's are (compiled layers call it). Without a GPU the package's __init__
turns on Triton's interpreter before triton is imported.
"""
from typing import Optional

import torch

from . import INTERPRETED, _dot, _jit, tl, triton


# ----------------------------------------------------------------------------- decode attention
# A decode step attends one query token per sequence (H heads, one shared K = V head of dim d) to the sequence's cached
# window keys and compressed entries. As tensor ops that is a gather of each sequence's keys from its cache slot and a
# concatenation (written out, fp32), an fp32 GEMM on it, the masked softmax and a bf16 GEMM: ~100 us of a CSA layer
# of bench_2b at batch 64 on an H200, ~40 us of a window or HCA layer. Here a program takes a sequence and 16 heads
# and reads its keys where they are, a block at a time, skipping blocks with no key to attend (compressed entries not
# yet written, or not picked by the indexer): 8-17 us a layer. Two passes over the keys, so that the probabilities
# are the reference's, rounded to the keys' dtype after the division: the row max and denominator (online), then the
# probabilities times the keys.
# At batch 64 that is only 64 programs on an H200's 132 SMs, each looping over its keys' blocks one after another.
# So where a sequence has more blocks of keys than DECODE_SPLIT_BLOCKS, several programs share them (blocks split,
# split + splits, ...): each finds its blocks' max and denominator, then, in a second kernel, takes every split's to
# the row's and writes its blocks' share of the output, in fp32; a third adds the shares in split order.
# The output is rounded, and RoPE undone on its last dims, as Attention.output does it (so the engine rounds where
# the trainer does). Which keys a sequence attends the kernel works out from the window's positions and the
# sequence's own, rather than read a [B, W + S] mask that would take an inductor kernel a layer to build.

HEADS = 16  # heads a program: tl.dot's smallest M


@_jit
def _decode_keep(wpos_ptr, cmask_ptr, b, slot, pos, n_vis, start, W, L, BLOCK_N: tl.constexpr, CMASK: tl.constexpr):
    """Which of keys start.. start+BLOCK_N-1 sequence b (cache row slot, at position pos) attends, and whether any:
    window key n where its position win_pos[slot, n] is in (pos - W, pos]; compressed entry j = n - W where
    j < n_vis (its whole window at or before pos) and, with CMASK, cmask[b, j] (the indexer's pick; L - W a row)."""
    n = start + tl.arange(0, BLOCK_N)
    wp = tl.load(wpos_ptr + slot * W + n, mask=n < W, other=-1)
    keep = (n < W) & (wp >= 0) & (wp > pos - W) & (wp <= pos)
    j = n - W
    cm = (n >= W) & (n < L) & (j < n_vis)
    if CMASK:
        cm = cm & (tl.load(cmask_ptr + b * (L - W) + j, mask=cm, other=0) != 0)
    keep = keep | cm
    return n, keep, tl.max(keep.to(tl.int32), 0) > 0


@_jit
def _decode_block(q, win_ptr, comp_ptr, slot, n, keep, W, D, n_comp, scale, d, dm, F32: tl.constexpr):
    """Keys n of cache row slot (the window's W, then the compressed entries), those kept loaded (the rest 0):
    (keys [BLOCK_N, DP], logits [HEADS, BLOCK_N] fp32, -inf where not kept)."""
    rows = tl.where(n < W, win_ptr + (slot * W + n) * D, comp_ptr + (slot * n_comp + n - W) * D)
    k = tl.load(rows[:, None] + d[None, :], mask=keep[:, None] & dm[None, :], other=0.0)
    return k, tl.where(keep[None, :], _dot(q, tl.trans(k), F32) * scale, float("-inf"))


@_jit
def _decode_seq(q_ptr, sink_ptr, slot_ptr, pos_ptr, b, hg, H, D, ratio, HEADS: tl.constexpr, DP: tl.constexpr):
    """A program's sequence b and heads hg * HEADS on: (h, d, their masks, q [HEADS, DP], sink [HEADS], slot, its
    position, its visible compressed entries: (pos + 1) // ratio)."""
    h, d = hg * HEADS + tl.arange(0, HEADS), tl.arange(0, DP)
    hm, dm = h < H, d < D
    q = tl.load(q_ptr + (b * H + h[:, None]) * D + d[None, :], mask=hm[:, None] & dm[None, :], other=0.0)
    pos = tl.load(pos_ptr + b)
    return (h, d, hm, dm, q, tl.load(sink_ptr + h, mask=hm, other=0.0), tl.load(slot_ptr + b).to(tl.int64), pos,
            (pos + 1) // ratio)


@_jit
def _decode_stats(q, win_ptr, comp_ptr, wpos_ptr, cmask_ptr, b, slot, pos, n_vis, first, L, W, D, n_comp, scale, d,
                  dm, STEP, HEADS: tl.constexpr, BLOCK_N: tl.constexpr, F32: tl.constexpr, CMASK: tl.constexpr):
    """The first pass over key blocks first, first + STEP, ... (to the sequence's last visible compressed entry:
    the caches' later rows are never attended): the row max and denominator [HEADS] of their kept keys' logits,
    online (-inf and 0 where none is kept)."""
    mx, den = tl.full([HEADS], float("-inf"), tl.float32), tl.zeros([HEADS], dtype=tl.float32)
    for start in range(first * BLOCK_N, tl.minimum(L, W + n_vis).to(tl.int32), STEP * BLOCK_N):  # to the last visible
        n, keep, some = _decode_keep(wpos_ptr, cmask_ptr, b, slot, pos, n_vis, start, W, L, BLOCK_N, CMASK)
        if some:
            k, logits = _decode_block(q, win_ptr, comp_ptr, slot, n, keep, W, D, n_comp, scale, d, dm, F32)
            new = tl.maximum(mx, tl.max(logits, 1))
            den = den * tl.exp(mx - new) + tl.sum(tl.exp(logits - new[:, None]), 1)
            mx = new
    return mx, den


@_jit
def _decode_pv(q, win_ptr, comp_ptr, wpos_ptr, cmask_ptr, b, slot, pos, n_vis, first, L, W, D, n_comp, scale, d, dm,
               STEP, mx, den, HEADS: tl.constexpr, DP: tl.constexpr, BLOCK_N: tl.constexpr, F32: tl.constexpr,
               CMASK: tl.constexpr):
    """The second pass over the same blocks: the probabilities (the whole row's max and denominator, the sink in
    both), rounded to the keys' dtype, times the keys: fp32 [HEADS, DP]."""
    acc = tl.zeros([HEADS, DP], dtype=tl.float32)
    for start in range(first * BLOCK_N, tl.minimum(L, W + n_vis).to(tl.int32), STEP * BLOCK_N):
        n, keep, some = _decode_keep(wpos_ptr, cmask_ptr, b, slot, pos, n_vis, start, W, L, BLOCK_N, CMASK)
        if some:
            k, logits = _decode_block(q, win_ptr, comp_ptr, slot, n, keep, W, D, n_comp, scale, d, dm, F32)
            p = tl.exp(logits - mx[:, None]) / den[:, None]
            acc += _dot(p.to(k.dtype), k, F32)
    return acc


@_jit
def _finish(acc, cos_ptr, sin_ptr, b, D, dt, HEADS: tl.constexpr, DP: tl.constexpr, RH: tl.constexpr):
    """The output acc [HEADS, DP] fp32 rounded to dt, and with RH, RoPE undone on the last 2 * RH of its D dims as
    Attention.output does it (apply_rope with -sin: the pairs (2i, 2i + 1) of the rounded output turned back in fp32
    by sequence b's angles, cos, sin [B, RH] fp32, and rounded again): the engine rounds where the trainer does."""
    acc = acc.to(dt)
    if RH:
        a0, a1 = tl.split(tl.reshape(acc.to(tl.float32), [HEADS, DP // 2, 2]))
        k = tl.arange(0, DP // 2) - (D // 2 - RH)  # the pair's index among the rotated ones
        on = (k >= 0) & (k < RH)
        c = tl.load(cos_ptr + b * RH + k, mask=on, other=1.0)[None, :]
        s = tl.load(sin_ptr + b * RH + k, mask=on, other=0.0)[None, :]
        acc = tl.reshape(tl.join(a0 * c + a1 * s, a1 * c - a0 * s), [HEADS, DP]).to(dt)
    return acc


@_jit
def _decode_attn(q_ptr, win_ptr, comp_ptr, slot_ptr, wpos_ptr, pos_ptr, cmask_ptr, sink_ptr, cos_ptr, sin_ptr, out_ptr,
                 scale, H, D, W, S, n_comp, ratio, HEADS: tl.constexpr, DP: tl.constexpr, BLOCK_N: tl.constexpr,
                 F32: tl.constexpr, RH: tl.constexpr, CMASK: tl.constexpr):
    """Sequence program_id(0), heads program_id(1) * HEADS on: q [HEADS, DP] against the L = W + S keys it attends
    (_decode_keep), and the sink; both passes over all of its keys. RH: RoPE undone on the output's last 2 * RH dims
    (0: not)."""
    b = tl.program_id(0).to(tl.int64)
    h, d, hm, dm, q, sink, slot, pos, n_vis = _decode_seq(q_ptr, sink_ptr, slot_ptr, pos_ptr, b, tl.program_id(1), H, D,
                                                          ratio, HEADS, DP)
    mx, den = _decode_stats(q, win_ptr, comp_ptr, wpos_ptr, cmask_ptr, b, slot, pos, n_vis, 0, W + S, W, D, n_comp,
                            scale, d, dm, 1, HEADS, BLOCK_N, F32, CMASK)
    top = tl.maximum(mx, sink)  # the sink is in the row max and the denominator
    den = den * tl.exp(mx - top) + tl.exp(sink - top)
    acc = _decode_pv(q, win_ptr, comp_ptr, wpos_ptr, cmask_ptr, b, slot, pos, n_vis, 0, W + S, W, D, n_comp, scale,
                     d, dm, 1, top, den, HEADS, DP, BLOCK_N, F32, CMASK)
    tl.store(out_ptr + (b * H + h[:, None]) * D + d[None, :],
             _finish(acc, cos_ptr, sin_ptr, b, D, out_ptr.dtype.element_ty, HEADS, DP, RH),
             mask=hm[:, None] & dm[None, :])


@_jit
def _decode_attn_stats(q_ptr, win_ptr, comp_ptr, slot_ptr, wpos_ptr, pos_ptr, cmask_ptr, sink_ptr, cos_ptr, sin_ptr,
                       stats_ptr, scale, H, D, W, S, n_comp, ratio, SPLITS, HEADS: tl.constexpr, DP: tl.constexpr,
                       BLOCK_N: tl.constexpr, F32: tl.constexpr, RH: tl.constexpr, CMASK: tl.constexpr):
    """Split program_id(2) of the keys (blocks split, split + SPLITS, ...): its max and denominator to stats
    [B, SPLITS, 2, H]."""
    b, split = tl.program_id(0).to(tl.int64), tl.program_id(2)
    h, d, hm, dm, q, sink, slot, pos, n_vis = _decode_seq(q_ptr, sink_ptr, slot_ptr, pos_ptr, b, tl.program_id(1), H, D,
                                                          ratio, HEADS, DP)
    mx, den = _decode_stats(q, win_ptr, comp_ptr, wpos_ptr, cmask_ptr, b, slot, pos, n_vis, split, W + S, W, D,
                            n_comp, scale, d, dm, SPLITS, HEADS, BLOCK_N, F32, CMASK)
    row = stats_ptr + ((b * SPLITS + split) * 2) * H + h
    tl.store(row, mx, mask=hm)
    tl.store(row + H, den, mask=hm)


@_jit
def _decode_attn_part(q_ptr, win_ptr, comp_ptr, slot_ptr, wpos_ptr, pos_ptr, cmask_ptr, sink_ptr, cos_ptr, sin_ptr,
                      stats_ptr, part_ptr, scale, H, D, W, S, n_comp, ratio, SPLITS, B, HEADS: tl.constexpr,
                      DP: tl.constexpr, SP: tl.constexpr, BLOCK_N: tl.constexpr, F32: tl.constexpr, RH: tl.constexpr,
                      CMASK: tl.constexpr):
    """Split program_id(2) again: the whole row's max and denominator from every split's stats (added in split
    order), then its blocks' share of the output, fp32, to part [SPLITS, B, H, D]."""
    b, split = tl.program_id(0).to(tl.int64), tl.program_id(2)
    h, d, hm, dm, q, sink, slot, pos, n_vis = _decode_seq(q_ptr, sink_ptr, slot_ptr, pos_ptr, b, tl.program_id(1), H, D,
                                                          ratio, HEADS, DP)
    sp = tl.arange(0, SP)
    at = stats_ptr + ((b * SPLITS + sp[:, None]) * 2) * H + h[None, :]
    sm = (sp < SPLITS)[:, None] & hm[None, :]
    mxs, dens = tl.load(at, mask=sm, other=float("-inf")), tl.load(at + H, mask=sm, other=0.0)  # [SP, HEADS]
    top = tl.maximum(tl.max(mxs, 0), sink)
    den = tl.sum(dens * tl.exp(mxs - top[None, :]), 0) + tl.exp(sink - top)
    acc = _decode_pv(q, win_ptr, comp_ptr, wpos_ptr, cmask_ptr, b, slot, pos, n_vis, split, W + S, W, D, n_comp,
                     scale, d, dm, SPLITS, top, den, HEADS, DP, BLOCK_N, F32, CMASK)
    tl.store(part_ptr + ((split * B + b) * H + h[:, None]) * D + d[None, :], acc, mask=hm[:, None] & dm[None, :])


@_jit
def _decode_attn_sum(part_ptr, cos_ptr, sin_ptr, out_ptr, B, H, D, SPLITS, HEADS: tl.constexpr, DP: tl.constexpr,
                     RH: tl.constexpr):
    """Sequence program_id(0), heads program_id(1) * HEADS on: the splits' shares (part [SPLITS, B, H, D] fp32)
    added in split order, finished as one program's output (_finish) into out [B, H, D]."""
    b = tl.program_id(0).to(tl.int64)
    h, d = tl.program_id(1) * HEADS + tl.arange(0, HEADS), tl.arange(0, DP)
    m = (h < H)[:, None] & (d < D)[None, :]
    acc = tl.zeros([HEADS, DP], dtype=tl.float32)
    for split in range(SPLITS):
        acc += tl.load(part_ptr + ((split * B + b) * H + h[:, None]) * D + d[None, :], mask=m, other=0.0)
    tl.store(out_ptr + (b * H + h[:, None]) * D + d[None, :],
             _finish(acc, cos_ptr, sin_ptr, b, D, out_ptr.dtype.element_ty, HEADS, DP, RH), mask=m)


@torch.library.custom_op("nano_dsv4::decode_attention", mutates_args=())
def decode_attention_triton(q: torch.Tensor, win: torch.Tensor, win_pos: torch.Tensor, comp: Optional[torch.Tensor],
                            slots: torch.Tensor, pos: torch.Tensor, ratio: int, sink: torch.Tensor, scale: float,
                            cos: Optional[torch.Tensor] = None, sin: Optional[torch.Tensor] = None,
                            cmask: Optional[torch.Tensor] = None, splits: int = 0) -> torch.Tensor:
    """sink_attention for one query token per sequence, reading its keys from the caches: q [B, H, d]; win
    [slots, W, d] and win_pos [slots, W] int64 the window's ring buffer and its keys' positions (-1: none), comp
    [slots, n, d] (or None) the compressed entries (contiguous, q's dtype: bf16, or fp32 for the tests), slots [B]
    each sequence's row, pos [B] int64 its position; sink [H] fp32 -> [B, H, d] in q's dtype. The keys attended, as
    KVCache._attn_decode's mask has them: window keys whose position is in (pos - W, pos]; compressed entries j <
    (pos + 1) // ratio (ratio: the compressor's; their whole window is at or before pos), and with cmask [B, S] bool
    only where it is set (the indexer's picks: then only the first S entries). cos, sin [B, rd/2] fp32 (or None): the
    output with RoPE undone on its last rd dims, as Attention.output does first, with the same roundings. splits:
    programs a sequence's keys are split over (0: decode_splits' choice)."""
    B, H, D = q.shape
    W = win.shape[1]
    S = 0 if comp is None else cmask.shape[1] if cmask is not None else comp.shape[1]
    L = W + S
    comp = win if comp is None else comp  # not read: S = 0
    assert win.is_contiguous() and comp.is_contiguous() and win_pos.is_contiguous(), "the caches, contiguous"
    assert q.dtype == win.dtype == comp.dtype, (q.dtype, win.dtype, comp.dtype)
    assert q.dtype in (torch.bfloat16, torch.float32), q.dtype
    assert S == 0 or ratio > 0, "compressed entries need their compress ratio"
    splits = splits or decode_splits(L, B * triton.cdiv(H, HEADS))
    cos, sin = (sink, sink) if cos is None else (t.reshape(B, -1).float().contiguous() for t in (cos, sin))
    cm = win_pos if cmask is None else cmask.contiguous().view(torch.uint8)  # not read without cmask
    args = (q.contiguous(), win, comp, slots.contiguous(), win_pos, pos.contiguous(), cm, sink.float().contiguous(),
            cos, sin)
    sizes = (scale, H, D, W, S, comp.shape[1], max(ratio, 1))
    meta = dict(HEADS=HEADS, DP=triton.next_power_of_2(D), BLOCK_N=DECODE_BLOCK_N,
                F32=INTERPRETED or q.dtype == torch.float32, RH=0 if cos is sink else cos.shape[1],
                CMASK=cmask is not None, num_warps=4)
    if splits == 1:
        out = torch.empty_like(q)
        _decode_attn[(B, triton.cdiv(H, HEADS))](*args, out, *sizes, **meta)
        return out
    grid = (B, triton.cdiv(H, HEADS), splits)
    stats = q.new_empty(B, splits, 2, H, dtype=torch.float32)
    _decode_attn_stats[grid](*args, stats, *sizes, splits, **meta)
    part = q.new_empty(splits, B, H, D, dtype=torch.float32)
    _decode_attn_part[grid](*args, stats, part, *sizes, splits, B, SP=triton.next_power_of_2(splits), **meta)
    out = torch.empty_like(q)
    _decode_attn_sum[grid[:2]](part, cos, sin, out, B, H, D, splits, HEADS=HEADS, DP=meta["DP"], RH=meta["RH"],
                               num_warps=4)
    return out


def decode_splits(L, programs):
    """Programs a sequence's L keys are split over, where the step has `programs` programs of one: up to
    DECODE_PROGRAMS in all (an H200 has 132 SMs), one for every DECODE_SPLIT_BLOCKS blocks of keys, at most
    DECODE_MAX_SPLITS. On an H200, a CSA layer mid-generation (264 keys) at batch 64 takes 46 us in one program a
    sequence, 38 in 2, 34 in 3; at batch 256 splitting is slower (77 us, 97 in 2)."""
    return max(1, min(DECODE_MAX_SPLITS, triton.cdiv(L, DECODE_BLOCK_N) // DECODE_SPLIT_BLOCKS,
                      DECODE_PROGRAMS // programs))


DECODE_BLOCK_N, DECODE_SPLIT_BLOCKS, DECODE_MAX_SPLITS, DECODE_PROGRAMS = 32, 4, 4, 192
decode_attention_triton.register_fake(lambda q, *rest, **kw: torch.empty_like(q))
