"""mHC's pre-mix for a decode step (Block.hc_pre on [B, 1, n, D]) as kernels_triton.hc_pre_triton (two Triton kernels)
against the path it replaces in the same run: the model's fast path (the mixes on bf16 tensor cores with fn in
three parts, Sinkhorn in Triton, the weighted sum) compiled as compile='layers' compiles it, bench_2b's sizes (n 4,
D 1536, 20 Sinkhorn iterations), bf16, at 64 and 256 tokens, each as CUDA-graph replays (the device's time). Then
each of its two kernels alone, and the split GEMM's variants: tl.dot in "tf32x3" (three tf32 products) against
"ieee" (fp32), blocks of K of 64 / 128 / 256 and 2 / 4 / 8 warps; the second kernel at 1-8 warps, and with one
Sinkhorn step or a weighted sum of 16 channels (where its time goes). Written in session 25; session 26's call 1 timed
the first version (one program a token) at 41 us, call 2's trace the two kernels at 10.8 + 7.7 us.
python bench/probe_hc_pre.py   (a GPU)"""
import copy
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kernels_triton as kt  # noqa: E402  (first: without a GPU it turns on Triton's interpreter)
from kernels_triton import hc_pre_triton, triton  # noqa: E402
import model_dsv4  # noqa: E402
from model_dsv4 import Block, ModelArgs  # noqa: E402
from probe_timing import graph_us  # noqa: E402

if not torch.cuda.is_available():  # the kernel against the reference: tests/test_triton.py -k hc_pre
    sys.exit("a timing probe for a GPU; the kernel's check on a CPU: pytest tests/test_triton.py -k hc_pre")
args = ModelArgs.from_json(os.path.join(os.path.dirname(__file__), "..", "config", "models", "bench_2b.json"))
n, D, R = args.hc_mult, args.hidden_size, (2 + args.hc_mult) * args.hc_mult
g = torch.Generator().manual_seed(0)
block = Block(0, copy.deepcopy(args)).cuda()
block.fast = True
fn = (torch.randn(R, n * D, generator=g) / (n * D) ** 0.5).cuda()
scale, base = torch.ones(3, device="cuda"), (torch.randn(R, generator=g) * 0.5).cuda()
reference = torch.compile(lambda x: Block.hc_pre(block, x, fn, scale, base))  # the kernel off: HC_PRE_TOKENS below
print(f"hc_pre, {torch.cuda.get_device_name()}, torch {torch.__version__}, bench_2b sizes", flush=True)
with torch.no_grad():
    for B in (64, 256):
        x = torch.randn(B, 1, n, D, generator=g).cuda().bfloat16()
        ours = lambda: hc_pre_triton(x, fn, scale, base, args.hc_sinkhorn_iters, args.hc_eps, args.rms_norm_eps)
        limit, model_dsv4.HC_PRE_TOKENS = model_dsv4.HC_PRE_TOKENS, 0  # the reference path, for the compile too
        ref = reference(x)
        t_ref = graph_us(lambda: reference(x))
        model_dsv4.HC_PRE_TOKENS = limit
        got = ours()
        err = max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in zip(got, ref))
        print(f"  {B} tokens: compiled reference {t_ref:.1f} us, Triton {graph_us(ours):.1f} us; "
              f"max |Δ| / max |ref| over input, post, comb {err:.1e}", flush=True)
        xf, K, RP = x.reshape(B, n * D), n * D, 32
        for bk in (64, 128, 256):  # the split GEMM alone, its variants
            S = triton.cdiv(K, bk)
            part, ss = xf.new_empty(S, B, RP, dtype=torch.float32), xf.new_empty(S, B, dtype=torch.float32)
            for dot in ("ieee", "tf32x3"):
                for warps in (2, 4, 8):
                    run = lambda: kt._hc_mix_parts[(triton.cdiv(B, kt.HC_BT), S)](
                        xf, fn, part, ss, B, K, R=R, RP=RP, BT=kt.HC_BT, BK=bk, DOT=dot, num_warps=warps)
                    print(f"    split GEMM, K blocks of {bk}, {dot}, {warps} warps: {graph_us(run):.1f} us", flush=True)
        S = triton.cdiv(K, kt.HC_BK)
        part, ss = xf.new_empty(S, B, RP, dtype=torch.float32), xf.new_empty(S, B, dtype=torch.float32)
        post, comb = xf.new_empty(B, n, dtype=torch.float32), xf.new_empty(B, n, n, dtype=torch.float32)
        h = x.new_empty(B, D)
        for warps, steps, d in ((1, 39, D), (2, 39, D), (4, 39, D), (8, 39, D), (4, 1, D), (4, 39, 16), (4, 1, 16)):
            run = lambda: kt._hc_pre[(B, 2)](xf, part, ss, scale, base, scale, h, post, comb, B, S, d, args.rms_norm_eps,
                                           args.hc_eps, 0.0, N=n, NP=n, RP=RP, STEPS=steps, SB=64,
                                           BLOCK_D=triton.next_power_of_2(d), NORM=False, num_warps=warps)
            what = "" if (steps, d) == (39, D) else " (parts only: " + ", ".join(
                ["one Sinkhorn step"] * (steps == 1) + [f"a weighted sum of {d} channels"] * (d != D)) + ")"
            print(f"    the rest a token, {warps} warps{what}: {graph_us(run):.1f} us", flush=True)
