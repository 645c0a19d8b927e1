"""The routed experts of a decode step as Triton kernels (dsv4_kernels.decode.experts_triton's two, under several block
configs), against dsv4_kernels.fast.grouped_experts' math (aten's grouped GEMM), for the decode step's shapes: bench_2b's 64
experts (D 1536, I 512, top-6) and 64 or 256 tokens, rows sorted by expert, routed uniformly at random and skewed
(a few experts take many rows). A decode step's experts are bound by reading their weights (301 MB a layer, every
expert hit at batch 64).

  up:   a program per (expert, block of BLOCK_N of the I columns): its rows (BLOCK_M at a time) times the gate and
        up rows of w13, rounded to bf16 as the grouped GEMM's output is, then the clamped SwiGLU and the routing
        weight, h in bf16;
  down: a program per (expert, block of BLOCK_N of the D columns): h times w2, bf16.
An expert without rows reads no weights; one with many runs its row blocks one after another. Each config is timed
as CUDA-graph replays (the device's time, not the launches'), its outputs checked against the reference, its rate
the bytes of the experts it reads over the time; the uniform rows are how the model's configs are chosen.
python bench/probe_moe_decode.py [--tokens 64 256]   (on a CPU: Triton's interpreter, a small fp32 check only)"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import dsv4_kernels.decode as kt  # noqa: E402  (first: without a GPU, dsv4_kernels turns on the interpreter)
import triton  # noqa: E402
from probe_timing import graph_us  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--tokens", type=int, nargs="+", default=[64, 256])
cli = p.parse_args()
LIMIT = 10.0


def triton_experts(xs, ws, offs, w13, w2, cfg):
    """kt.experts_triton's two kernels under the block config cfg: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)."""
    E, I, D = w13.shape[0], w13.shape[1] // 2, w13.shape[2]
    bm, bn, bk, warps, stages = cfg
    f32 = kt.INTERPRETED or xs.dtype == torch.float32
    h, out = xs.new_empty(xs.shape[0], I), torch.empty_like(xs)
    R = xs.shape[0]  # (no shared expert: its pointers not read)
    kt._experts_up[(E, triton.cdiv(I, bn))](xs, w13, ws, offs, h, xs, xs, xs, D, I, R, 0, 0, LIMIT, CLAMP=True,
                                            F32=f32, SHARED=False, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                                            num_warps=warps, num_stages=stages)
    kt._experts_down[(E, triton.cdiv(D, bn))](h, w2, offs, out, xs, D, I, R, 0, 0, F32=f32, SHARED=False, BLOCK_M=bm,
                                              BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
    return out


def reference(xs, ws, offs, w13, w2):
    """dsv4_kernels.fast.grouped_experts' math: aten's grouped GEMM on a GPU; per expert elsewhere (the CPU check)."""
    if xs.is_cuda:
        g, u = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs).float().chunk(2, dim=-1)
    else:
        ends = offs.tolist()
        g, u = torch.cat([xs[a:b] @ w13[e].t() for e, (a, b) in enumerate(zip([0] + ends[:-1], ends))]).chunk(2, -1)
    g, u = g.clamp(max=LIMIT), u.clamp(-LIMIT, LIMIT)
    h = (F.silu(g) * u * ws[:, None]).to(xs.dtype)
    if xs.is_cuda:
        return torch._grouped_mm(h, w2.transpose(1, 2), offs=offs)
    return torch.cat([h[a:b] @ w2[e].t() for e, (a, b) in enumerate(zip([0] + ends[:-1], ends))])


def inputs(T, E, D, I, K, dtype, device, skew=0.0):
    """Rows of T tokens' top-K picks of E experts, sorted by expert; skew > 0: expert e's router logit is raised by
    skew * e / E (a few experts take many rows, as a trained router's can)."""
    g = torch.Generator(device="cpu").manual_seed(T)
    idx = (torch.randn(T, E, generator=g) + skew * torch.arange(E) / E).topk(K, dim=-1).indices.flatten()
    counts = torch.bincount(idx, minlength=E)
    offs = counts.cumsum(0).to(torch.int32).to(device)
    R = T * K
    xs = torch.randn(R, D, generator=g).to(device, dtype)
    ws = torch.rand(R, generator=g).to(device)
    w13 = (torch.randn(E, 2 * I, D, generator=g) / D ** 0.5).to(device, dtype)
    w2 = (torch.randn(E, D, I, generator=g) / I ** 0.5).to(device, dtype)
    return xs, ws, offs, w13, w2, counts


if not torch.cuda.is_available():  # the kernels' logic in Triton's interpreter (its bf16 dot is broken: fp32 here)
    xs, ws, offs, w13, w2, counts = inputs(5, 4, 64, 32, 2, torch.float32, "cpu")
    counts[1] = 0
    got = triton_experts(xs, ws, offs, w13, w2, (16, 16, 32, 4, 2))
    ref = reference(xs, ws, offs, w13, w2)
    err = ((got - ref).abs().max() / ref.abs().max()).item()
    print(f"interpreter, fp32, 5 tokens x top-2 of 4 experts: max |Δ| / max |ref| = {err:.2e}")
    sys.exit(0 if err < 1e-5 else 1)

E, D, I, K = 64, 1536, 512, 6
CONFIGS = [(16, 64, 128, 4, 4), (16, 64, 256, 4, 3), (16, 32, 256, 4, 4), (16, 128, 128, 4, 3),
           (16, 64, 128, 4, 6), (16, 32, 128, 2, 5), (32, 64, 128, 4, 4), (32, 32, 256, 4, 3),
           # two programs an SM (fewer stages), more warps, narrower and wider blocks
           (16, 64, 128, 4, 3), (16, 64, 128, 4, 2), (16, 64, 128, 8, 4), (16, 32, 128, 4, 4), (16, 32, 128, 4, 3),
           (16, 64, 64, 4, 6), (16, 128, 128, 8, 4), (16, 128, 64, 4, 4)]
print(f"decode experts, {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
      f"{E} experts, D {D}, I {I}, top-{K}", flush=True)


def copy_rate():
    """TB/s of a device copy of 1 GiB, read + write counted (bench.py's decode floor uses the same)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / graph_us(lambda: dst.copy_(src), reps=5) / 1e6


print(f"  copy of 1 GiB: {copy_rate():.2f} TB/s (read + write)")
for T, skew in [(T, skew) for T in cli.tokens for skew in (0.0, 3.0)]:
    xs, ws, offs, w13, w2, counts = inputs(T, E, D, I, K, torch.bfloat16, "cuda", skew)
    hit = int((counts > 0).sum())
    nbytes = hit * 3 * I * D * 2  # the weights of the experts with rows
    ref = reference(xs, ws, offs, w13, w2)
    us = graph_us(lambda: reference(xs, ws, offs, w13, w2))
    print(f"\n{T} tokens, skew {skew}: {T * K} rows, {counts.min().item()}-{counts.max().item()} an expert, "
          f"{hit} experts hit, "
          f"{nbytes / 1e6:.0f} MB of weights")
    print(f"  aten grouped GEMM (the model's)     {us:7.1f} us  {nbytes / us / 1e6:5.2f} TB/s")
    for cfg in CONFIGS:
        try:
            got = triton_experts(xs, ws, offs, w13, w2, cfg)
            err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            t = graph_us(lambda: triton_experts(xs, ws, offs, w13, w2, cfg))
            print(f"  triton M{cfg[0]} N{cfg[1]} K{cfg[2]} w{cfg[3]} s{cfg[4]}  {t:9.1f} us  {nbytes / t / 1e6:5.2f} "
                  f"TB/s  max |Δ| / max |ref| {err:.1e}", flush=True)
        except Exception as exc:  # a config the compiler refuses (shared memory) is reported, not fatal
            print(f"  triton {cfg}: {type(exc).__name__}: {str(exc)[:100]}", flush=True)
