"""Where the tensor transport's time goes (bench.py --what=sync: a sync takes far longer than a device copy of the
same bytes). Starts an embedded server for the model as bench.py does, syncs through the tensor transport (flattened
buckets) a few times, and prints each sync's seconds and each call's: the client's round trip per endpoint, and for
every bucket the server's own time (the time it took to open the payload's CUDA IPC handle and to load, from its
answer's message); then a cProfile of the trainer's side of one more sync.
python bench/probe_sync.py [--model config/models/bench_2b.json] [--bucket_mb 512] [--syncs 3]"""
import argparse
import cProfile
import collections
import copy
import os
import pstats
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import parallel  # noqa: E402
from checkpoint import save_weights  # noqa: E402
import weight_sync as wsync  # noqa: E402
from model_dsv4 import ModelArgs, Transformer  # noqa: E402
from rollout import RolloutClient  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--model", default="config/models/bench_2b.json")
p.add_argument("--bucket_mb", type=float, default=512)
p.add_argument("--syncs", type=int, default=3)
cli = p.parse_args()
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
args = ModelArgs.from_json(cli.model)
with torch.device("meta"):
    model = Transformer(copy.deepcopy(args), dtype=torch.bfloat16)
model, grid = model.to_empty(device=device), parallel.init_distributed()
model.init_weights(seed=0)
calls = []  # (path, seconds, the answer's message)


def timed_http(http):
    def call(url, method, path, body=None, timeout=None):
        t0 = time.perf_counter()
        status, out = http(url, method, path, body, timeout)
        calls.append((path, time.perf_counter() - t0, out.get("message", "") if isinstance(out, dict) else ""))
        return status, out
    return call


with tempfile.TemporaryDirectory() as d:
    save_weights(model, grid, f"{d}/start", args, "none")
    proc = subprocess.Popen([sys.executable, "server.py", "--model", f"{d}/start", "--port", "0",
                             "--dtype", "bfloat16", "--device", device.type, "--max-len", "256"],
                            stdout=subprocess.PIPE, text=True)
    try:
        ready = next(line for line in proc.stdout if "ready at" in line)
        client = RolloutClient(ready.split("ready at ")[1].split()[0])
        client._http = timed_http(client._http)
        for i in range(cli.syncs + 1):
            calls.clear()
            prof = cProfile.Profile() if i == cli.syncs else None
            prof and prof.enable()
            st = wsync.sync(model, grid, client, args, f"{d}/sync", mode="tensor", version=str(i), quant="none",
                            bucket_mb=cli.bucket_mb, timeout=600, flatten=True)
            prof and prof.disable()
            per = collections.defaultdict(list)
            for path, t, _ in calls:
                per[path].append(t)
            print(f"sync {i + 1}{' (profiled)' if prof else ''}: {st['seconds']:.3f} s, {st['bytes'] / 1e9:.2f} GB in "
                  f"{st['buckets']} buckets ({st['bytes'] / 1e9 / st['seconds']:.1f} GB/s)")
            for path, ts in per.items():
                print(f"  {path:32s} {len(ts):3d} calls, {sum(ts) * 1e3:8.1f} ms (max {max(ts) * 1e3:.1f})")
            for path, t, msg in calls:
                if path == "/update_weights_from_tensor":
                    print(f"    {t * 1e3:7.1f} ms  {msg}")
        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
    finally:
        proc.terminate()
        proc.wait()
