"""
Benchmarks, each a ratio against a peer measured in the same run (never absolute numbers in tests).

    python bench.py                          # training fwd+bwd, tiny config, CPU, vs transformers
    python bench.py --what=decode            # embedded engine decode vs transformers' generate, batch 64
    python bench.py --model=config/models/bench_2b.json --seq=4096 --batch=1 --dtype=bfloat16   # on a GPU

Both models get the same weights (ours saved, transformers loads them) and the same inputs.
"""
import argparse
import contextlib
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


def train_flops(model, args, seq):
    """Model FLOPs of one sequence's forward+backward: 6 x active parameters x tokens (routed experts counted
    num_experts_per_tok / n_routed_experts, embedding not counted: it is a lookup) plus attention, 3 x (2 matmuls
    x 2 FLOPs) x heads x head_dim per query and attended key: window keys, plus top-k (CSA) or all compressed
    entries so far (HCA, causal: half on average)."""
    routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    dense = sum(p.numel() for n, p in model.named_parameters() if ".experts." not in n and not n.startswith("embed."))
    active = dense + routed * args.num_experts_per_tok / args.n_routed_experts
    keys = 0.0
    for r in args.compress_ratios[:args.num_hidden_layers]:
        keys += min(args.sliding_window, seq) + (0 if r == 0 else min(args.index_topk, seq / r) if r == 4 else seq / r / 2)
    attn = 12 * args.num_attention_heads * args.head_dim * keys * seq
    return 6 * active * seq + attn


def matmul_rate(device, dtype, n=8192):
    """FLOP/s of one large square matmul in dtype, the MFU denominator (measured, not the datasheet)."""
    n = n if device.type == "cuda" else 1024
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    t0, reps = time.perf_counter(), 20 if device.type == "cuda" else 3
    for _ in range(reps):
        a @ b
    sync(device)
    return 2 * n ** 3 * reps / (time.perf_counter() - t0)


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
        with torch.no_grad(), torch.autocast(device.type, dtype=ref.dtype, enabled=ref.dtype != torch.float32):
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
    flops = train_flops(ours, args, cli.seq) * cli.batch
    peak = matmul_rate(device, dtype)
    print(f"forward+backward, {cli.model}, batch {cli.batch} x seq {cli.seq}, {cli.dtype}, {versions}")
    print(f"  model FLOPs per step {flops / 1e12:.2f} T (6 x active params x tokens + attention); "
          f"measured {cli.dtype} matmul rate {peak / 1e12:.0f} TFLOP/s", flush=True)
    results = {}
    # transformers keeps its mHC parameters in fp32 and feeds their fp32 output to bf16 linears, which fails
    # without autocast; it gets autocast in bf16 runs (a mixed-precision peer, as it would be trained)
    amp = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    for name, model, fn in (("nano-dsv4-rl", ours, lambda m, x: m(x)),
                            ("transformers", ref, lambda m, x: m(x).logits)):
        with amp if name == "transformers" else contextlib.nullcontext():
            results[name] = t = time_train(model, ids, fn, cli.steps, cli.warmup, device)
        print(f"  {name:14s} {n_tok / t:10.0f} tokens/s   ({t * 1e3:.0f} ms/step)   MFU {flops / t / peak:.1%}", flush=True)
    print(f"  ratio ours / transformers: {results['transformers'] / results['nano-dsv4-rl']:.2f}x")
