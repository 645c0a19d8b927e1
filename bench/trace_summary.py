"""Where a profiled step's device time went, from the trace `bench.py --profile --trace=FILE` writes: the kernels'
time by kind (dense GEMMs, grouped GEMMs, inductor's pointwise / reduction / persistent-reduction kernels, the
project's Triton kernels, sorts and top-k, the rest), then the kernels with the most time, one line per name.
python bench/trace_summary.py TRACE.json [--top=40] [--per=N: the trace holds N steps; times and counts per step]"""
import argparse
import collections
import gzip
import json

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
