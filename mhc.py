"""
mHC (manifold-constrained hyper-connections), DeepSeek-V4's residual: each token carries n streams of width D.
A sublayer reads one mix of them and writes back into all of them (model_dsv4.Block.hc_pre and hc_post); the
weights come from the streams themselves (fn's rows over an RMSNorm of all n * D values, then scale and base),
and the streams' mix of each other is made doubly stochastic by Sinkhorn's alternating normalisation, so the
residual neither grows nor shrinks. The last layer's streams collapse into one for the head (hc_head).

The fast paths: dsv4_kernels.fast.hc_mixes_bf16 (the mixes on bf16 tensor cores) and
dsv4_kernels.mhc_triton.sinkhorn_triton (the loop in one kernel); tests/test_model.py and tests/test_mhc_kernels.py
check them against these references.
"""
import torch
import torch.nn.functional as F

from dsv4_kernels import has_triton
from dsv4_kernels.fast import hc_mixes_bf16
from dsv4_kernels.mhc_triton import sinkhorn_triton


def hc_split_sinkhorn(mixes, scale, base, n, iters, eps, fast=False):
    """mixes: [..., (2+n)*n] fp32 -> pre [..., n], post [..., n], comb [..., n, n] (doubly stochastic).
    Order pre | post | comb; column-first Sinkhorn, as the reference kernel."""
    pre, post, comb = mixes.split([n, n, n * n], dim=-1)
    pre = torch.sigmoid(pre * scale[0] + base[:n]) + eps
    post = 2 * torch.sigmoid(post * scale[1] + base[n:2 * n])
    comb = comb.unflatten(-1, (n, n)) * scale[2] + base[2 * n:].view(n, n)
    return pre, post, sinkhorn(comb.softmax(dim=-1) + eps, iters, eps, fast)


def sinkhorn(comb, iters, eps, fast=False):
    """comb [..., n, n] > 0 -> doubly stochastic: columns, then rows and columns iters - 1 times, each divided by
    its sum + eps."""
    if fast and has_triton(comb):  # dsv4_kernels/mhc_triton.py: the loop in one Triton kernel (one more: backward)
        return sinkhorn_triton(comb, iters, eps)
    if torch.compiler.is_compiling() and not torch.is_grad_enabled():  # decode: one tensor per entry (below)
        return sinkhorn_entries(comb, iters, eps)
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def sinkhorn_entries(comb, iters, eps):
    """hc_split_sinkhorn's loop with each of the n x n entries as its own tensor and each row or column sum
    written as additions: pointwise work only, which inductor fuses into a few kernels, where the batched loop's
    2 * iters small reductions compile to some 40 kernels of ~1 µs each (most of the kernels of a decode step).
    Used by compiled code without autograd only: with a backward, this form takes inductor several times as long to
    compile for no gain at training's token counts, and eager, the batched loop is faster.
    comb [..., n, n] -> [..., n, n]"""
    n = comb.shape[-1]
    c = [[comb[..., i, j] for j in range(n)] for i in range(n)]  # c[i][j]: row i, column j

    def by_cols(c):
        s = [sum([c[i][j] for i in range(1, n)], c[0][j]) + eps for j in range(n)]
        return [[c[i][j] / s[j] for j in range(n)] for i in range(n)]

    def by_rows(c):
        s = [sum(row[1:], row[0]) + eps for row in c]
        return [[x / s[i] for x in row] for i, row in enumerate(c)]

    c = by_cols(c)
    for _ in range(iters - 1):
        c = by_cols(by_rows(c))
    return torch.stack([torch.stack(row, -1) for row in c], -2)


def hc_mixes(x, fn, norm_eps, fast=False):
    # x: [B, T, n, D] -> fp32 [B, T, rows of fn]; an unweighted RMSNorm over all n*D values, then fn
    if fast and x.dtype == torch.bfloat16:  # dsv4_kernels/fast.py: the same on tensor cores, fn in three bf16 parts
        return hc_mixes_bf16(x.flatten(2), fn, norm_eps)
    xf = x.flatten(2).float()
    return F.linear(xf, fn.float()) * torch.rsqrt(xf.square().mean(-1, keepdim=True) + norm_eps)


def hc_head(x, fn, scale, base, args, fast=False):
    """Final collapse of the n streams into one: sigmoid weights, no Sinkhorn. x: [B, T, n, D] -> [B, T, D]"""
    pre = torch.sigmoid(hc_mixes(x, fn, args.rms_norm_eps, fast) * scale.float() + base.float()) + args.hc_eps
    return (pre.unsqueeze(-1) * x.float()).sum(dim=2).to(x.dtype)
