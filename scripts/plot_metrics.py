"""
Curves of a GRPO run from its metrics.jsonl: reward, entropy and response length per step, and the held-out pass@k
at each eval row. One PNG, four panels.

    python scripts/plot_metrics.py out/default/metrics.jsonl            # -> out/default/metrics.png
    python scripts/plot_metrics.py out/gpu_math/metrics.jsonl --out=curves.png

Needs matplotlib (pip install matplotlib); the trainer does not.
"""
import argparse
import json
import os
import sys


def read_rows(path):
    """The rows of a metrics.jsonl; a torn last line (a run killed mid-write) is skipped, anything else is an error."""
    rows = []
    with open(path) as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:
                print(f"warning: {path}: the last line is incomplete, skipped", file=sys.stderr)
            else:
                raise ValueError(f"{path}:{i + 1}: not JSON ({e})") from None
    return rows


def series(rows, key):
    pts = [(r["step"], r[key]) for r in rows if key in r and r[key] is not None and "step" in r]
    return [p[0] for p in pts], [p[1] for p in pts]


def main():
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("metrics", help="a run's metrics.jsonl")
    ap.add_argument("--out", default="", help="the PNG to write (default: metrics.png beside the metrics)")
    a = ap.parse_args()
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("error: plotting needs matplotlib: pip install matplotlib")
    try:
        rows = read_rows(a.metrics)
    except (OSError, ValueError) as e:
        sys.exit(f"error: {e}")
    train = [r for r in rows if "reward_mean" in r]
    if not train:
        sys.exit(f"error: {a.metrics} has no GRPO step rows (no 'reward_mean'); is it a train_grpo.py metrics.jsonl?")
    fig, axes = plt.subplots(2, 2, figsize=(10, 7), sharex=True)
    for ax, key, title in ((axes[0, 0], "reward_mean", "reward (mean over samples)"),
                           (axes[0, 1], "entropy", "entropy (nats per token)"),
                           (axes[1, 0], "response_len_mean", "response length (tokens)")):
        ax.plot(*series(train, key), marker=".")
        ax.set_title(title)
    ax = axes[1, 1]
    ks = sorted({k for r in rows for k in r if k.startswith("eval_pass@")}, key=lambda k: int(k.split("@")[1]))
    for k in ks:  # the eval row of step s holds the policy after s updates
        ax.plot(*series(rows, k), marker="o", label=k[len("eval_"):])
    if ks:
        ax.legend()
    ax.set_title("held-out pass@k")
    for ax in axes[1]:
        ax.set_xlabel("GRPO updates")
    fig.suptitle(a.metrics, fontsize=8)
    fig.tight_layout()
    out = a.out or os.path.join(os.path.dirname(os.path.abspath(a.metrics)), "metrics.png")
    fig.savefig(out, dpi=80)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
