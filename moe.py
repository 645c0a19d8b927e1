"""
DeepSeek-V4's MoE layer with expert parallelism: the router (Gate: learned sqrt-softplus scores, or a fixed hash table
for the first layers), clamped SwiGLU experts, one shared expert, and the EP all-to-all that carries each (token,
expert) pair to the rank holding the expert and back (dispatch / combine). Every V4 layer's FFN is this module.

Shape legend: N tokens on this rank, D hidden, E routed experts, K experts per token, P = N * K (token, pick) pairs,
R rows this rank's experts receive, e (n_local) experts on this rank.
"""
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from dsv4_kernels import has_triton
from dsv4_kernels.fast import grouped_experts, linear_f32
from dsv4_kernels.route import pair_order_triton, route_triton, sort_pairs_triton
from quant import FP8Linear, act_quant_sim, fp8_grouped_mm


def grouped_mm_fp8_emu(rows, w, offs, parts=1):
    """The FP8 engine's routed experts (fp8_emu): FP8 activations into the grouped GEMM, the weights as the server
    holds them (dequantized FP8, exact), as Expert's FP8Linears compute them one expert at a time."""
    return torch._grouped_mm(act_quant_sim(rows), w.transpose(1, 2), offs=offs)


class Gate(nn.Module):
    """Router. Learned layers pick top-k of (score + bias); the bias steers selection only.
    Hash layers (layer_id < num_hash_layers) pick tid2eid[token_id]; the learned scores still weight them."""
    def __init__(self, layer_id, args):
        super().__init__()
        self.args, self.hash = args, layer_id < args.num_hash_layers
        E, K = args.n_routed_experts, args.num_experts_per_tok
        self.weight = nn.Parameter(torch.empty(E, args.hidden_size))
        # Buffers, not parameters: neither gets a gradient. Both are saved and synced (a zero tid2eid is a
        # different model). bias is moved by load balancing, which RL leaves frozen.
        if self.hash:
            self.register_buffer("tid2eid", torch.zeros(args.vocab_size, K, dtype=torch.int64))
        else:
            self.register_buffer("bias", torch.zeros(E, dtype=torch.float32))

    def forward(self, x, ids, logits=None, fast=False, replay=None, stats=None):
        # x: [N, D], ids: [N] -> weights [N, K] fp32, expert ids [N, K]; logits: linear_f32(x, weight) if computed.
        # replay [N, K] (R3, replay.py): the experts the rollout engine routed each token to, taken instead of this
        # router's picks; a row of -1 (padding, a sequence's last token) is routed here. The weights stay this
        # router's scores, at the replayed experts, so it still learns. stats (float [2]) <- (replayed rows whose
        # expert set this router would pick otherwise, replayed rows): train_grpo's routing_disagree.
        logits = linear_f32(x, self.weight) if logits is None else logits
        f, a = self.args.scoring_func, self.args
        if fast and replay is None and has_triton(logits) and not torch.is_grad_enabled():  # no grad, GPU: one kernel
            return route_triton(logits, self.tid2eid if self.hash else self.bias, ids, a.num_experts_per_tok, f,
                                self.hash, a.norm_topk_prob, a.routed_scaling_factor)
        if f == "softmax":
            scores = logits.softmax(-1)
        elif f == "sigmoid":
            scores = logits.sigmoid()
        else:
            scores = F.softplus(logits).sqrt()
        if self.hash:
            idx = self.tid2eid[ids]
        else:
            idx = (scores + self.bias).topk(self.args.num_experts_per_tok, dim=-1).indices
        if replay is not None:
            given = replay[:, :1] >= 0
            own, idx = idx, torch.where(given, replay.long(), idx)
            if stats is not None:  # sets, not lists: topk orders by score, the engine's order is its own
                differ = (own.sort(-1).values != idx.sort(-1).values).any(-1)
                stats.copy_(torch.stack([differ.sum(), given.sum()]))
        w = scores.gather(1, idx)
        if self.args.norm_topk_prob:
            w = w / w.sum(dim=-1, keepdim=True)
        return w * self.args.routed_scaling_factor, idx


class Expert(nn.Module):
    """SwiGLU with a clamp: gate clamped from above, up on both sides; the routing weight multiplies
    before w2, in fp32 (reference order)."""
    def __init__(self, dim, inter_dim, limit):
        super().__init__()
        self.limit = limit
        self.w1 = FP8Linear(dim, inter_dim, bias=False)
        self.w2 = FP8Linear(inter_dim, dim, bias=False)
        self.w3 = FP8Linear(dim, inter_dim, bias=False)

    def forward(self, x, weights=None):
        g, u = self.w1(x).float(), self.w3(x).float()
        if self.limit:
            g, u = g.clamp(max=self.limit), u.clamp(-self.limit, self.limit)
        h = F.silu(g) * u
        if weights is not None:
            h = h * weights[:, None]
        return self.w2(h.to(x.dtype))


def group_size(group):
    return dist.get_world_size(group) if group is not None else 1


def all_to_all_single(out, x, out_splits, in_splits, group):
    """dist.all_to_all_single that names the group and op when it fails (a dead or mismatched peer)."""
    try:
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    except RuntimeError as e:
        raise RuntimeError(f"EP all_to_all_single on ranks {dist.get_process_group_ranks(group)} "
                           f"failed on rank {dist.get_rank()}: {e}") from e
    return out


class AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits; the backward sends the gradients back the way they came."""
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return all_to_all_single(x.new_empty((sum(out_splits), *x.shape[1:])), x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return AllToAll.apply(grad, in_splits, out_splits, ctx.group), None, None, None


def all_to_all(x, out_splits, in_splits, group):
    return AllToAll.apply(x, out_splits, in_splits, group) if group_size(group) > 1 else x


def dispatch(x, weights, idx, n_local, group, count=False, fast=False):
    """Send every (token, expert) pair to the rank holding the expert; experts are sharded in contiguous
    blocks of n_local over the EP group. x: [N, D], weights/idx: [N, K] ->
    rows xs [R, D] and weights ws [R] grouped by local expert, counts per local expert, and what combine needs."""
    ep = group_size(group)
    if ep == 1 and count and fast and has_triton(x) and not torch.is_grad_enabled():  # decode: one Triton kernel
        xs, ws, order, inv, send = sort_pairs_triton(x, weights, idx, n_local)
        return xs, ws, send, (order, inv, None, None, None)
    flat = idx.flatten()
    order, inv, send = expert_order(flat, n_local * ep, count, fast)  # pairs sorted by expert, hence by rank
    xs = Picks.apply(x, order, inv, idx.shape[1])  # [N * K, D]: row r is token order[r] // K
    if ep == 1:  # nothing to exchange: the counts stay on the device (no host sync)
        return xs, weights.flatten()[order], send, (order, inv, None, None, None)
    recv = send
    if ep > 1:  # recv[r * n_local + j]: pairs rank r sends to my local expert j
        recv = all_to_all_single(torch.empty_like(send), send, None, None, group)
    send_splits = send.view(ep, n_local).sum(1).tolist()  # device -> host sync: the split sizes
    recv_splits = recv.view(ep, n_local).sum(1).tolist()
    xs = all_to_all(xs, recv_splits, send_splits, group)  # [R, D], source-rank-major
    ws = all_to_all(weights.flatten()[order], recv_splits, send_splits, group)
    # regroup the received rows from (source rank, expert) order to (expert, source rank) order
    chunks = torch.arange(xs.shape[0], device=x.device).split(recv.tolist())
    perm = torch.cat([chunks[r * n_local + j] for j in range(n_local) for r in range(ep)])
    counts = recv.view(ep, n_local).sum(0).tolist()
    return xs[perm], ws[perm], counts, (order, inv, perm, send_splits, recv_splits)


def combine(ys, ctx, n_tokens, top_k, group):
    """The exact reverse of dispatch: ys [R, D] (grouped by local expert) -> fp32 [N, D], summed over top-k."""
    order, inv, perm, send_splits, recv_splits = ctx
    out = ys
    if perm is not None:
        ys = ys[torch.argsort(perm)]  # back to (source rank, expert) order
        out = all_to_all(ys, send_splits, recv_splits, group)  # back home, in `order`
    return PickSum.apply(out, order, inv, top_k)


# The (token, pick) pairs sorted by expert: row r is pair order[r] (token order[r] // K, its pick order[r] % K), and
# pair p is row inv[p]. dispatch's copy of each token's row once per pick and combine's sum of a token's K rows are
# each other's transpose, so each one's backward is the other's forward: gathers both ways, where autograd's backward
# of an index scatters with atomics into zeros, in no fixed order.

def inverse_permutation(order):
    return torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))


def expert_order(flat, n_experts, count=False, fast=False):
    """(order, inv) of the pairs' expert ids flat [P] sorted stably, and the pairs per expert [n_experts]
    (scatter_add, not bincount, which reads the max id back to the host). The sort is a radix sort on the narrowest
    key that holds an id (a GPU's takes one pass per byte of key). count (a decode step's few hundred pairs): pair p's
    row is the number of pairs of lower experts plus its own expert's pairs before it, from an [E, P] table, which
    compiles to one kernel (fast, without grad on a GPU: dsv4_kernels.route.pair_order_triton). All give one order."""
    if count and fast and has_triton(flat) and not torch.is_grad_enabled():
        return pair_order_triton(flat, n_experts)
    per = torch.zeros(n_experts, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    if not count:
        order = flat.to(torch.uint8 if n_experts <= 256 else torch.int32).argsort(stable=True)
        return order, inverse_permutation(order), per
    hit = (flat[None, :] == torch.arange(n_experts, device=flat.device)[:, None]).long()  # [E, P]
    before = per.cumsum(0) - per  # pairs of lower experts
    inv = before[flat] + (hit.cumsum(1) - hit).gather(0, flat[None, :])[0]
    return inverse_permutation(inv), inv, per


def spread_rows(x, order, k):
    """x [N, D] -> [N * K, D]: token order[r] // K's row in row r."""
    return x[order // k]


def sum_picks(rows, inv, k):
    """rows [N * K, D] in sorted order -> [N, D] in fp32 (or fp64 rows' fp64): each token's K rows back in pair order,
    summed in a fixed order (its picks 0 .. K - 1)."""
    return rows[inv].view(-1, k, rows.shape[-1]).sum(1, dtype=torch.promote_types(rows.dtype, torch.float32))


class Picks(torch.autograd.Function):
    """spread_rows with sum_picks as its backward."""
    @staticmethod
    def forward(ctx, x, order, inv, k):
        ctx.save_for_backward(inv)
        ctx.k = k
        return spread_rows(x, order, k)

    @staticmethod
    def backward(ctx, grad):
        return sum_picks(grad, ctx.saved_tensors[0], ctx.k).to(grad.dtype), None, None, None


class PickSum(torch.autograd.Function):
    """sum_picks with spread_rows as its backward."""
    @staticmethod
    def forward(ctx, rows, order, inv, k):
        ctx.save_for_backward(order)
        ctx.k, ctx.dtype = k, rows.dtype
        return sum_picks(rows, inv, k)

    @staticmethod
    def backward(ctx, grad):
        return spread_rows(grad, ctx.saved_tensors[0], ctx.k).to(ctx.dtype), None, None, None


class MoE(nn.Module):
    """Routed experts + one shared expert. Every V4 layer is MoE; there are no dense FFN layers.
    With an EP group, this rank holds experts [ep_rank * n_local, (ep_rank + 1) * n_local); the router
    and the shared expert are replicated. Expert names keep their global index (experts.{e})."""
    fast = False  # set by Transformer.set_kernels ('experts'): grouped GEMM experts (dsv4_kernels/fast.py)
    fast_routing = False  # ('routing'): a decode step's router and pair order in Triton (dsv4_kernels/route.py)
    stacked = None  # the local experts' weights in two stacks, the parameters views of them: Transformer.stack_experts
    def __init__(self, layer_id, args, ep_group=None):
        super().__init__()
        self.args, self.ep_group = args, ep_group
        ep, E = group_size(ep_group), args.n_routed_experts
        assert E % ep == 0, f"n_routed_experts ({E}) must divide by ep_size ({ep})"
        self.n_local = E // ep
        first = (dist.get_rank(ep_group) if ep > 1 else 0) * self.n_local
        self.gate = Gate(layer_id, args)
        self.experts = nn.ModuleDict({str(e): Expert(args.hidden_size, args.moe_intermediate_size, args.swiglu_limit)
                                      for e in range(first, first + self.n_local)})
        self.shared_experts = Expert(args.hidden_size, args.moe_intermediate_size, args.swiglu_limit)

    def run_experts(self, xs, ws, counts, x=None, decode=False):
        """Each local expert on its contiguous slice of rows. xs: [R, D], ws: [R] -> ([R, D], None), or with x [N, D]
        (this rank's tokens) the shared expert's output [N, D] in place of None where the fast path computed it with
        the routed experts (a decode step's kernels: one weight-bound pass for all)."""
        # grouped GEMM: bf16 on CUDA (any dtype on the CPU), with the experts' FP8 numerics where they are on
        if self.fast and (xs.dtype == torch.bfloat16 or not xs.is_cuda):
            counts = counts if torch.is_tensor(counts) else torch.tensor(counts, device=xs.device)
            w1 = self.shared_experts.w1
            gemm = fp8_grouped_mm if w1.fp8_train else grouped_mm_fp8_emu if w1.fp8_emu else None
            shared = None if x is None or w1.weight.dtype != xs.dtype or gemm else (x, self.shared_experts)
            out = grouped_experts(list(self.experts.values()), xs, ws, counts, self.args.swiglu_limit, self.stacked,
                                  shared, decode, gemm)
            return out if shared is not None else (out, None)
        return self.loop_experts(xs, ws, counts), None

    @torch.compiler.disable  # row counts read on the host: data-dependent sizes, which run eagerly under compile
    def loop_experts(self, xs, ws, counts):
        """The reference path: a loop over the local experts (fp32 on a GPU, kernels off)."""
        out, start = [], 0
        counts = counts.tolist() if torch.is_tensor(counts) else counts
        for expert, c in zip(self.experts.values(), counts):
            # a group padded to a multiple of 8 rows: BLAS picks other kernels for small odd row counts, which would
            # make a token's output depend on how many other tokens chose this expert
            pad = -c % 8
            out.append(expert(F.pad(xs[start:start + c], (0, 0, 0, pad)), F.pad(ws[start:start + c], (0, pad)))[:c])
            start += c
        return torch.cat(out) if out else xs

    def forward(self, x, ids, replay=None, stats=None, routed=False):
        # x: [B, T, D], ids: [B, T] -> [B, T, D]; replay [B, T, K] and stats: Gate.forward's. routed: also return the
        # experts each token went to, [B, T, K] (the engine records them for replay: kv_cache.py)
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        replay = replay.reshape(-1, replay.shape[-1]) if replay is not None else None
        weights, idx = self.gate(x, ids.reshape(-1), fast=self.fast_routing, replay=replay, stats=stats)
        decode = shape[1] == 1
        xs, ws, counts, ctx = dispatch(x, weights, idx, self.n_local, self.ep_group, decode, self.fast_routing)
        ys, shared = self.run_experts(xs, ws, counts, x, decode)
        y = combine(ys, ctx, x.shape[0], idx.shape[1], self.ep_group)
        if shared is None:  # not computed with the routed experts
            shared = self.shared_experts(x)
        y = (y + shared.float()).to(x.dtype).view(shape)
        return (y, idx.view(*shape[:-1], -1)) if routed else y
