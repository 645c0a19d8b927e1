"""Where a profiled step's device time went, from the trace `bench.py --profile --trace=FILE` writes: the kernels'
time by kind (dense GEMMs, grouped GEMMs, inductor's pointwise / reduction / persistent-reduction kernels, the
project's Triton kernels, sorts and top-k, the rest), then the kernels with the most time, one line per name.
python bench/trace_summary.py TRACE.json [--top=40] [--per=N: the trace holds N steps; times and counts per step]

by_region(prof.events()) splits a profile taken with_stack=True by the model's part each kernel ran for (attention's
projections, the compressor, the indexer, mHC, the experts, the head and loss, ...), forward and backward apart:
bench.py --what=train --profile prints it."""
import argparse
import ast
import collections
import functools
import gzip
import json
import os
import re

KINDS = [  # (kind, what its kernels' names hold, lower case), first match wins: inductor's first, whose names hold
    # the ops they fused (a custom op's name too)
    ("inductor pointwise", ("triton_poi",)),
    ("inductor reduction", ("triton_red", "triton_per")),
    ("Triton, ours", ("_hc_post", "_hc_pre", "_hc_mix", "_sinkhorn", "_decode_attn", "_experts_", "_compress_step",
                      "_window_kv", "_q_norm", "_sample_", "_route", "_pair_order")),
    ("grouped GEMM", ("groupproblemshape", "grouped_gemm")),  # torch._grouped_mm's CUTLASS kernels
    ("dense GEMM", ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas", "ampere_", "wgmma")),
    ("sort / top-k", ("sort", "topk", "radix", "bitonic")),
    ("copy / fill", ("memcpy", "memset", "copy", "fill")),
]


def kind(name):
    low = name.lower()
    return next((k for k, keys in KINDS if any(s in low for s in keys)), "other")


# (region, the functions whose kernels it holds: "module.Class.function" prefixes), read from a kernel's Python stack
# innermost frame first; the first frame that names a region wins, so helpers (fast.mm_f32, F.linear) count for the
# part that called them
REGIONS = (
    ("head + loss", ("chunked_head.", "model_dsv4.Transformer.logits", "model_dsv4.Transformer.head_loss",
                     "model_dsv4.Transformer.head_input", "mhc.hc_head")),
    ("mHC", ("mhc.", "mhc_triton.", "fast._HcMixes", "fast.hc_mixes", "model_dsv4.Block.hc_pre",
             "model_dsv4.Block.hc_post")),
    ("experts (routed + shared)", ("moe.MoE.run_experts", "moe.MoE.loop_experts", "moe.Expert.", "fast.grouped_experts",
                                   "moe.grouped_mm_fp8_emu", "quant.FP8Grouped")),
    ("router, dispatch, combine", ("moe.", "route.")),
    ("compressor", ("model_dsv4.Compressor.",)),
    ("indexer", ("model_dsv4.Indexer.", "model_dsv4.top_k_mask", "model_dsv4.mask_picks", "model_dsv4.picks_mask")),
    ("attention core", ("model_dsv4.sink_attention", "fast.window_attention")),
    ("attention projections, RoPE", ("model_dsv4.Attention.", "model_dsv4.apply_rope", "model_dsv4.rope",
                                     "model_dsv4.angles", "fast.fused_projections")),
    ("norms", ("model_dsv4.RMSNorm.",)),
    ("embedding", ("model_dsv4.Transformer.embed_streams",)),
)
COLUMNS = ("dense GEMM", "grouped GEMM", "Triton", "copy / fill", "other")  # kernel kinds, merged from KINDS'


@functools.cache
def _functions(path):
    """[(first line, last line, "Class.function")] of a source file's functions, outer ones before inner ones."""
    try:
        with open(path) as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return []
    out = []

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            named = isinstance(child, (ast.FunctionDef, ast.ClassDef))
            if isinstance(child, ast.FunctionDef):
                out.append((child.lineno, child.end_lineno, prefix + child.name))
            walk(child, prefix + child.name + "." if named else prefix)
    walk(tree, "")
    return out


def frame_name(frame):
    """"path/moe.py(280): forward" -> "moe.MoE.forward" (the innermost function holding that line)."""
    m = re.match(r"(.*)\((\d+)\): (.*)$", frame)
    if not m:
        return frame
    path, line = m.group(1), int(m.group(2))
    names = [q for a, b, q in _functions(path) if a <= line <= b]
    return os.path.basename(path).removesuffix(".py") + "." + (names[-1] if names else m.group(3))


def region(stack):
    for frame in stack:  # innermost first
        name = frame_name(frame)
        for r, prefixes in REGIONS:
            if name.startswith(prefixes):
                return r
    return "other"


def column(kernel_name):
    if kernel_name.startswith("aten::"):  # a CPU op standing for its kernel
        return {"aten::_grouped_mm": "grouped GEMM"}.get(kernel_name, "dense GEMM" if kernel_name in (
            "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm") else "other")
    k = kind(kernel_name)
    return {"Triton, ours": "Triton", "inductor pointwise": "Triton", "inductor reduction": "Triton"}.get(
        k, k if k in COLUMNS else "other")


def by_region(events, reps=1):
    """Prints the kernels' time a step by region (REGIONS), forward and backward apart, and each region's split by
    kind of kernel. events: a torch profile's events(), recorded with_stack=True, where Python's frames are events
    around the ops they called. A backward op has no Python frames of its own: it counts for the forward op that made
    its autograd node (the same sequence number), so a backward kernel counts for the part whose forward needed it.
    Recompute, if any, counts as forward. On the CPU each aten op's own time stands for its kernel."""
    def frames(e):  # Python frames around an event, innermost first
        out = []
        while e is not None:
            if re.match(r".*\(\d+\): ", e.name):
                out.append(e.name)
            e = e.cpu_parent
        return out

    def node(e):  # the autograd node whose backward runs this event, or None in the forward
        while e is not None and e.scope != 1:
            e = e.cpu_parent
        return e
    forward = {}
    for e in events:
        if e.sequence_nr >= 0 and node(e) is None:
            forward.setdefault((e.sequence_nr, e.thread), e)
    table = collections.defaultdict(lambda: collections.defaultdict(float))  # region -> (fwd/bwd or column) -> us
    gpu = any(e.kernels for e in events)
    for e in events:
        kernels = ([(k.name, k.duration) for k in e.kernels] if gpu else
                   [(e.name, e.self_cpu_time_total)] if e.name.startswith("aten::") else [])
        if not kernels:
            continue
        n = node(e)
        origin = e if n is None else forward.get((n.sequence_nr, n.fwd_thread))
        r = region(frames(origin)) if origin is not None else "other"
        for name, us in kernels:
            table[r]["fwd" if n is None else "bwd"] += us / reps
            table[r][column(name)] += us / reps
    total = sum(t["fwd"] + t["bwd"] for t in table.values())
    if not total:
        print("  no kernels or ops in the profile")
        return table
    print(f"  {'kernel' if gpu else 'op (CPU)'} time by region, {total / 1e3:.2f} ms a step (forward, backward; then "
          "by kind of kernel, ms):")
    print(f"    {'region':28s} {'fwd':>7s} {'bwd':>7s} {'share':>6s}  " + " ".join(f"{c:>12s}" for c in COLUMNS))
    for r, t in sorted(table.items(), key=lambda kv: -(kv[1]["fwd"] + kv[1]["bwd"])):
        print(f"    {r:28s} {t['fwd'] / 1e3:7.2f} {t['bwd'] / 1e3:7.2f} {(t['fwd'] + t['bwd']) / total:6.1%}  "
              + " ".join(f"{t[c] / 1e3:12.2f}" for c in COLUMNS))
    sums = {c: sum(t[c] for t in table.values()) for c in COLUMNS}
    print(f"    {'all':28s} {sum(t['fwd'] for t in table.values()) / 1e3:7.2f} "
          f"{sum(t['bwd'] for t in table.values()) / 1e3:7.2f} {1:6.1%}  "
          + " ".join(f"{sums[c] / 1e3:12.2f}" for c in COLUMNS))
    return table


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--order", default="", help="FIRST:COUNT: also list kernels FIRST.. FIRST+COUNT-1 in time order")
    p.add_argument("--per", type=int, default=1, help="steps in the trace: times and counts are divided by it")
    cli = p.parse_args()
    opener = gzip.open if cli.trace.endswith(".gz") else open
    with opener(cli.trace, "rt") as f:
        events = json.load(f)["traceEvents"]
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    if not kernels:
        raise SystemExit(f"{cli.trace}: no kernel events (was it written with a CUDA profile?)")
    by_name, by_kind = collections.defaultdict(lambda: [0.0, 0]), collections.defaultdict(lambda: [0.0, 0])
    for e in kernels:
        for table, key in ((by_name, e["name"]), (by_kind, kind(e["name"]))):
            table[key][0] += e["dur"] / cli.per
            table[key][1] += 1 / cli.per
    total = sum(t for t, _ in by_kind.values())
    first = min(e["ts"] for e in kernels)
    last = max(e["ts"] + e["dur"] for e in kernels)
    head = f"a step of the trace's {cli.per}: " if cli.per > 1 else ""
    print(f"{head}{len(kernels) / cli.per:.0f} kernels, "
          f"{total / 1e3:.2f} ms of kernel time, {(last - first) / 1e3 / cli.per:.2f} ms from the first kernel's start "
          f"to the last one's end")
    for k, (t, n) in sorted(by_kind.items(), key=lambda kv: -kv[1][0]):
        print(f"  {k:20s} {t / 1e3:8.2f} ms  {t / total:6.1%}  {n:6.0f} kernels")
    print(f"the {cli.top} kernels with the most time (name cut at 110 characters):")
    for name, (t, n) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:cli.top]:
        print(f"  {t / 1e3:7.3f} ms {n:5.0f}x {t / n:8.1f} us  {kind(name):18s} {name[:110]}")
    if cli.order:
        a, n = map(int, cli.order.split(":"))
        kernels.sort(key=lambda e: e["ts"])
        print(f"kernels {a} to {a + n - 1} in time order (start after the first kernel, duration, name):")
        for e in kernels[a:a + n]:
            print(f"  {(e['ts'] - first):9.1f} us {e['dur']:7.1f} us  {e['name'][:110]}")


if __name__ == "__main__":
    main()
