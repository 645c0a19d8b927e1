"""
The router's Triton kernels, each beside the code it replaces (tests/test_routing_kernels.py checks that the two agree,
alone and in the model's forward; tests/test_kernel_builds.py compiles them for sm_90 and gfx950):

  - route_triton: the router without grad (moe.Gate.forward from its logits: scores, top-k, weights).
  - pair_order_triton: a decode step's (token, pick) pairs put in expert order (moe.expert_order's count);
    sort_pairs_triton: the same, with the pairs' rows and weights moved there (moe.dispatch on one rank).

All are torch.library custom ops, as mhc_triton.py's are. Without a GPU the package's __init__ turns on Triton's
interpreter before triton is imported.
"""
import torch

from . import _jit, tl, triton


# ----------------------------------------------------------------------------- a decode step's routing
# The router's scores, top-k and weights (moe.Gate.forward) are ~6 kernels a layer in a decode step (the
# scoring, torch.topk's gather and sort, the weights' gather and normalisation), and the count sort of the (token,
# pick) pairs by expert (moe.expert_order) with its counts and inverse two more. Here they are two kernels:
# route_triton takes 16 tokens a program, their logits rows in registers, and picks the top k by k passes of a
# row max (the lowest expert of equal scores first); pair_order_triton gives each pair its row in expert order by
# counting the pairs before it, and each expert its count.

ROUTE_BT = 16  # tokens a routing program
ORDER_BP, ORDER_BQ = 16, 1024  # an ordering program's pairs (or experts), and the pairs it compares them with at once


@_jit
def _log1p(y):
    """log(1 + y) for y >= 0 to a few roundings, small y included (Goldberg's form: log(u) * y / (u - 1))."""
    u = 1.0 + y
    return tl.where(u == 1.0, y, tl.log(u) * (y / tl.where(u == 1.0, 1.0, u - 1.0)))


@_jit
def _route(logits_ptr, table_ptr, ids_ptr, w_ptr, idx_ptr, N, E, row, scale, K: tl.constexpr, KP: tl.constexpr,
           EP: tl.constexpr, BT: tl.constexpr, FUNC: tl.constexpr, HASH: tl.constexpr, NORM: tl.constexpr):
    """Tokens program_id(0) * BT..: logits [N, E] fp32 (rows `row` apart) -> w [N, K] fp32, idx [N, K] int64. FUNC 0
    softmax, 1 sigmoid, 2 sqrt(softplus); HASH: idx = table[ids[t]] (table [vocab, K]), else the top K of score +
    table (the bias [E])."""
    t = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    e, j = tl.arange(0, EP), tl.arange(0, KP)
    tm, em = t < N, e < E
    x = tl.load(logits_ptr + tl.minimum(t, N - 1)[:, None] * row + e[None, :], mask=em[None, :], other=0.0)
    if FUNC == 0:  # (tokens past N: a copy of the last one, not stored)
        x = tl.where(em[None, :], x, float("-inf"))
        s = tl.exp(x - tl.max(x, 1)[:, None])
        s = s / tl.sum(s, 1)[:, None]
    elif FUNC == 1:
        s = tl.sigmoid(x)
    else:  # F.softplus: x above 20 as it is
        s = tl.sqrt(tl.where(x > 20.0, x, _log1p(tl.exp(tl.minimum(x, 20.0)))))
    s = tl.where(em[None, :], s, 0.0)
    if HASH:
        ids = tl.load(ids_ptr + t, mask=tm, other=0)
        idx = tl.load(table_ptr + ids[:, None] * K + j[None, :], mask=tm[:, None] & (j < K)[None, :], other=0)
    else:
        sel = tl.where(em[None, :], s + tl.load(table_ptr + e, mask=em, other=0.0)[None, :], float("-inf"))
        idx = tl.zeros([BT, KP], dtype=tl.int64)
        for k in tl.static_range(K):  # the highest score left, then out of the running
            top = tl.min(tl.where(sel == tl.max(sel, 1)[:, None], e[None, :], EP), 1)
            idx = tl.where(j[None, :] == k, top[:, None].to(tl.int64), idx)
            sel = tl.where(e[None, :] == top[:, None], float("-inf"), sel)
    w = tl.zeros([BT, KP], dtype=tl.float32)
    for k in tl.static_range(K):  # the picks' scores, in pick order
        pick = tl.sum(tl.where(j[None, :] == k, idx, 0), 1)
        w = tl.where(j[None, :] == k, tl.sum(tl.where(e[None, :] == pick[:, None], s, 0.0), 1)[:, None], w)
    if NORM:
        w = w / tl.sum(w, 1)[:, None]
    out = t[:, None] * K + j[None, :]
    om = tm[:, None] & (j < K)[None, :]
    tl.store(w_ptr + out, w * scale, mask=om)
    tl.store(idx_ptr + out, idx, mask=om)


@torch.library.custom_op("nano_dsv4::route", mutates_args=())
def route_triton(logits: torch.Tensor, table: torch.Tensor, ids: torch.Tensor, k: int, func: str, hash: bool,
                 norm: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """moe.Gate.forward from its logits [N, E] fp32: func the scoring ("softmax", "sigmoid", "sqrtsoftplus"),
    table the bias [E] or (hash) tid2eid [vocab, k], ids [N] the tokens (read by hash layers) -> weights [N, k] fp32
    (normalised if norm, times scale), expert ids [N, k] int64. The logits may be a slice of wider rows (the decode's
    fused projections): read in place."""
    N, E = logits.shape
    w, idx = logits.new_empty(N, k), ids.new_empty(N, k, dtype=torch.int64)
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    _route[(triton.cdiv(N, ROUTE_BT),)](logits, table.contiguous(), ids.contiguous(), w, idx, N, E, logits.stride(0),
                                        scale, K=k, KP=triton.next_power_of_2(k), EP=triton.next_power_of_2(E),
                                        BT=ROUTE_BT, FUNC=("softmax", "sigmoid", "sqrtsoftplus").index(func),
                                        HASH=hash, NORM=norm, num_warps=4)
    return w, idx


route_triton.register_fake(lambda logits, table, ids, k, *rest: (
    logits.new_empty(logits.shape[0], k), ids.new_empty(logits.shape[0], k, dtype=torch.int64)))


@_jit
def _pair_order(flat_ptr, order_ptr, inv_ptr, count_ptr, x_ptr, w_ptr, xs_ptr, ws_ptr, P, E, PAIR_PROGRAMS, K, D,
                BP: tl.constexpr, BQ: tl.constexpr, COPY: tl.constexpr, BLOCK_D: tl.constexpr):
    """Programs below PAIR_PROGRAMS: pairs p = program_id(0) * BP.. get row inv[p] = the pairs of lower experts plus
    those of p's expert before p, and order[inv[p]] = p; COPY: also xs[inv[p]] = x[p // K] ([N, D] rows) and
    ws[inv[p]] = w[p]. The others: experts e.. get count[e], their pairs. The other pairs are read BQ at a time: all
    of a decode step's in one load (up to ORDER_BQ)."""
    pid = tl.program_id(0)
    q0 = tl.arange(0, BQ)
    if pid < PAIR_PROGRAMS:
        p = pid * BP + tl.arange(0, BP)
        pm = p < P
        ep = tl.load(flat_ptr + p, mask=pm, other=0)
        row = tl.zeros([BP], dtype=tl.int32)
        for start in range(0, P, BQ):
            q = start + q0
            eq = tl.load(flat_ptr + q, mask=q < P, other=E)  # past the end: after every expert
            before = (eq[None, :] < ep[:, None]) | ((eq[None, :] == ep[:, None]) & (q[None, :] < p[:, None]))
            row += tl.sum(before.to(tl.int32), 1)
        tl.store(inv_ptr + p, row.to(tl.int64), mask=pm)
        tl.store(order_ptr + row, p.to(tl.int64), mask=pm)
        if COPY:  # the pairs' rows and weights, where dispatch's gathers put them
            tl.store(ws_ptr + row, tl.load(w_ptr + p, mask=pm, other=0.0), mask=pm)
            src, dst, d = (p // K).to(tl.int64) * D, row.to(tl.int64) * D, tl.arange(0, BLOCK_D)
            for d0 in range(0, D, BLOCK_D):
                m = pm[:, None] & (d0 + d < D)[None, :]
                tl.store(xs_ptr + dst[:, None] + d0 + d[None, :], tl.load(x_ptr + src[:, None] + d0 + d[None, :],
                                                                            mask=m, other=0.0), mask=m)
    else:
        e = (pid - PAIR_PROGRAMS) * BP + tl.arange(0, BP)
        n = tl.zeros([BP], dtype=tl.int32)
        for start in range(0, P, BQ):
            q = start + q0
            eq = tl.load(flat_ptr + q, mask=q < P, other=E)
            n += tl.sum((eq[None, :] == e[:, None]).to(tl.int32), 1)
        tl.store(count_ptr + e, n.to(tl.int64), mask=e < E)


def _order(flat, n_experts, copy=None):
    """Launch _pair_order on flat [P] expert ids: order, inv, counts; copy: (x [N, D], w [N, K] fp32, xs, ws) to
    fill."""
    P = flat.shape[0]
    order, inv, counts = flat.new_empty(P), flat.new_empty(P), flat.new_empty(n_experts)
    x, w, xs, ws = copy or (flat, flat, flat, flat)  # not read without COPY
    K, D = (w.shape[1], x.shape[1]) if copy else (1, 1)
    pair_programs = triton.cdiv(P, ORDER_BP)
    _pair_order[(pair_programs + triton.cdiv(n_experts, ORDER_BP),)](
        flat.contiguous(), order, inv, counts, x, w, xs, ws, P, n_experts, pair_programs, K, D, BP=ORDER_BP,
        BQ=min(ORDER_BQ, triton.next_power_of_2(P)), COPY=copy is not None,
        BLOCK_D=min(1024, triton.next_power_of_2(D)), num_warps=4)
    return order, inv, counts


@torch.library.custom_op("nano_dsv4::pair_order", mutates_args=())
def pair_order_triton(flat: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """moe.expert_order's count sort: flat [P] int64 expert ids -> order [P], inv [P], counts [n_experts]."""
    return _order(flat, n_experts)


pair_order_triton.register_fake(lambda flat, n_experts: (torch.empty_like(flat), torch.empty_like(flat),
                                                          flat.new_empty(n_experts)))


@torch.library.custom_op("nano_dsv4::sort_pairs", mutates_args=())
def sort_pairs_triton(x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, n_experts: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """moe.dispatch on one rank for a decode step: x [N, D], weights [N, K] fp32, idx [N, K] int64 expert ids
    -> the pairs' rows xs [N * K, D] and weights ws [N * K] in expert order, order, inv, counts [n_experts]."""
    x, weights = x.contiguous(), weights.float().contiguous()
    xs, ws = x.new_empty(idx.numel(), x.shape[1]), weights.new_empty(idx.numel())
    return xs, ws, *_order(idx.flatten(), n_experts, (x, weights, xs, ws))


sort_pairs_triton.register_fake(lambda x, weights, idx, n_experts: (
    x.new_empty(idx.numel(), x.shape[1]), weights.new_empty(idx.numel(), dtype=torch.float32),
    idx.new_empty(idx.numel()), idx.new_empty(idx.numel()), idx.new_empty(n_experts)))
