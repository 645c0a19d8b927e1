"""The routed experts' grouped GEMMs of bench_2b's training step on a GPU (64 experts, D 1536, I 512, top-6; rows
sorted by expert, ~balanced counts), forward and forward+backward: kernels_torch.grouped_experts' math eager (aten's
grouped GEMM, what the trainer runs), compiled as compile_layers does (inductor, aten's kernel inside), and compiled
with mode="max-autotune-no-cudagraphs" (inductor times its Triton grouped-GEMM templates against aten's and keeps
the fastest); against one plain GEMM of the same FLOPs. Then the eager step's kernels one by one. The backward
adds into .grad (xs, w13, w2) as a training step's first micro-batch would not: three add kernels in every
forward+backward figure (~0.26 ms at 4096 tokens, session 21), the same for each variant.
python bench/probe_grouped.py [--tokens 4096 8192]"""
import argparse
import time

import torch
import torch.nn.functional as F
from probe_timing import timed

p = argparse.ArgumentParser()
p.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192])
cli = p.parse_args()
E, D, I, K, LIMIT = 64, 1536, 512, 6, 10.0


def experts(xs, ws, offs, w13, w2):  # kernels_torch.grouped_experts with the stacks given
    g, u = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs).float().chunk(2, dim=-1)
    g, u = g.clamp(max=LIMIT), u.clamp(-LIMIT, LIMIT)
    h = (F.silu(g) * u * ws[:, None]).to(xs.dtype)
    return torch._grouped_mm(h, w2.transpose(1, 2), offs=offs)


def dense(xs, ws, offs, w13, w2):  # the same FLOPs, one expert's weights for every row
    g, u = (xs @ w13[0].t()).float().chunk(2, dim=-1)
    g, u = g.clamp(max=LIMIT), u.clamp(-LIMIT, LIMIT)
    return (F.silu(g) * u * ws[:, None]).to(xs.dtype) @ w2[0].t()


print(f"grouped experts, {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
torch.manual_seed(0)
w13 = (torch.randn(E, 2 * I, D, device="cuda") / D ** 0.5).bfloat16().requires_grad_()
w2 = (torch.randn(E, D, I, device="cuda") / I ** 0.5).bfloat16().requires_grad_()
fns = {"eager (aten)": experts, "compiled (default)": torch.compile(experts, dynamic=False),
       "compiled (max-autotune)": torch.compile(experts, dynamic=False, mode="max-autotune-no-cudagraphs"),
       "dense peer, eager": dense}
for T in cli.tokens:
    R = T * K
    idx = torch.randn(T, E, device="cuda").topk(K, dim=-1).indices.flatten()
    counts = torch.bincount(idx, minlength=E)
    offs = counts.cumsum(0).to(torch.int32)
    xs = torch.randn(R, D, device="cuda").bfloat16().requires_grad_()
    ws = torch.rand(R, device="cuda")
    dy = torch.randn(R, D, device="cuda").bfloat16()
    flops = 2 * R * D * 3 * I  # forward: [R, D] x [D, 2I] and [R, I] x [I, D]
    print(f"\n{T} tokens: {R} rows, {counts.min().item()}-{counts.max().item()} a group, "
          f"forward {flops / 1e9:.0f} GFLOP, backward twice that", flush=True)
    ref = None
    for name, f in fns.items():
        t0 = time.perf_counter()
        y = f(xs, ws, offs, w13, w2)
        y.backward(dy)
        warm = time.perf_counter() - t0
        if ref is None:
            ref = y.float()
        elif name.startswith("compiled"):
            print(f"  {name}: max |y - eager| {(y.float() - ref).abs().max().item():.3g}")
        with torch.no_grad():
            fwd = timed(lambda: f(xs, ws, offs, w13, w2))
        both = timed(lambda: f(xs, ws, offs, w13, w2).backward(dy))
        print(f"  {name:26s} forward {fwd:6.3f} ms ({flops / fwd / 1e9:4.0f} TFLOP/s), forward+backward "
              f"{both:6.3f} ms ({3 * flops / both / 1e9:4.0f} TFLOP/s); first call {warm:.1f} s", flush=True)
    for name in ("eager (aten)", "compiled (max-autotune)"):
        f = fns[name]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                f(xs, ws, offs, w13, w2).backward(dy)
            torch.cuda.synchronize()
        print(f"  {name}'s kernels (per step):")
        for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:10]:
            print(f"    {e.device_time_total / 5e3:7.3f} ms  {e.count // 5:3d}x  {e.key[:110]}")
