"""A decode step's dense GEMMs (64 tokens: the projections of bench_2b's layers and its head) through cuBLAS (as
torch.mm / torch.bmm run them) against a plain Triton kernel that reads the weight once, a block of output columns a
program (and, split over K, a block of K too, the partials then added in order by a second kernel), over a sweep of
its tile sizes, each as CUDA-graph replays. At 0.2-11 MB of weights each, these GEMMs take a few microseconds, far
from the copy bandwidth: the probe asks whether a kernel of our own gets closer. Not used by the model.
python bench/probe_skinny.py   (a GPU)"""
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dsv4_kernels import INTERPRETED, _dot, _jit, tl, triton  # noqa: E402
from dsv4_kernels.fast import mm_f32  # noqa: E402
from probe_timing import graph_us  # noqa: E402


@_jit
def _mm(x_ptr, w_ptr, y_ptr, M, N, K, sxg, swg, syg, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
        SPLIT: tl.constexpr, STAGES: tl.constexpr, INTERP: tl.constexpr):
    """y[g, s, m, n] = sum over k in split s of x[g, m, k] w[g, n, k]: columns program_id(0), group program_id(1),
    split program_id(2) (all M rows in one program: M <= BM)."""
    n, m = tl.program_id(0) * BN + tl.arange(0, BN), tl.arange(0, BM)
    g, s = tl.program_id(1).to(tl.int64), tl.program_id(2)
    x_ptr += g * sxg
    w_ptr += g * swg
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in tl.range(s * BK, K, BK * SPLIT, num_stages=STAGES):
        k = k0 + tl.arange(0, BK)
        a = tl.load(x_ptr + m[:, None] * K + k[None, :], mask=(m < M)[:, None] & (k < K)[None, :], other=0.0)
        b = tl.load(w_ptr + n[:, None] * K + k[None, :], mask=(n < N)[:, None] & (k < K)[None, :], other=0.0)
        acc += _dot(a, tl.trans(b), INTERP)
    out = y_ptr + g * syg + (s * M + m[:, None]) * N + n[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=(m < M)[:, None] & (n < N)[None, :])


@_jit
def _sum(p_ptr, y_ptr, MN, spg, syg, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    i, g = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK), tl.program_id(1).to(tl.int64)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(p_ptr + g * spg + s * MN + i, mask=i < MN, other=0.0)
    tl.store(y_ptr + g * syg + i, acc.to(y_ptr.dtype.element_ty), mask=i < MN)


def mm(x, w, out_dtype, BN, BK, SPLIT, STAGES):
    """x [G, M, K] @ w[G, N, K].T -> [G, M, N]; over SPLIT > 1 blocks of K, fp32 partials added in order by _sum."""
    G, M, K = x.shape
    N = w.shape[1]
    y = x.new_empty(G, M, N, dtype=out_dtype)
    dst = y if SPLIT == 1 else x.new_empty(G, SPLIT, M, N, dtype=torch.float32)
    _mm[(triton.cdiv(N, BN), G, SPLIT)](x, w, dst, M, N, K, M * K, N * K, SPLIT * M * N,
                                        BM=max(16, triton.next_power_of_2(M)), BN=BN, BK=BK, SPLIT=SPLIT,
                                        STAGES=STAGES, INTERP=INTERPRETED, num_warps=4)
    if SPLIT > 1:
        _sum[(triton.cdiv(M * N, 1024), G)](dst, y, M * N, SPLIT * M * N, M * N, SPLIT=SPLIT, BLOCK=1024, num_warps=4)
    return y


SHAPES = [  # name, groups, N, K, output dtype, times a bench_2b step
    ("attn in, window (wq_a+wkv)", 1, 1024, 1536, torch.float32, 3),
    ("attn in, CSA", 1, 3600, 1536, torch.float32, 5),
    ("attn in, HCA", 1, 2048, 1536, torch.float32, 4),
    ("wq_b", 1, 8192, 512, torch.bfloat16, 12),
    ("indexer wq_b", 1, 2048, 512, torch.bfloat16, 5),  # runs past index_topk entries (2048 tokens), not before
    ("wo_a (4 groups)", 4, 512, 2048, torch.bfloat16, 12),
    ("wo_b", 1, 1536, 2048, torch.bfloat16, 12),
    ("router", 1, 64, 1536, torch.float32, 12),
    ("head", 1, 129280, 1536, torch.float32, 1),
]
if not torch.cuda.is_available():
    sys.exit("a timing probe for a GPU")
print(f"skinny GEMMs, {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}",
      flush=True)
M = 64  # a decode step's tokens at batch 64
total_cublas = total_ours = 0.0
for name, G, N, K, odt, times in SHAPES:
    x = torch.randn(G, M, K, device="cuda").bfloat16()
    w = (torch.randn(G, N, K, device="cuda") / K ** 0.5).bfloat16()
    ref = torch.bmm(x.float(), w.float().transpose(1, 2))
    wt = w.transpose(1, 2) if G > 1 else w[0].T  # the model's GEMMs as they run: mm_f32 where it takes fp32 out
    xs = x if G > 1 else x[0]
    gemm = mm_f32 if odt == torch.float32 else torch.bmm if G > 1 else torch.mm
    cublas = lambda gemm=gemm, xs=xs, wt=wt: gemm(xs, wt)
    t_cublas = graph_us(cublas)
    results = []
    for BN, BK, SPLIT, STAGES in itertools.product((16, 32, 64), (64, 128, 256), (1, 2, 4), (2, 3, 4)):
        if (N * G // BN * SPLIT < 32 and BN > 16) or K // BK < SPLIT or (BN * BK > 64 * 128 and STAGES > 3):
            continue
        f = lambda: mm(x, w, odt, BN, BK, SPLIT, STAGES)
        err = (f().float() - ref).abs().max().item()
        results.append((graph_us(f), BN, BK, SPLIT, STAGES, err))
    results.sort()
    t, *cfg, err = results[0]
    mb = G * N * K * 2 / 1e6
    print(f"  {name:28s} {mb:7.1f} MB: cuBLAS {t_cublas:6.1f} us ({mb / t_cublas:4.2f} TB/s), Triton {t:6.1f} us "
          f"({mb / t:4.2f} TB/s; BN {cfg[0]} BK {cfg[1]} split {cfg[2]} stages {cfg[3]}; max err {err:.1e}); "
          f"next: " + ", ".join(f"{r[0]:.1f} us {r[1:5]}" for r in results[1:4]), flush=True)
    total_cublas += times * t_cublas
    total_ours += times * t
print(f"  a step's GEMMs at {M} tokens: cuBLAS {total_cublas:.0f} us, Triton {total_ours:.0f} us")
