"""Two pieces of bench_2b's training step, each against what it replaced, in one process on a GPU (session 9):
  - mHC's mixes (model_dsv4.hc_mixes, 4096 tokens x n*D = 6144 -> 24 mixes; and 64 tokens, a decode step): the fp32
    reference against kernels.hc_mixes_bf16 (fn in three bf16 parts on tensor cores), each compiled as CUDA graphs
    (as bench.py --compile=graphs runs the layers), forward and forward+backward, and each one's error against fp64;
  - the loss over the vocabulary (4096 x 129280 fp32 logits): F.cross_entropy (bench.py before session 9), eager
    grpo.grpo_loss, and grpo.grpo_loss compiled (kernels.compile_layers), forward+backward.
python bench/probe_hc_loss.py [hc|loss] [tokens ...]   (both parts, 4096 and 64 tokens by default)"""
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import grpo  # noqa: E402
from kernels import hc_mixes_bf16  # noqa: E402
from model_dsv4 import hc_mixes  # noqa: E402


def timed(fn, reps=20):
    for _ in range(3):
        torch.compiler.cudagraph_mark_step_begin()
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        torch.compiler.cudagraph_mark_step_begin()
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e6


what = sys.argv[1] if len(sys.argv) > 1 else "both"
for M in [int(a) for a in sys.argv[2:]] or [4096, 64]:
    if what == "loss":
        break
    x = torch.randn(1, M, 4, 1536, device="cuda").bfloat16().requires_grad_()
    fn = (torch.randn(24, 6144, device="cuda") * 0.02).requires_grad_()
    xd = x.detach().double().flatten(2)
    exact = (xd @ fn.detach().double().T) * torch.rsqrt(xd.square().mean(-1, keepdim=True) + 1e-6)
    # as in the model: compiled, replayed as CUDA graphs (--compile=graphs), so the figures are the kernels' time
    ref, fast = (torch.compile(f, mode="reduce-overhead") for f in (hc_mixes, hc_mixes_bf16))
    for name, f in (("fp32 reference", lambda: ref(x, fn, 1e-6)), ("bf16 parts", lambda: fast(x.flatten(2), fn, 1e-6))):
        fwd = timed(lambda: f())
        both = timed(lambda: f().square().sum().backward())
        err = ((f().detach().double() - exact).abs().max() / exact.abs().max()).item()
        print(f"hc_mixes {M:5d} tokens  {name:15s} forward {fwd:7.1f} us   forward+backward {both:7.1f} us   "
              f"largest error / largest value {err:.1e}", flush=True)

if what == "hc":
    raise SystemExit
ids = torch.randint(0, 129280, (1, 4096), device="cuda")
mask = torch.ones_like(ids, dtype=torch.bool)
mask[:, -1] = False
adv = torch.ones(ids.shape, device="cuda")
mb = {"tgt": ids.roll(-1, 1), "mask": mask, "adv": adv, "rollout_lp": torch.zeros_like(adv),
      "weight": torch.full_like(adv, 1 / 4095), "first": torch.zeros_like(mask)}  # as bench.grpo_batch
logits = torch.randn(1, 4096, 129280, device="cuda").requires_grad_()
compiled = torch.compile(grpo.grpo_loss)
for name, f in (("F.cross_entropy", lambda: F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())),
                ("grpo_loss eager", lambda: grpo.grpo_loss(logits, mb)[0]),
                ("grpo_loss compiled", lambda: compiled(logits, mb)[0])):
    ms = timed(lambda: f().backward(), reps=10) / 1e3
    print(f"loss over 4096 x 129280 logits  {name:18s} forward+backward {ms:6.2f} ms", flush=True)
