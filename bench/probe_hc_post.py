"""mHC's hc_post on bench_2b's training shape (4096 tokens, n = 4 streams of D = 1536, bf16 streams, fp32 mixes):
the stream mix as a batched 4x4 fp32 matmul and as a sum over the 4 input streams, eager and compiled, forward and
forward + backward. Session 5's profile blamed a 344 us fp32 GEMM kernel on the matmul form; since session 6 the model
takes the sum when compiling and the matmul eager, each where it ran faster on an H200. Session 21 added
kernels_triton.hc_post_triton (the Triton kernels the trainer takes on a GPU since). python bench/probe_hc_post.py"""
import os
import sys

import torch
from probe_timing import timed

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kernels_triton import hc_post_triton  # noqa: E402


def by_matmul(f, x, post, comb):
    return (post.unsqueeze(-1) * f.float().unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), x.float())).to(x.dtype)


def by_streams(f, x, post, comb):
    xf = x.float()
    y = post.unsqueeze(-1) * f.float().unsqueeze(-2)
    for j in range(x.shape[-2]):
        y = y + comb[..., j, :].unsqueeze(-1) * xf[..., j, None, :]
    return y.to(x.dtype)


T, n, D = (4096 if torch.cuda.is_available() else 256), 4, 1536
dev = "cuda" if torch.cuda.is_available() else "cpu"
leaf = lambda *s, dt=torch.float32: torch.randn(*s, device=dev, dtype=dt).requires_grad_()
f, x, post, comb = leaf(1, T, D, dt=torch.bfloat16), leaf(1, T, n, D, dt=torch.bfloat16), leaf(1, T, n), leaf(1, T, n, n)
ref = by_matmul(f, x, post, comb).float()
print(f"max |matmul - streams| = {(ref - by_streams(f, x, post, comb).float()).abs().max().item():.3e} "
      f"(bf16 result, |y| up to {ref.abs().max().item():.1f})")
dy = torch.randn_like(ref).bfloat16()
for name, fn in [("matmul", by_matmul), ("streams", by_streams), ("matmul, compiled", torch.compile(by_matmul)),
                 ("streams, compiled", torch.compile(by_streams)), ("triton", hc_post_triton),
                 ("triton, compiled", torch.compile(lambda *a: hc_post_triton(*a)))]:  # dx's sum compiled, as trained
    if name.startswith("triton") and dev != "cuda":
        continue
    print(f"{name:18s} max |y - matmul| {(fn(f, x, post, comb).float() - ref).abs().max().item():.2e}", end="")
    with torch.no_grad():
        print(f"   forward {timed(lambda: fn(f, x, post, comb)) * 1e3:7.1f} us", end="")
    both = timed(lambda: torch.autograd.grad(fn(f, x, post, comb), (f, x, post, comb), dy)) * 1e3
    print(f"   forward+backward {both:7.1f} us", flush=True)
if dev == "cuda":  # the kernels alone (session 22 call 1 also timed the old forward, 512 columns a program: 43.1 us)
    import kernels_triton as kt
    y, args = torch.empty_like(x), [t.detach() for t in (f, x, post, comb)]
    us = timed(lambda: kt._hc_launch(kt._hc_post_fwd, x, *args, y)) * 1e3
    print(f"_hc_post_fwd alone (a token a program, 8 warps)             {us:7.1f} us "
          f"(reads and writes {(3 * x.numel() + f.numel()) * 2 / us / 1e6:.2f} TB/s)")
    us = timed(lambda: kt._hc_post_sums(dy, *args[:3])) * 1e3
    print(f"_hc_post_sums alone (the backward's kernel)               {us:7.1f} us "
          f"(reads {(2 * x.numel() + 2 * f.numel()) * 2 / us / 1e6:.2f} TB/s)")
