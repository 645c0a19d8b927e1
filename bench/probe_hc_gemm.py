"""mHC's narrow fp32 GEMM (bench_2b: 4096 tokens x n*D = 6144 -> 24 mixes), forward and forward + backward, as one
F.linear and as `chunks` batched GEMMs over slices of K, then summed (split-K). Session 5 ran it on an H200 to decide
whether mhc.hc_mixes should split (it should not: bench/RESULTS.md). python bench/probe_hc_gemm.py"""
import time

import torch
import torch.nn.functional as F


def split_k(x, w, chunks):
    K = x.shape[-1]
    xs = x.reshape(-1, chunks, K // chunks).transpose(0, 1)  # [c, M, K/c], a view
    ws = w.view(w.shape[0], chunks, K // chunks).permute(1, 2, 0)  # [c, K/c, N]
    return torch.bmm(xs, ws).sum(0)


x = torch.randn(4096, 6144, device="cuda", requires_grad=True)
w = torch.randn(24, 6144, device="cuda", requires_grad=True)
for name, fn in [("F.linear", F.linear)] + [(f"split_k {c}", lambda a, b, c=c: split_k(a, b, c)) for c in (4, 8, 16, 32)]:
    for what in ("forward", "forward+backward"):
        def once():
            y = fn(x, w)
            if what != "forward":
                y.backward(torch.ones_like(y))
        for _ in range(3):
            once()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            once()
        torch.cuda.synchronize()
        print(f"{name:12s} {what:17s} {(time.perf_counter() - t0) / 20 * 1e6:8.1f} us")
