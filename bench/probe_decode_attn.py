"""The decode attention kernel (kernels_attention.decode_attention_triton) at bench_2b's sizes (16 heads, head dim 512,
window 128), bf16, as the engine runs it mid-generation of 32 + 1024 tokens (position 544; caches sized for 1056): a
window layer (128 keys), an HCA layer (the window and 4 of 9 compressed entries) and a CSA layer (the window and 136
of 264), at batch 64 and 256, over 1-4 programs a sequence (splits) and blocks of 32 or 64 keys, each as CUDA-graph
replays (the device's time), beside the gathered reference (model_dsv4.sink_attention, compiled). Written in session
27, where session 26's trace had the kernel at 13-17 us a layer with one program a sequence.
python bench/probe_decode_attn.py   (a GPU)"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kernels_attention as kd  # noqa: E402  (first: without a GPU it turns on Triton's interpreter)
from model_dsv4 import sink_attention  # noqa: E402
from probe_timing import graph_us  # noqa: E402

if not torch.cuda.is_available():
    sys.exit("a timing probe for a GPU; the kernel's check on a CPU: pytest tests/test_decode_attention.py")
H, D, W, scale = 16, 512, 128, 512 ** -0.5
g = torch.Generator().manual_seed(0)
reference = torch.compile(lambda q, keys, mask, sink: sink_attention(q[:, None], keys, mask[:, None], sink, scale))
print(f"decode attention, {torch.cuda.get_device_name()}, torch {torch.__version__}, bench_2b sizes", flush=True)
for B in (64, 256):
    for name, cap, kept, ratio in (("window", 0, 0, 0), ("HCA", 9, 4, 128), ("CSA", 264, 136, 4)):
        rnd = lambda *shape: torch.randn(*shape, generator=g).cuda().bfloat16()
        q, win, sink = rnd(B, H, D), rnd(B + 1, W, D), torch.randn(H, generator=g).cuda()
        comp = rnd(B + 1, cap, D) if cap else None
        slots = torch.randperm(B + 1, generator=g)[:B].cuda()
        mask = torch.ones(B, W + cap, dtype=torch.bool, device="cuda")
        mask[:, W + kept:] = False
        # the same keys as the kernel works them out: the window's positions, each sequence at the position where
        # `kept` entries are complete, the indexer (CSA) picking all of them
        pos = torch.full((B,), max(kept * ratio - 1, W), device="cuda")
        win_pos = (pos[0] - torch.arange(W, device="cuda")).expand(B + 1, W).contiguous()
        cmask = mask[:, W:] if name == "CSA" else None
        keys = torch.cat([win[slots], comp[slots]], 1) if cap else win[slots]
        ref = reference(q, keys, mask, sink)[:, 0]
        t_ref = graph_us(lambda: reference(q, keys, mask, sink))
        print(f"  batch {B}, {name} ({W + kept} keys of {W + cap}): gathered reference, compiled {t_ref:.1f} us "
              f"(without the gather); auto splits {kd.decode_splits(W + cap, B)}", flush=True)
        for block in (32, 64):
            kd.DECODE_BLOCK_N = block
            for splits in (1, 2, 3, 4):
                run = lambda: kd.decode_attention_triton(q, win, win_pos, comp, slots, pos, ratio, sink, scale,
                                                         cmask=cmask, splits=splits)
                err = (run().float() - ref.float()).abs().max().item() / ref.float().abs().max().item()
                print(f"    blocks of {block}, {splits} a sequence: {graph_us(run):.1f} us (max |Δ| / max |ref| "
                      f"{err:.1e})", flush=True)
        kd.DECODE_BLOCK_N = 32
