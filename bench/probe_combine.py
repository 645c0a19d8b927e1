"""MoE's combine on a GPU (model_dsv4.combine, one EP rank): the experts' rows [R, D] back to their tokens, summed over
each token's top-k, for bench_2b's layer (4096 tokens, top-6, D 1536, bf16 rows): index_add_ by token (fp32 atomics,
the code before session 21) against the gather by the inverse permutation and a fixed-order sum (after), each eager
and compiled, forward and forward+backward; since session 22 also combine's and dispatch's row moves as
model_dsv4.PickSum and Picks, whose backward is a gather too (autograd's backward of an index: zeros, then a scatter
with atomics). python bench/probe_combine.py"""
import os
import sys

import torch
from probe_timing import timed

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from model_dsv4 import Picks, PickSum, inverse_permutation as inverse  # noqa: E402

T, K, D = 4096, 6, 1536


def index_add(out, order):
    return torch.zeros(T, D, dtype=torch.float32, device=out.device).index_add_(0, order // K, out.float())


def gather(out, order):
    return out[inverse(order)].view(T, K, -1).sum(1, dtype=torch.float32)


def pick_sum(out, order):
    return PickSum.apply(out, order, inverse(order), K)


order = torch.randn(T, 64, device="cuda").topk(K, dim=-1).indices.flatten().to(torch.uint8).argsort(stable=True)
out = torch.randn(T * K, D, device="cuda").bfloat16().requires_grad_()
dy = torch.randn(T, D, device="cuda")
print(f"combine, {T} tokens x top-{K}, D {D}, {torch.cuda.get_device_name()}, torch {torch.__version__}")
ref = index_add(out, order)
for name, f in (("index_add_", index_add), ("gather + sum", gather), ("PickSum", pick_sum)):
    for mode, g in (("eager", f), ("compiled", torch.compile(f))):
        err = (g(out, order) - ref).abs().max().item()
        with torch.no_grad():
            fwd = timed(lambda: g(out, order), 50) * 1e3  # us
        both = timed(lambda: torch.autograd.grad(g(out, order), out, dy), 50) * 1e3
        print(f"  {name:13s} {mode:9s} forward {fwd:6.1f} us, forward+backward {both:6.1f} us, max |y - index_add_| {err:.2g}")
x = torch.randn(T, D, device="cuda").bfloat16().requires_grad_()
drows = torch.randn(T * K, D, device="cuda").bfloat16()
print(f"dispatch's copy of each token's row once per pick, {T} x {K} rows")
ref = torch.autograd.grad(x[order // K], x, drows)[0].float()
for name, f in (("index", lambda x, order: x[order // K]),
                ("Picks", lambda x, order: Picks.apply(x, order, inverse(order), K))):
    for mode, g in (("eager", f), ("compiled", torch.compile(f))):
        err = (torch.autograd.grad(g(x, order), x, drows)[0].float() - ref).abs().max().item()
        both = timed(lambda: torch.autograd.grad(g(x, order), x, drows), 50) * 1e3
        print(f"  {name:13s} {mode:9s} forward+backward {both:6.1f} us, max |dx - index's| {err:.2g}")
