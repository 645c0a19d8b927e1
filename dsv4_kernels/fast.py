"""
The torch fast paths, each beside the plain reference it replaces (tests/test_fast_paths.py checks that the two agree,
forward and backward):

  - matmul_f32 / linear_f32: a GEMM with an fp32 result from bf16 operands (tensor cores, fp32 accumulation, no
    rounding of the result); the reference writes F.linear(x.float(), w.float()), the same product as an fp32 GEMM.
    Used by the router, the compressors, the indexer and the output head. One switch for the whole process
    (GEMM_F32, the kernel path 'gemm_f32'), not a module's: the call sites are many and hold no module; on the CPU
    or in fp32 the two are one GEMM anyway.
  - hc_mixes_bf16: mHC's mixes from bf16 streams on bf16 tensor cores, fn split into three exact bf16 parts, as
    accurate as the reference's fp32 GEMM (mhc.hc_mixes).
  - grouped_experts: every local expert in two grouped GEMMs (torch._grouped_mm) instead of a Python loop
    (MoE.loop_experts); for the few rows an expert of a decode step, decode.experts_triton. stack_experts keeps the
    experts' weights stacked so that the GEMMs read them in place.
  - fused_projections: in the engine's decode, a layer's attention projections of one input as one GEMM.
  - window_attention: sink attention over [window keys | compressed keys] by blocks of `window` queries, so the
    [T, T] score matrix of the reference (model_dsv4.sink_attention with a band mask) is never formed.
"""
import functools

import torch
import torch.nn.functional as F

from . import has_triton
from .decode import EXPERT_ROWS, experts_triton

# T tokens, H heads, d head dim, w window (= block of queries), nb blocks, S compressed entries, e local experts

GEMM_F32 = True  # bf16 GEMMs with an fp32 result (torch.mm's out_dtype) on a GPU; off: fp32 GEMMs of fp32 copies


def use_gemm_f32(on):
    """Set GEMM_F32 for the process (model_dsv4.Transformer.set_kernels, given path names)."""
    global GEMM_F32
    GEMM_F32 = bool(on)


def mm_f32(a, b):
    """a @ b with an fp32 result, for a [M, K] or [B, M, K] and b [K, N] or [B, K, N], no autograd of its own: one
    bf16 GEMM with an fp32 output for CUDA bf16 operands (GEMM_F32), an fp32 GEMM otherwise."""
    if GEMM_F32 and a.is_cuda and a.dtype == b.dtype == torch.bfloat16:
        return (torch.mm if a.dim() == 2 else torch.bmm)(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def addmm_f32_(acc, a, b):
    """acc += a @ b into the fp32 acc [M, N], a [M, K], b [K, N]: one bf16 GEMM that adds its fp32 result into acc in
    place for CUDA bf16 operands (GEMM_F32), an fp32 GEMM otherwise. Returns acc."""
    if GEMM_F32 and a.is_cuda and a.dtype == b.dtype == torch.bfloat16:
        return torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    return acc.addmm_(a.float(), b.float())


class _MatmulF32(torch.autograd.Function):
    """y = a @ b (a [..., M, K], b [..., K, N], both bf16) as fp32. Backward: the fp32 gradient is rounded to bf16
    once, then two more GEMMs with fp32 results, rounded to the operands' dtype (what a bf16 trainer stores).
    b's gradient comes in b's memory layout: for linear_f32's b = w.t() that is a transposed [N, K] result, so the
    weight's gradient reaches it contiguous (a [K, N] one would be copied into the weight's layout: 1.3 ms for
    bench_2b's output head on an H200)."""
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return mm_f32(a, b)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        g = g.to(a.dtype)
        t = lambda x: x.transpose(-1, -2)
        gb = t(t(g) @ a) if b.stride(-2) == 1 and b.stride(-1) != 1 else t(a) @ g  # b transposed: compute b.T's
        return g @ t(b), gb


def matmul_f32(a, b):
    """fp32 a @ b for a [M, K] or [B, M, K] and b [K, N] or [B, K, N]."""
    if GEMM_F32 and a.is_cuda and a.dtype == b.dtype == torch.bfloat16:
        return _MatmulF32.apply(a, b)
    return mm_f32(a, b)


def linear_f32(x, w):
    """fp32 F.linear(x, w) for x [..., K], w [N, K]."""
    return matmul_f32(x.reshape(-1, x.shape[-1]), w.t()).view(*x.shape[:-1], w.shape[0])


def stack(experts):
    """(w13 [e, 2I, D], w2 [e, D, I]) of the experts' weights. w1 and w3 of each expert in turn, stacked [2e, I, D],
    is [e, 2I, D] with each expert's cat([w1, w3]): one copy of each weight (a cat per expert and then a stack move
    them twice, in ~60 kernels a layer)."""
    w13 = torch.stack([w for e in experts for w in (e.w1.weight, e.w3.weight)])
    return w13.view(len(experts), -1, w13.shape[-1]), torch.stack([e.w2.weight for e in experts])


def split_bf16(t, parts=3):
    """fp32 t -> `parts` bf16 tensors that sum to t: each the leading 8 significant bits of what the ones before left
    over, cut by clearing the low 16 bits of its fp32 pattern. Three parts hold all 24 bits: the sum is exact. (Cut,
    not rounded: a part is exact in bf16 before its cast, which matters under torch.compile, where inductor drops a
    fp32 -> bf16 -> fp32 round trip inside a kernel and a rounded split would leave the later parts zero.)"""
    out = []
    for _ in range(parts):
        part = (t.view(torch.int32) & -65536).view(torch.float32)  # 0xFFFF0000: sign, exponent, 7 mantissa bits
        out.append(part.to(torch.bfloat16))
        t = t - part
    return out


class _HcMixes(torch.autograd.Function):
    """mhc.hc_mixes for bf16 streams: (x @ fn.T) * rsqrt(mean(x^2) + eps), x bf16 [M, K], fn fp32 [R, K].
    The reference converts x to fp32 and runs an fp32 GEMM, which takes no tensor cores (FFMA kernels). Here x is
    used as it is (exact in bf16) and fn is split exactly into three bf16 parts (split_bf16): one GEMM with an fp32
    result over [f0; f1; f2] gives the three products, summed after. The GEMM is narrow (R = 24 outputs) and bound
    by reading x, so the extra rows cost little. Backward likewise, with the fp32 gradient dz = dy r split too and
    all nine products of parts in one GEMM (fn's parts saved from the forward): dx = dz @ fn - (sum(dy * z) r^3 / K)
    x, dfn = dz.T @ x. R is padded to a multiple of 8 (GEMM alignment)."""
    @staticmethod
    def forward(ctx, x, fn, eps):
        R, Rp = fn.shape[0], fn.shape[0] + -fn.shape[0] % 8
        # r before the GEMM: compile's partitioner then recomputes x.float() in the backward from the saved bf16 x;
        # used after the GEMM it would save the fp32 copy (twice x's bytes, written and read back once per sublayer)
        r = torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps)
        f = torch.cat(split_bf16(F.pad(fn, (0, 0, 0, Rp - R))))  # [3 Rp, K]
        z = mm_f32(x, f.t())  # [M, 3 Rp]
        z = z[:, :R] + z[:, Rp:Rp + R] + z[:, 2 * Rp:2 * Rp + R]
        ctx.save_for_backward(x, f, z, r)
        return z * r

    @staticmethod
    def backward(ctx, dy):
        saved = ctx.saved_tensors
        dx, dfn = hc_mixes_grads(*saved, dy)
        return dx.to(saved[0].dtype), dfn, None


def hc_mixes_grads(x, f, z, r, dy):
    """_HcMixes' backward: from x [M, K] bf16, fn's parts f [3 Rp, K], the unnormed products z [M, R], the norm's
    r [M, 1] and the mixes' gradient dy [M, R] -> (dx [M, K] fp32, dfn [R, K] fp32)."""
    R, Rp = z.shape[1], f.shape[0] // 3
    g = split_bf16(F.pad(dy * r, (0, Rp - R)))
    dzw = mm_f32(torch.cat([gi for gi in g for _ in range(3)], 1), torch.cat([f] * 3))  # [M, K]: sum of g_i f_j
    dx = dzw - ((dy * z).sum(-1, keepdim=True) * r.pow(3) / x.shape[-1]) * x.float()
    dfn = mm_f32(torch.cat(g, 1).t(), x)  # [3 Rp, K]
    return dx, dfn[:R] + dfn[Rp:Rp + R] + dfn[2 * Rp:2 * Rp + R]


def hc_mixes_bf16(x, fn, eps):
    """x bf16 [..., K], fn fp32 [R, K] -> fp32 [..., R]: _HcMixes over the flattened rows."""
    return _HcMixes.apply(x.reshape(-1, x.shape[-1]), fn, eps).view(*x.shape[:-1], fn.shape[0])


def stack_experts_(experts):
    """Move the local experts' weights into two stacked tensors and make each expert's parameters views of them,
    so grouped_experts reads them in place instead of stacking them on every forward. Weight loads and optimizer
    steps write through the views. Returns (w13 [e, 2I, D], w2 [e, D, I]).
    When the parameters train, the stacks are the autograd leaves: a backward accumulates one gradient per stack,
    and each parameter's .grad is its view of it (_hand_out_grads). Two leaves where the per-expert parameters made
    3 x e of them, each an AccumulateGrad the autograd engine runs on the host."""
    I = experts[0].w1.weight.shape[0]
    with torch.no_grad():
        w13, w2 = stack(experts)
    for i, e in enumerate(experts):
        e.w1.weight.data, e.w3.weight.data, e.w2.weight.data = w13[i, :I], w13[i, I:], w2[i]
    if experts[0].w1.weight.requires_grad:  # each stack is its parameters in turn: w1, w3, w1, ... and w2, w2, ...
        for s, params in ((w13, [w for e in experts for w in (e.w1.weight, e.w3.weight)]),
                          (w2, [e.w2.weight for e in experts])):
            s.requires_grad_()
            s.register_hook(functools.partial(_stale_grad, s, params))
            s.register_post_accumulate_grad_hook(functools.partial(_hand_out_grads, params))
    return w13, w2


def _owns(stack, params):
    """Whether the parameters' gradients are (still) views of the stack's: the first and last stand for all. The
    parameters are looked at first: after a zero_grad(set_to_none=True) under compile's CUDA graphs the stack's
    gradient is a graph output that the next step's replay overwrote, which must not be read."""
    g, first, last = stack.grad, params[0].grad, params[-1].grad
    return (g is not None and first is not None and last is not None and first.data_ptr() == g.data_ptr()
            and last.data_ptr() == g.data_ptr() + (g.numel() - last.numel()) * g.element_size())


def _stale_grad(stack, params, grad):
    """Before a backward adds into a stack's gradient: if the parameters' gradients are no longer its views, start
    it again from them: None when all are (a zero_grad(set_to_none=True) since), else their stack (gradients set by
    hand), so the backward adds to what each parameter held, as for any parameter."""
    if not _owns(stack, params):
        grads = [p.grad for p in params]
        stack.grad = None if all(g is None for g in grads) else torch.stack(
            [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]).view_as(stack)


def _hand_out_grads(params, stack):
    """After a backward added into a stack's gradient: each parameter's .grad its view of it."""
    if not _owns(stack, params):
        for p, g in zip(params, stack.grad.view(len(params), *params[0].shape).unbind()):
            p.grad = g


def is_stacked(experts, stacked):
    """Whether the experts' parameters are (still) the views stack_experts_ made of `stacked`, with the stacks
    training as they do. The first expert's w1 and the last one's w2 stand for all: what breaks the views (a
    deepcopy, a dtype or device cast, a load that assigns new parameters) replaces every parameter. The engine checks
    every layer before each decode step, so this stays cheap: two pointers, read off the stacks by arithmetic."""
    if stacked is None or stacked[0].requires_grad != experts[0].w1.weight.requires_grad:
        return False
    w13, w2 = stacked
    last = len(experts) - 1
    return (experts[0].w1.weight.data_ptr() == w13.data_ptr() and experts[last].w2.weight.data_ptr()
            == w2.data_ptr() + last * w2.stride(0) * w2.element_size())


def stack_experts(moes):
    """Keep each MoE module's local experts stacked (stack_experts_) where its kernels are on, stacking again where
    something replaced the parameters (a cast, a load with assign=True). Returns whether it stacked anything: then
    compiled code and CUDA graphs that read the old stacks must be dropped."""
    changed = False
    for m in moes:
        experts = list(m.experts.values())
        if m.fast and not is_stacked(experts, m.stacked):
            m.stacked, changed = stack_experts_(experts), True
            for t in m.stacked:  # to compile's CUDA graphs a fixed address, as a parameter's (not copied in)
                torch._dynamo.mark_static_address(t, guard=False)
    return changed


def fuse_projections(attns):
    """For the engine's decode: each Attention's projections of its input (module.fused_linears: wq_a, wkv, the
    compressors' and the indexer's) in one tensor (fuse_rows_), where its kernels are on, with no FP8 emulation and
    one dtype (no silent upcast); fused_projections then runs them as one GEMM, where the separate ones are small and
    launch-bound. Fuses again what something replaced; returns whether it fused anything."""
    changed = False
    for m in attns:
        linears = m.fused_linears
        if not m.fast_decode or any(getattr(w, "fp8_emu", False) or w.weight.dtype != linears[0].weight.dtype
                                    for w in linears):
            m.fused = None
        elif not is_fused([w.weight for w in linears], m.fused):
            m.fused, changed = fuse_rows_([w.weight for w in linears]), True
            torch._dynamo.mark_static_address(m.fused, guard=False)
    return changed


def fuse_rows_(weights):
    """Decode's fused projections: move weights [N_i, K] that read the same input into
    one [sum N_i, K] tensor, each weight's .data a view of its rows, so one GEMM computes them all. Weight loads and
    optimizer steps write through the views; a cast or a load that assigns new tensors breaks them (is_fused)."""
    with torch.no_grad():
        buf = torch.cat([w.data for w in weights])
    row = 0
    for w in weights:
        w.data, row = buf[row:row + w.shape[0]], row + w.shape[0]
    return buf


def is_fused(weights, buf):
    """Whether the weights are (still) fuse_rows_'s views of buf: the first and the last stand for all."""
    return (buf is not None and weights[0].data_ptr() == buf.data_ptr() and weights[-1].data_ptr()
            == buf.data_ptr() + (buf.shape[0] - weights[-1].shape[0]) * buf.stride(0) * buf.element_size())


def fused_projections(module, x):
    """{name: x @ weight.T} of module.fused_names() (an Attention) in one GEMM on module.fused, fp32, rounded
    to x's dtype where the module's own projection rounds its output (not those in module.FP32). {} when the module
    has no fused weights, or its weights are no longer their views (a deepcopy): then each projection runs on its own,
    as in training and prefill. Only the engine's decode calls this (kv_cache.py)."""
    names, linears = module.fused_names(), module.fused_linears
    # under torch.compile the caller vouches for the views (the engine runs Transformer.fuse_projections each step)
    if module.fused is None or not module.fast_decode or not (torch.compiler.is_compiling() or is_fused(
            [w.weight for w in linears], module.fused)):
        return {}
    outs = mm_f32(x.reshape(-1, x.shape[-1]), module.fused.t()).view(*x.shape[:-1], -1)
    outs = outs.split([w.weight.shape[0] for w in linears], dim=-1)
    return {n: o if n in module.FP32 else o.to(x.dtype) for n, o in zip(names, outs)}


def grouped_experts(experts, xs, ws, counts, limit, stacked=None, shared=None, decode=False, gemm=None):
    """xs [R, D] rows sorted by local expert, ws [R] fp32 routing weights, counts [e] rows per expert (a tensor:
    no host sync) -> [R, D]. Same math as Expert.forward: clamped SwiGLU, routing weight before w2.
    decode: the rows are a decode step's (one token a sequence), which the Triton kernels take when they are few an
    expert. Never a prefill's: a branch on its row count would make the compiled prefill compile again for the
    other side of it.
    The weights: `stacked` (stack_experts_) while the parameters are still its views (a deepcopy or a dtype cast
    breaks that), read in place; else stacked here (the checkpoint keeps a tensor per expert).
    shared: (x [N, D], the shared Expert) -> (the routed rows' [R, D], the shared expert's output [N, D] where the
    decode kernels took it in as one more expert, else None: the caller runs it).
    gemm(rows, w [e, N, K], offs, parts) -> rows @ w.T by groups, in place of torch._grouped_mm: the caller's FP8
    numerics (moe.py; w13's rows are 2 parts, w1 and w3). The decode kernels have none: a gemm passes them by."""
    # under torch.compile the caller vouches for `stacked` (Transformer.stack_experts checks it before each forward)
    if stacked is None or not (torch.compiler.is_compiling() or is_stacked(experts, stacked)):
        stacked = stack(experts)
    w13, w2 = stacked
    offs = counts.cumsum(0).to(torch.int32)  # end row of each expert's group
    if (gemm is None and decode and has_triton(xs) and not torch.is_grad_enabled()
            and xs.shape[0] <= EXPERT_ROWS * len(experts)):
        if shared is None:
            return experts_triton(xs, ws, offs, w13, w2, float(limit or 0))
        x, e = shared  # the shared expert as one more expert of the kernels (its SwiGLU clamp is the routed ones')
        ys = experts_triton(xs, ws, offs, w13, w2, float(limit or 0), x, e.w1.weight, e.w3.weight, e.w2.weight)
        return ys[:xs.shape[0]], ys[xs.shape[0]:]
    gemm = gemm or (lambda rows, w, offs, parts: torch._grouped_mm(rows, w.transpose(1, 2), offs=offs))
    g, u = gemm(xs, w13, offs, 2).float().chunk(2, dim=-1)
    if limit:
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    h = (F.silu(g) * u * ws[:, None]).to(xs.dtype)
    ys = gemm(h, w2, offs, 1)
    return ys if shared is None else (ys, None)


def window_attention(q, kv, ckv, cmask, sink, scale, window, seg=None):
    """The softmax of model_dsv4.sink_attention over window keys (t - window < j <= t) plus compressed keys,
    by blocks: the queries of block i only see window keys in blocks i-1 and i.
    q [B, T, H, d], kv [B, T, d] window keys (= values), ckv [B, S, d] or None, cmask bool [B or 1, T, S] ->
    [B, T, H, d]. seg [B, T] or None: packed samples, a window key seen only from its own sample's queries."""
    B, T, H, d = q.shape
    w, dt = window, kv.dtype
    nb = -(-T // w)
    pad = nb * w - T
    qp = F.pad(q, (0, 0, 0, 0, 0, pad))  # [B, nb*w, H, d]
    qb = qp.reshape(B * nb, w * H, d)  # rows (t, h) of a block
    kvp = F.pad(kv, (0, 0, w, pad))  # a zero block in front: block 0's "previous block"
    keys = torch.cat([kvp[:, :-w].reshape(B, nb, w, d), kvp[:, w:].reshape(B, nb, w, d)], dim=2).flatten(0, 1)
    logits = matmul_f32(qb, keys.transpose(1, 2)).view(B * nb, w, H, 2 * w) * scale  # [B*nb, w, H, 2w]
    t = torch.arange(nb * w, device=q.device).view(nb, w, 1)  # query position
    j = (t - t % w - w) + torch.arange(2 * w, device=q.device)  # key position: blocks i-1 and i
    band = ((j <= t) & (j > t - w) & (j >= 0)).view(1, nb, w, 1, 2 * w)
    if seg is not None:  # the keys' samples laid out as the keys are: -2 in the front block, -3 past the end
        ks = F.pad(seg, (w, 0), value=-2)
        ks = F.pad(ks, (0, pad), value=-3)
        kseg = torch.cat([ks[:, :-w].reshape(B, nb, w), ks[:, w:].reshape(B, nb, w)], dim=2)  # [B, nb, 2w]
        qseg = F.pad(seg, (0, pad), value=-4).view(B, nb, w)
        band = band & (qseg[..., None] == kseg[:, :, None, :]).view(B, nb, w, 1, 2 * w)
    logits = logits.view(B, nb, w, H, 2 * w).masked_fill(~band, float("-inf")).view(B * nb, w, H, 2 * w)
    parts = [logits]
    if ckv is not None and ckv.shape[1]:
        S = ckv.shape[1]
        clog = matmul_f32(qp.reshape(B, nb * w * H, d), ckv.transpose(1, 2)).view(B, nb * w, H, S) * scale
        cm = F.pad(cmask.expand(B, -1, -1), (0, 0, 0, pad))[:, :, None]  # [B, nb*w, 1, S]
        parts.append(clog.masked_fill(~cm, float("-inf")).view(B * nb, w, H, S))
    # one softmax over the parts and the sink without concatenating them: a shared row max (the sink's logit
    # included, so a row never is all -inf) and denominator, each part's probabilities from its own logits. On an
    # H200, a CSA layer's attention forward+backward: 1.97 ms against 2.83 for the softmax of the concatenated row,
    # which inductor compiles into a 0.79 ms forward kernel.
    sink = sink.float().view(1, 1, H)
    mx = functools.reduce(torch.maximum, [p.amax(-1) for p in parts], sink).detach()  # [B*nb, w, H]
    exps = [(p - mx[..., None]).exp() for p in parts]
    den = sum(e.sum(-1) for e in exps) + (sink - mx).exp()  # the sink only enlarges the denominator
    probs = [(e / den[..., None]).to(dt) for e in exps]
    out = probs[0].reshape(B * nb, w * H, 2 * w) @ keys  # [B*nb, w*H, d]
    out = out.view(B, nb * w, H, d)
    if len(probs) == 2:
        out = out + (probs[1].reshape(B, nb * w * H, -1) @ ckv).view(B, nb * w, H, d)
    return out[:, :T]
