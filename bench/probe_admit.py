"""The engine's admission of requests (session 24): KVCache.reset, prefill and copy for 64 requests (64 prompts of 32
tokens; and GRPO's 8 prompts x 8 samples, prefilled once each, then copied), batched over the sequences, against
session 23's loops over them (the peer, kept below), in the same run: the time of an admission, and whether the two
give the same logits and caches.
python bench/probe_admit.py [--model config/models/bench_2b.json]   (a GPU; on a CPU: tiny, a check of the logic)"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

from kv_cache import KVCache  # noqa: E402
from model_dsv4 import ModelArgs, Transformer  # noqa: E402
from probe_timing import timed  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--model", default="config/models/bench_2b.json" if torch.cuda.is_available() else
               "config/models/tiny.json")
cli = p.parse_args()
dev = "cuda" if torch.cuda.is_available() else "cpu"


class LoopCache(KVCache):
    """Session 23's KVCache: reset, copy and the prefill's cache writes a sequence at a time (the peer)."""
    def reset(self, slots):
        for slot in slots:
            for c in self.layers:
                c["win_pos"][slot] = -1
                for k in c:
                    if k.endswith("_prev_score"):
                        c[k][slot] = float("-inf")
                    elif k.endswith("_prev_kv"):
                        c[k][slot] = 0

    def copy(self, srcs, dsts):
        for src, dst in zip(srcs, dsts):
            for c in self.layers:
                for t in c.values():
                    t[dst] = t[src]

    def _fill(self, c, slots, L, kv, comps):
        a = self.args
        pos = torch.arange(kv.shape[1], device=kv.device)
        for b, (slot, n_tok) in enumerate(zip(slots.tolist(), L.tolist())):
            keep = pos[max(0, n_tok - a.sliding_window):n_tok]
            c["win"][slot, keep % a.sliding_window] = kv[b, keep]
            c["win_pos"][slot, keep % a.sliding_window] = keep
            for name, comp, entries, ckv, score in comps:
                m, d, W = comp.ratio, comp.head_dim, n_tok // comp.ratio
                c[name][slot, :W] = entries[b, :W]
                c[name + "_kv"][slot, :n_tok - W * m] = ckv[b, W * m:n_tok]
                c[name + "_score"][slot, :n_tok - W * m] = score[b, W * m:n_tok]
                if comp.overlap and W:
                    c[name + "_prev_kv"][slot] = ckv[b, (W - 1) * m:W * m, :d]
                    c[name + "_prev_score"][slot] = (score[b, (W - 1) * m:W * m] + comp.ape)[:, :d]


def admit(cache, model, prompts, n):
    """What Engine._admit does to the cache for len(prompts) * n requests in slots 0..: reset, prefill, copies."""
    slots = list(range(len(prompts) * n))
    cache.reset(slots)
    logits = cache.prefill(model, slots[::n], prompts)
    if n > 1:
        cache.copy([s - s % n for s in slots if s % n], [s for s in slots if s % n])
    return logits


args = ModelArgs.from_json(cli.model)
args.num_nextn_predict_layers = 0
torch.manual_seed(0)
dtype = torch.bfloat16 if dev == "cuda" else torch.float32
model = Transformer(args, dtype=dtype).to(dev).eval()
model.set_kernels(dev == "cuda")
name = torch.cuda.get_device_name() if dev == "cuda" else "CPU"
print(f"{cli.model}, {name}, torch {torch.__version__}", flush=True)
g = torch.Generator().manual_seed(0)
caches = {cls.__name__: cls(model, 65, 1088, dev) for cls in (KVCache, LoopCache)}
with torch.no_grad():
    for n_prompts, n in ((64, 1), (8, 8)):
        prompts = torch.randint(2, args.vocab_size, (n_prompts, 32), generator=g).tolist()
        out = {k: admit(c, model, prompts, n) for k, c in caches.items()}
        same = all(torch.equal(a, b) for a, b in zip(caches["KVCache"].layers[0].values(),
                                                     caches["LoopCache"].layers[0].values()))
        ms = {k: timed(lambda: admit(c, model, prompts, n), reps=5) for k, c in caches.items()}
        print(f"admission of {n_prompts} prompts x {n} samples of 32 tokens: batched {ms['KVCache']:.1f} ms, "
              f"a sequence at a time {ms['LoopCache']:.1f} ms ({ms['LoopCache'] / ms['KVCache']:.1f}x); "
              f"logits equal: {torch.equal(*out.values())}; layer 0's caches equal: {same}", flush=True)

