"""A decode step's dense projections that read the same input, separate (as the model runs them) against one GEMM on
their weights concatenated (session 24, for the next session): bench_2b's shapes at 64 and 256 tokens, bf16, each
timed as CUDA-graph replays. A decode step ran ~15 dense GEMMs a layer at 4-6 us each, launch- and latency-bound
(RESULTS.md session 23-24); the groups, per layer kind (bench_2b: 3 window, 5 CSA, 4 HCA layers):
  attention input: wq_a, wkv; the compressor's wkv and wgate (CSA, HCA); the indexer's compressor's wkv and wgate and
                   its weights_proj (CSA)
  q_lora output:   wq_b and the indexer's wq_b (CSA)
  FFN input:       the router's gate and the shared expert's w1 and w3 (every layer)
Prints each group's time both ways and the step's total over bench_2b's 12 layers. Not used by the model.
python bench/probe_fused_proj.py   (a GPU; on a CPU it runs too, timed per call)"""
import torch
import torch.nn.functional as F

from probe_timing import graph_us, timed

dev = "cuda" if torch.cuda.is_available() else "cpu"  # on a CPU: a check that it runs, timed per call
us = graph_us if dev == "cuda" else (lambda fn: timed(fn, 5) * 1e3)

D, QL, d, H, IH, ID, I, E = 1536, 512, 512, 16, 16, 128, 512, 64  # bench_2b
GROUPS = {  # name: (input width, [output widths], layers of bench_2b with it)
    "attn in, window": (D, [QL, d], 3),
    "attn in, CSA": (D, [QL, d, 2 * d, 2 * d, 2 * ID, 2 * ID, IH], 5),
    "attn in, HCA": (D, [QL, d, d, d], 4),
    "q_lora, CSA": (QL, [H * d, IH * ID], 5),
    "FFN in": (D, [E, I, I], 12),
}
name = torch.cuda.get_device_name() if dev == "cuda" else "CPU"
print(f"fused projections, {name}, torch {torch.__version__}", flush=True)
for M in (64, 256):
    step_sep = step_fused = 0.0
    for group, (k, outs, layers) in GROUPS.items():
        x = torch.randn(M, k, device=dev, dtype=torch.bfloat16)
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5 for n in outs]
        cat = torch.cat(ws)
        sep = us(lambda: [F.linear(x, w) for w in ws])
        fused = us(lambda: F.linear(x, cat).split(outs, dim=-1))
        same = all(torch.equal(a, b) for a, b in zip([F.linear(x, w) for w in ws], F.linear(x, cat).split(outs, -1)))
        step_sep, step_fused = step_sep + layers * sep, step_fused + layers * fused
        print(f"  {M} tokens, {group}: {len(outs)} GEMMs {sep:6.1f} us, one {fused:6.1f} us (N {sum(outs)}); "
              f"bit-equal outputs: {same}", flush=True)
    print(f"  {M} tokens, a step's {sum(len(o) * n for _, o, n in GROUPS.values())} GEMMs of these groups: "
          f"{step_sep / 1e3:.2f} ms separate, {step_fused / 1e3:.2f} ms fused", flush=True)
