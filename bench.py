"""
Benchmarks, each a ratio against a peer measured in the same run (never absolute numbers in tests).

    python bench.py                                  # training fwd+bwd, tiny config, CPU, vs transformers
    python bench.py --model=config/models/bench_2b.json --seq=4096 --batch=1 --dtype=bfloat16   # on a GPU

Both models get the same weights (ours saved, transformers loads them) and the same batch.
"""
import argparse
import copy
import logging
import tempfile
import time

import torch
import torch.nn.functional as F

from model_dsv4 import ModelArgs, Transformer, save_pretrained

p = argparse.ArgumentParser()
p.add_argument("--model", default="config/models/tiny.json")
p.add_argument("--seq", type=int, default=256)
p.add_argument("--batch", type=int, default=4)
p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
p.add_argument("--steps", type=int, default=5)
p.add_argument("--warmup", type=int, default=2)
cli = p.parse_args()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_train(model, ids, logits_of, steps, warmup, device):
    """Seconds per forward+backward of a next-token loss, median over steps."""
    times = []
    for i in range(warmup + steps):
        sync(device)
        t0 = time.perf_counter()
        logits = logits_of(model, ids)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
        model.zero_grad(set_to_none=True)
        sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


if __name__ == "__main__":
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, cli.dtype)
    args = ModelArgs.from_json(cli.model)
    args.num_nextn_predict_layers = 0  # transformers has no MTP; compare the trunk
    args.compress_ratios = args.compress_ratios[:args.num_hidden_layers]
    torch.manual_seed(0)
    ours = Transformer(copy.deepcopy(args), dtype=dtype).to(device)
    import transformers
    logging.getLogger("transformers").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory() as d:
        save_pretrained(ours, d)
        ref = transformers.DeepseekV4ForCausalLM.from_pretrained(d, dtype=dtype).to(device).train()
    ids = torch.randint(0, args.vocab_size, (cli.batch, cli.seq), device=device)
    n_tok = cli.batch * cli.seq
    results = {}
    for name, model, fn in (("nano-dsv4-rl", ours, lambda m, x: m(x)),
                            ("transformers", ref, lambda m, x: m(x).logits)):
        results[name] = time_train(model, ids, fn, cli.steps, cli.warmup, device)
    dev = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    print(f"forward+backward, {cli.model}, batch {cli.batch} x seq {cli.seq}, {cli.dtype}, {dev}, "
          f"torch {torch.__version__}, transformers {transformers.__version__}")
    for name, t in results.items():
        print(f"  {name:14s} {n_tok / t:10.0f} tokens/s   ({t * 1e3:.0f} ms/step)")
    print(f"  ratio ours / transformers: {results['transformers'] / results['nano-dsv4-rl']:.2f}x")
