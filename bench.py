"""
Benchmarks, each a ratio against a peer measured in the same run (never absolute numbers in tests).

    python bench.py                          # training fwd+bwd, tiny config, CPU, vs transformers
    python bench.py --what=decode            # embedded engine decode vs transformers' generate, batch 64
    python bench.py --model=config/models/bench_2b.json --seq=4096 --batch=1 --dtype=bfloat16   # on a GPU

Both models get the same weights (ours saved, transformers loads them) and the same inputs.
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
p.add_argument("--what", default="train", choices=["train", "decode"])
p.add_argument("--model", default="config/models/tiny.json")
p.add_argument("--seq", type=int, default=256)
p.add_argument("--batch", type=int, default=4)
p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
p.add_argument("--steps", type=int, default=5)
p.add_argument("--new_tokens", type=int, default=64, help="decode: tokens generated per sequence")
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


def bench_decode(ours, ref, args, device, versions):
    """Greedy generation of exactly new_tokens per sequence for a batch of seq-token prompts, both sides;
    tokens/s counts generated tokens over the whole call (prefill included, prompts are short)."""
    from engine import Engine, SamplingParams
    prompts = torch.randint(2, args.vocab_size, (cli.batch, cli.seq), device=device)
    engine = Engine(ours, max_batch=cli.batch, max_len=cli.seq + cli.new_tokens)
    sp = SamplingParams(temperature=0.0, max_new_tokens=cli.new_tokens, ignore_eos=True)
    ref.eval()

    def run_ours():
        return [r.output_ids for r in engine.generate(prompts.tolist(), sp)]

    def run_ref():
        with torch.no_grad():
            out = ref.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=cli.new_tokens,
                               min_new_tokens=cli.new_tokens, do_sample=False, pad_token_id=0)
        return out[:, cli.seq:].tolist()

    times, outputs = {}, {}
    for name, fn in (("nano-dsv4-rl", run_ours), ("transformers", run_ref)):
        fn()  # warm-up
        sync(device)
        t0 = time.perf_counter()
        outputs[name] = fn()
        sync(device)
        times[name] = time.perf_counter() - t0
    same = sum(a == b for a, b in zip(outputs["nano-dsv4-rl"], outputs["transformers"]))
    n = cli.batch * cli.new_tokens
    print(f"greedy decode, {cli.model}, batch {cli.batch}, prompt {cli.seq}, {cli.new_tokens} new tokens, "
          f"{cli.dtype}, {versions}")
    for name, t in times.items():
        print(f"  {name:14s} {n / t:10.0f} tokens/s   ({t:.2f} s)")
    print(f"  ratio ours / transformers: {times['transformers'] / times['nano-dsv4-rl']:.2f}x; "
          f"identical greedy outputs: {same}/{cli.batch} sequences")


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
    dev = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    versions = f"{dev}, torch {torch.__version__}, transformers {transformers.__version__}"
    if cli.what == "decode":
        bench_decode(ours, ref, args, device, versions)
        raise SystemExit
    ids = torch.randint(0, args.vocab_size, (cli.batch, cli.seq), device=device)
    n_tok = cli.batch * cli.seq
    results = {}
    for name, model, fn in (("nano-dsv4-rl", ours, lambda m, x: m(x)),
                            ("transformers", ref, lambda m, x: m(x).logits)):
        results[name] = time_train(model, ids, fn, cli.steps, cli.warmup, device)
    print(f"forward+backward, {cli.model}, batch {cli.batch} x seq {cli.seq}, {cli.dtype}, {versions}")
    for name, t in results.items():
        print(f"  {name:14s} {n_tok / t:10.0f} tokens/s   ({t * 1e3:.0f} ms/step)")
    print(f"  ratio ours / transformers: {results['transformers'] / results['nano-dsv4-rl']:.2f}x")
