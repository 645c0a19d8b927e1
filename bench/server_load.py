"""
The embedded server under load: N /generate requests in flight at once against a small random V4 on the CPU, through
RolloutClient as the trainer sends them. Prints the time, requests/s and tokens/s, how many requests were retried or
failed, the most descriptors the server held, and whether its log holds a traceback.

    python bench/server_load.py                      # 4,000 requests of 8 tokens, max-batch 512
    python bench/server_load.py --n 8000 --max_new 16
"""
import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from checkpoint import save_pretrained  # noqa: E402
from model_dsv4 import ModelArgs, Transformer  # noqa: E402
from rollout import RolloutClient  # noqa: E402

p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
p.add_argument("--n", type=int, default=4000, help="requests, all in flight at once")
p.add_argument("--max_new", type=int, default=8)
p.add_argument("--max_batch", type=int, default=512, help="the server's decode batch")
a = p.parse_args()

args = ModelArgs(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, head_dim=32,
                 qk_rope_head_dim=16, q_lora_rank=32, o_groups=1, o_lora_rank=32, sliding_window=8,
                 compress_ratios=[0, 4], index_n_heads=2, index_head_dim=32, index_topk=4, n_routed_experts=4,
                 num_experts_per_tok=2, moe_intermediate_size=32, num_hash_layers=1, hc_mult=2, hc_sinkhorn_iters=3,
                 num_nextn_predict_layers=0)
with tempfile.TemporaryDirectory() as d:
    model = Transformer(args, dtype=torch.float32)
    model.init_weights(0)
    save_pretrained(model, d)
    log = open(os.path.join(d, "server.log"), "w+")
    proc = subprocess.Popen([sys.executable, "server.py", "--model", d, "--port", "0", "--dtype", "float32",
                             "--device", "cpu", "--max-batch", str(a.max_batch), "--max-len", str(8 + a.max_new)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        url = next(line for line in proc.stdout if "ready at" in line).split("ready at ")[1].split()[0]
        peak, done = [0], threading.Event()

        def count_descriptors():
            while not done.wait(0.05):
                peak[0] = max(peak[0], len(os.listdir(f"/proc/{proc.pid}/fd")))
        threading.Thread(target=count_descriptors, daemon=True).start()
        client = RolloutClient(url, max_concurrency=a.n)
        t0 = time.time()
        groups = client.generate([[5, 9, 2 + i % 50] for i in range(a.n)], 1,
                                 {"max_new_tokens": a.max_new, "ignore_eos": True}, seed=0, partial=True)
        dt = time.time() - t0
        done.set()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    samples = [s for g in groups for s in g]
    whole = sum(s is not None and s["completion_tokens"] == a.max_new for s in samples)
    retried = sum(s["attempts"] > 1 for s in samples if s is not None)
    log.seek(0)
    tracebacks = log.read().count("Traceback")
print(f"{a.n} requests in flight, {a.max_new} tokens each, max-batch {a.max_batch}: {dt:.1f} s, "
      f"{a.n / dt:.0f} requests/s, {whole * a.max_new / dt:.0f} tokens/s | whole samples {whole}/{a.n}, retried "
      f"{retried}, failed {sum(s is None for s in samples)} | server descriptors peak {peak[0]} | "
      f"tracebacks {tracebacks}")
