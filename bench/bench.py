"""
Benchmarks, each a ratio against a peer measured in the same run (never absolute numbers in tests).

    python bench/bench.py                    # training fwd+bwd, tiny config, CPU, vs transformers
    python bench/bench.py --what=decode      # embedded engine decode vs transformers' generate, batch 64
    python bench/bench.py --what=sync --model=config/models/bench_2b.json --dtype=bfloat16   # vs file write / copies
    python bench/bench.py --model=config/models/bench_2b.json --seq=4096 --batch=1 --dtype=bfloat16   # on a GPU

Run from the repository's root (the model configs' paths are relative to it).

Both models get the same weights (ours saved, transformers loads them) and the same inputs. The sync benchmark's
peers are a plain file write and a memcpy of the same bytes (on CUDA also a device-to-device copy) and, for the
distributed transport, a plain broadcast of them to another process (on two GPUs: NCCL), in the same run.
"""
import argparse
import contextlib
import copy
import logging
import os
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the project's modules, wherever this runs from
import compile_policy  # noqa: E402
import graphs  # noqa: E402
import parallel  # noqa: E402
import trace_summary  # noqa: E402  (beside this file)
from checkpoint import save_pretrained, save_weights  # noqa: E402
from kernel_check import choose as choose_kernels  # noqa: E402
from model_dsv4 import ModelArgs, Transformer  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--what", default="train", choices=["train", "decode", "sync", "mismatch"])
p.add_argument("--model", default="config/models/tiny.json")
p.add_argument("--seq", type=int, default=256)
p.add_argument("--batch", type=int, default=4)
p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
p.add_argument("--steps", type=int, default=5)
p.add_argument("--new_tokens", type=int, default=64, help="decode: tokens generated per sequence")
p.add_argument("--warmup", type=int, default=2)
p.add_argument("--bucket_mb", type=float, default=512, help="sync: bucket size (distributed, tensor transports)")
p.add_argument("--tmp", default=None, help="sync: directory for the disk transport (default: the system's temp dir)")
p.add_argument("--kernels", default="auto", choices=["auto", "fast", "reference"],
               help="dsv4_kernels/'s fast paths (auto: those that pass kernel_check.py on this GPU) or the reference")
p.add_argument("--compile", default="off", choices=list(compile_policy.MODES),
               help="compile_policy.compile_model (and compile_engine for decode): layers; static: one graph a shape; "
                    "graphs: with CUDA graphs of each layer's forward and backward, GPU only")
p.add_argument("--train_graphs", action="store_true", help="train: ours as the trainer replays a micro-batch on one "
               "GPU (graphs.StepGraphs: forward, loss and backward captured whole, after one eager run); with "
               "--compile=layers, of the compiled layers")
p.add_argument("--train_quant", default="none", choices=["none", "fp8"],
               help="train: ours with train_quant (fp8: its FP8 linears in FP8, model.set_fp8_training)")
p.add_argument("--invariant", action="store_true", help="mismatch: both sides path-invariant (model.set_invariant)")
p.add_argument("--profile", action="store_true", help="train, decode: our top CUDA/CPU ops (a step; 4 decode steps)")
p.add_argument("--trace", default="", help="with --profile: also write the profiled steps' chrome://tracing JSON here")
p.add_argument("--no_peer", action="store_true",
               help="decode, train: ours (and decode's floor) only, no transformers (no ratio)")
p.add_argument("--layers", type=int, default=0, help="keep only the first N trunk layers (less memory; 0 = all)")
cli = p.parse_args()
if (cli.compile == "graphs" or cli.train_graphs) and not torch.cuda.is_available():
    p.error("--compile=graphs and --train_graphs record CUDA graphs: they need a GPU")
if cli.compile == "graphs" and cli.train_graphs:
    p.error("--compile=graphs records each layer's graphs: a micro-batch's graph (--train_graphs) cannot hold them")


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, reps=1):
    """Seconds a call of fn takes, the mean of reps calls, the device synchronised before and after them."""
    sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / reps


def time_train(model, ids, step, steps, warmup, device):
    """(seconds per forward+backward of a next-token loss, seconds the host took to issue it, the first call's
    seconds), medians over steps; step(model, ids) runs one. When the first two are close the host bounds the step:
    the device waits between kernels."""
    times, issue = [], []
    for i in range(warmup + steps):
        sync(device)
        t0 = time.perf_counter()
        torch.compiler.cudagraph_mark_step_begin()  # a new step for compile's CUDA graphs (mode="reduce-overhead")
        step(model, ids)
        model.zero_grad(set_to_none=True)
        t1 = time.perf_counter()
        sync(device)
        times.append(time.perf_counter() - t0)
        issue.append(t1 - t0)
    first = times[0]
    times, issue = times[warmup:], issue[warmup:]
    return sorted(times)[len(times) // 2], sorted(issue)[len(issue) // 2], first


def train_flops(model, args, seq):
    """Model FLOPs of one sequence's forward+backward, counted per position t (causal):
    - 6 x active parameters per token: routed experts counted num_experts_per_tok / n_routed_experts; the embedding
      not counted (a lookup); the CSA indexer's weights 2x (forward only: its top-k pick passes no gradient);
    - attention, 3 x (2 matmuls x 2 FLOPs) x heads x head_dim per query and key it attends: min(window, t) window
      keys, plus min(top-k, t // 4) picked entries (CSA) or all t // 128 entries (HCA);
    - the indexer's scores, forward only: 2 x index heads x index_head_dim per query and visible entry (t // 4)."""
    routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    index = sum(p.numel() for n, p in model.named_parameters() if ".indexer." in n)
    dense = sum(p.numel() for n, p in model.named_parameters()
                if ".experts." not in n and ".indexer." not in n and not n.startswith("embed."))
    active = dense + routed * args.num_experts_per_tok / args.n_routed_experts
    t = torch.arange(1, seq + 1, dtype=torch.float64)
    keys = scored = 0.0
    for r in args.compress_ratios[:args.num_hidden_layers]:
        keys += t.clamp(max=args.sliding_window).sum().item()
        if r:
            seen = torch.div(t, r, rounding_mode="floor")
            keys += (seen.clamp(max=args.index_topk) if r == 4 else seen).sum().item()
            scored += seen.sum().item() if r == 4 else 0.0
    attn = 12 * args.num_attention_heads * args.head_dim * keys
    return 6 * active * seq + 2 * index * seq + attn + 2 * args.index_n_heads * args.index_head_dim * scored


def matmul_rate(device, dtype, n=8192):
    """FLOP/s of one large square matmul in dtype, the MFU denominator (measured, not the datasheet)."""
    n = n if device.type == "cuda" else 1024
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    timed(lambda: a @ b, device, 3)  # warm-up
    return 2 * n ** 3 / timed(lambda: a @ b, device, 20 if device.type == "cuda" else 3)


def profiled(fn, device, reps, trace="", **kw):
    """Profiles reps calls (steps) of fn: prints the top ops and the device's busy time a step; writes `trace`."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts, **kw) as prof:
        wall = timed(fn, device, reps)
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    ev = prof.key_averages()
    busy = sum(getattr(e, key) for e in ev) / 1e3 / reps  # µs -> ms
    print(f"  profiled step: {wall * 1e3:.1f} ms wall, {busy:.1f} ms of {key.split('_')[1]} time in ops")
    print(ev.table(sort_by=key, row_limit=60, max_name_column_width=90))
    if device.type == "cuda":
        print_gaps(prof)
    if trace:
        prof.export_chrome_trace(trace)
    return prof


def print_gaps(prof, top=12):
    """Where the device waited between kernels (the host behind, or a host sync): the idle time from the first
    kernel to the last, and the longest waits with the kernels before and after them."""
    ks = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                 and not e.name.startswith("## ")),  # not compile's annotations, which span a graph's kernels
                key=lambda e: e.time_range.start)
    gaps, end = [], ks[0].time_range.end
    for a, b in zip(ks, ks[1:]):
        if b.time_range.start > end:
            gaps.append((b.time_range.start - end, a.name, b.name))
        end = max(end, b.time_range.end)  # kernels of two streams may overlap
    idle = sum(g for g, _, _ in gaps)
    print(f"  device idle between kernels: {idle / 1e3:.1f} ms of {(end - ks[0].time_range.start) / 1e3:.1f} ms, "
          f"{sum(g > 10 for g, _, _ in gaps)} waits over 10 us; the longest:")
    for g, a, b in sorted(gaps, reverse=True)[:top]:
        print(f"    {g:8.1f} us after {a[:60]}, before {b[:60]}")


def experts_picked(model, prompts):
    """{layer: set of expert ids} the batch's tokens pick in one eager forward at position 0 (hooks on the routers;
    they do not run inside the compiled layers)."""
    picked = {i: set() for i in model.layers}
    keep = lambda i: lambda gate, inputs, out: picked[i].update(out[1].unique().tolist())  # out: (weights, ids)
    hooks = [layer.ffn.gate.register_forward_hook(keep(i)) for i, layer in model.layers.items()]
    with torch.no_grad(), torch.compiler.set_stance("force_eager"), model.numerics():
        model(prompts[:, :1])
    for h in hooks:
        h.remove()
    return picked


def bench_decode(ours, ref, args, device, versions):
    """Greedy generation of exactly new_tokens per sequence for a batch of seq-token prompts, both sides;
    tokens/s counts generated tokens over the whole call (prefill included, prompts are short). The floor: the
    bytes one decode step must read (every weight an expert pick or the dense path touches, and each sequence's
    attended KV at the mean context length), over the measured device copy bandwidth."""
    from engine import Engine, SamplingParams
    prompts = torch.randint(2, args.vocab_size, (cli.batch, cli.seq), device=device)
    engine = Engine(ours, max_batch=cli.batch, max_len=cli.seq + cli.new_tokens)
    if cli.compile != "off":
        compile_policy.compile_engine(engine)
    greedy = lambda n: SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)

    def run_ours(n):
        return [r.output_ids for r in engine.generate(prompts.tolist(), greedy(n))]

    def run_ref(n):
        with torch.no_grad(), torch.autocast(device.type, dtype=ref.dtype, enabled=ref.dtype != torch.float32):
            out = ref.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=n,
                               min_new_tokens=n, do_sample=False, pad_token_id=0)
        return out[:, cli.seq:].tolist()

    print(f"greedy decode, {cli.model}, batch {cli.batch}, prompt {cli.seq}, {cli.new_tokens} new tokens, "
          f"{cli.dtype}, {versions}", flush=True)
    times, outputs = {}, {}
    sides = (("nano-dsv4-rl", run_ours),) + (() if cli.no_peer else (("transformers", run_ref),))
    for name, fn in sides:
        warm = timed(lambda: fn(min(cli.new_tokens, 8)), device)  # and the engine's compile and CUDA graph capture
        times[name] = t = timed(lambda: outputs.update({name: fn(cli.new_tokens)}), device)
        print(f"  {name:14s} {cli.batch * cli.new_tokens / t:10.0f} tokens/s   ({t:.2f} s, "
              f"{t / cli.new_tokens * 1e3:.2f} ms/step; warm-up {warm:.0f} s)", flush=True)
    same = sum(a == b for a, b in zip(outputs["nano-dsv4-rl"], outputs.get("transformers", [])))
    # the model's step alone (on a GPU one CUDA graph replay), without sampling and scheduling on the host: at the
    # prompts' end and at the run's mean context (the caches still hold the run's sequences), where the floor is taken
    slots, t_model = torch.arange(cli.batch, device=device), []
    for at in (cli.seq, cli.seq + cli.new_tokens // 2):
        pos = torch.full((cli.batch,), at, device=device)
        engine.decode(slots, prompts[:, 0], pos)
        t_model.append((at, timed(lambda: engine.decode(slots, prompts[:, 0], pos), device, 20)))
    t_prefill = timed(lambda: run_ours(1), device)  # the prefill of the batch's prompts and its first token
    picked = experts_picked(ours, prompts)  # uniform routing would pick E (1 - (1 - K / E)^B) of a layer's E
    E, K, B = args.n_routed_experts, args.num_experts_per_tok, cli.batch
    # n: layers.L.ffn.experts.E...; an expert's weights are read when a token picked it
    is_read = lambda n: ".experts." not in n or int(n.split(".")[4]) in picked[n.split(".")[1]]
    w_bytes = sum(p.numel() * p.element_size() for n, p in ours.named_parameters()
                  if not n.startswith(("embed.", "mtp.")) and is_read(n))
    ctx, kv_el = cli.seq + cli.new_tokens / 2, args.head_dim * ours.dtype.itemsize
    kv = sum(min(ctx, args.sliding_window) + (0 if r == 0 else min(ctx / r, args.index_topk) if r == 4 else ctx / r)
             + (ctx / 4 * args.index_head_dim / args.head_dim if r == 4 else 0)  # the indexer reads every key
             for r in args.compress_ratios[:args.num_hidden_layers]) * kv_el * B
    buf = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = buf.clone()  # allocated and written once before the timing
    bw = 2 * buf.numel() / timed(lambda: dst.copy_(buf), device, 10)  # read + write
    floor = (w_bytes + kv) / bw
    if not cli.no_peer:
        print(f"  ratio ours / transformers: {times['transformers'] / times['nano-dsv4-rl']:.2f}x; "
              f"identical greedy outputs: {same}/{cli.batch} sequences")
    (p0, t0m), (p1, t1m) = t_model
    print(f"  ours, the model's decode step alone: {t0m * 1e3:.2f} ms at position {p0}, {t1m * 1e3:.2f} ms at {p1} "
          f"(the mean context); the rest of a step (sampling, scheduling): "
          f"{(times['nano-dsv4-rl'] / cli.new_tokens - t1m) * 1e3:.2f} ms, of which the prefill and first token "
          f"({t_prefill * 1e3:.0f} ms) spread over the steps {t_prefill / cli.new_tokens * 1e3:.2f} ms")
    if cli.profile:  # the step alone at the mean context, as timed above (bench/trace_summary.py TRACE --per=4)
        profiled(lambda: engine.decode(slots, prompts[:, 0], pos), device, 4, cli.trace)
        # the engine's own loop mid-generation (decode, sampling, the host's bookkeeping): where the rest goes
        reqs = [engine.submit(p, greedy(cli.new_tokens), f"loop{i}") for i, p in enumerate(prompts.tolist())]
        timed(engine.step, device, 4)  # into the generation
        print("  the engine's loop, 8 steps mid-generation:")
        profiled(engine.step, device, 8, cli.trace.replace(".json", "") + ".loop.json" if cli.trace else "")
        while not all(r.done.is_set() for r in reqs):
            engine.step()
    print(f"  experts picked a layer: {sum(map(len, picked.values())) / len(picked):.1f} of {E} (uniform routing: "
          f"{E * (1 - (1 - K / E) ** B):.1f}); by layer: {[len(s) for s in picked.values()]}")
    print(f"  floor: {w_bytes / 1e9:.2f} GB weights ({w_bytes} bytes) + {kv / 1e9:.3f} GB KV per step at "
          f"{bw / 1e12:.2f} TB/s copy bandwidth = {floor * 1e3:.2f} ms/step; "
          f"ours {times['nano-dsv4-rl'] / cli.new_tokens / floor:.1f}x the floor")


def bench_mismatch(ours, args, device, versions):
    """Trainer vs engine on this device: sample with the engine (temperature 1, its logprobs), re-score the same
    tokens with the training forward, both in --dtype with the same kernels: the alignment tool's core figure
    (compare_logprobs.py has the full report), on any device, for a compare_logprobs.wide_init_ model."""
    from engine import Engine, SamplingParams
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, args.vocab_size, (int(n),), generator=g).tolist()
               for n in torch.randint(4, cli.seq + 1, (cli.batch,), generator=g)]
    sp = [SamplingParams(temperature=1.0, max_new_tokens=cli.new_tokens, ignore_eos=True, seed=i)
          for i in range(cli.batch)]
    ours.set_invariant(cli.invariant)
    print(f"trainer vs engine logprobs, {cli.model}, {cli.batch} prompts of 4-{cli.seq} tokens, {cli.new_tokens} "
          f"sampled tokens each (temperature 1), {cli.dtype}, kernels {cli.kernels}"
          f"{', path-invariant (every sum in fp64)' if cli.invariant else ''}, {versions}")
    t0 = time.perf_counter()
    reqs = Engine(ours, max_batch=cli.batch, max_len=cli.seq + cli.new_tokens).generate(prompts, sp)
    t_engine = time.perf_counter() - t0
    diffs = []
    with torch.no_grad(), ours.numerics():
        for r in reqs:
            ids = torch.tensor(r.input_ids + r.output_ids, device=device)[None]
            lp = ours(ids)[0, len(r.input_ids) - 1:-1].log_softmax(-1).gather(-1, ids[0, len(r.input_ids):, None])
            diffs.append((lp[:, 0].cpu() - torch.tensor(r.output_logprobs)).abs())
    d = torch.stack(diffs)  # [prompts, new tokens]
    print(f"  mean |Δ logprob| {d.mean():.2e}   p99 {d.flatten().quantile(0.99):.2e}   max {d.max():.2e}   "
          f"first token {d[:, 0].mean():.2e}   rest {d[:, 1:].mean():.2e}   "
          f"(mean sampled logprob {sum(sum(r.output_logprobs) for r in reqs) / d.numel():.2f}); "
          f"engine {t_engine:.1f} s")


def broadcasts(rank, port, n, chunk, device, backend):
    """One end of broadcast_peer: a warm-up (it makes the connection), then the timed broadcasts. -> seconds."""
    from parallel import init_weight_update_group
    pg = init_weight_update_group("127.0.0.1", port, rank, 2, "peer", backend, 600)
    buf = torch.ones(chunk, dtype=torch.uint8, device=device)
    torch.distributed.broadcast(buf, src=0, group=pg)

    def all_bytes():
        for i in range(0, n, chunk):
            torch.distributed.broadcast(buf[:min(chunk, n - i)], src=0, group=pg)
    t = timed(all_bytes, device)
    torch.distributed.destroy_process_group(pg)
    return t


def broadcast_peer(n, chunk, device, gpu):
    """The distributed rows' peer, what the group moves without HTTP, server and names: n bytes as broadcasts of at
    most `chunk` bytes (one per bucket) to a spawned process, on GPU `gpu` (NCCL) or the CPU (gloo). -> seconds."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = "nccl" if device.type == "cuda" else "gloo"
    theirs = torch.device("cpu") if gpu is None else torch.device("cuda", gpu)
    peer = torch.multiprocessing.get_context("spawn").Process(target=broadcasts,
                                                              args=(1, port, n, chunk, theirs, backend))
    peer.start()
    t = broadcasts(0, port, n, chunk, device, backend)
    peer.join()
    return t


def bench_sync(args, dtype, device, versions):
    """Weight sync into a running embedded server (a subprocess), per transport and serving format: seconds for
    the whole sync call, as the trainer pays it. The server shares the trainer's device (on CUDA its GPU, which the
    tensor transport's IPC handles need); the distributed rows want a GPU of their own for it (NCCL refuses two
    ranks on one GPU), so one GPU skips them. The peers are the module docstring's."""
    import subprocess
    import weight_sync as wsync
    from quant import quantize_tensor
    from rollout import RolloutClient
    with torch.device("meta"):  # then materialised in dtype: no fp32 copy of a big model on the way
        model = Transformer(copy.deepcopy(args), dtype=dtype)
    model, grid, rows = model.to_empty(device=device), parallel.init_distributed(), []
    model.init_weights(seed=0)
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    # (the server's GPU, None: ours; [(transport, flattened buckets)]); the first distributed sync makes the groups
    both = [("distributed", True), ("distributed", True), ("distributed", False)]
    plans = [(None, [("disk", False)] + both + [("tensor", True), ("tensor", False)])]
    if gpus:
        plans = [(None, [("disk", False), ("tensor", True), ("tensor", False)])]
        plans += [(gpus - 1, both)] if gpus > 1 else []
    if gpus == 1:
        print("distributed rows skipped: NCCL refuses two ranks on one GPU (they need the server on a second GPU)")
    with tempfile.TemporaryDirectory(dir=cli.tmp) as d:
        for quant in ("none", "fp8"):
            save_weights(model, grid, f"{d}/start", args, quant)  # the server starts from the trainer's weights
            for gpu, modes in plans:
                env = dict(os.environ, **({} if gpu is None else {"CUDA_VISIBLE_DEVICES": str(gpu)}))
                cmd = [sys.executable, os.path.join(ROOT, "server.py"), "--model", f"{d}/start", "--port", "0",
                       "--dtype", cli.dtype, "--device", device.type, "--quant", quant, "--max-len", "256"]
                proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
                ready = next(line for line in proc.stdout if "ready at" in line)
                client = RolloutClient(ready.split("ready at ")[1].split()[0])
                for i, (mode, flat) in enumerate(modes):
                    st = wsync.sync(model, grid, client, args, f"{d}/sync", mode=mode, version=str(i), quant=quant,
                                    bucket_mb=cli.bucket_mb, timeout=1800, flatten=flat)
                    what = mode + ("" if mode == "disk" else ", flattened" if flat else ", per tensor")
                    first = mode == "distributed" and [m for m, _ in modes].index(mode) == i
                    rows.append((what + (" (+ groups)" if first else ""), quant, st["bytes"], st["seconds"]))
                    print(f"  {rows[-1][0]:32s} {quant:8s} {st['seconds']:8.2f} s", flush=True)
                proc.terminate()
                proc.wait()
        fp8 = []  # the bytes of the fp8 rows, and what they pay before any byte moves
        t = timed(lambda: fp8.extend(q.nbytes for k, v in model.state_dict().items()
                                     for q in quantize_tensor(k, v, "fp8").values()), device)
        rows.append(("quantize only (quant.py)", "fp8", sum(fp8), t))
        n = rows[0][2]  # the model's bytes as the trainer holds them
        chunk = torch.ones(min(n, 512 << 20), dtype=torch.uint8)

        def write_file():  # no fsync, as the disk transport (safetensors) does not either
            with open(f"{d}/plain", "wb") as f:
                for i in range(0, n, len(chunk)):
                    f.write(memoryview(chunk.numpy())[:n - i])
        rows.append(("file write", "-", n, timed(write_file, device)))
        dst = torch.zeros_like(chunk, device=device)  # touched: no page faults in the timing
        peers = [("memcpy" if gpus == 0 else "host to device copy", chunk)]
        peers += [("device copy", torch.ones_like(dst))] if gpus else []  # what the tensor transport's server does
        for what, src in peers:
            dst.copy_(src)  # warm-up

            def copy_all(src=src):
                for i in range(0, n, len(chunk)):
                    dst[:n - i].copy_(src[:n - i])
            rows.append((what, "-", n, timed(copy_all, device)))
        if gpus != 1:  # the peer of the distributed rows, in bucket-sized broadcasts
            rows.append((f"plain {'NCCL' if gpus else 'gloo'} broadcast", "-", n,
                         broadcast_peer(n, int(cli.bucket_mb * (1 << 20)), device, gpus - 1 if gpus else None)))
    print(f"weight sync, {cli.model}{f' (first {cli.layers} layers)' if cli.layers else ''} "
          f"({sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters), "
          f"{cli.dtype}, trainer and one embedded server on this machine, buckets of {cli.bucket_mb:g} MB, {versions}")
    print(f"  {'transport':32s} {'serving':8s} {'GB moved':>9s} {'seconds':>8s} {'GB/s':>7s}")
    for what, quant, nbytes, t in rows:
        print(f"  {what:32s} {quant:8s} {nbytes / 1e9:9.3f} {t:8.2f} {nbytes / 1e9 / t:7.2f}")


def bench_train(ours, ref, args, device, dtype, versions):
    """Forward+backward of a next-token loss: tokens/s and MFU of both sides, and their ratio."""
    ids = torch.randint(0, args.vocab_size, (cli.batch, cli.seq), device=device)
    flops = train_flops(ours, args, cli.seq) * cli.batch
    peak = matmul_rate(device, dtype)
    print(f"forward+backward, {cli.model}, batch {cli.batch} x seq {cli.seq}, {cli.dtype}, train_quant "
          f"{cli.train_quant}, {versions}")
    print(f"  model FLOPs per step {flops / 1e12:.2f} T (6 x active params x tokens + attention); "
          f"measured {cli.dtype} matmul rate {peak / 1e12:.0f} TFLOP/s", flush=True)
    results, cuda = {}, device.type == "cuda"
    # transformers feeds its fp32 mHC outputs to bf16 linears, which fails without autocast: in bf16 runs it is a
    # mixed-precision peer, as it would be trained
    amp = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    # the same mean next-token loss on both sides: ours is the trainer's last stage (Transformer.head_loss, its
    # logits a chunk of tokens at a time, compiled by --compile=layers/graphs as in training) on every position, the
    # last one's dummy target dropped from the mean as the trainer masks
    next_token = lambda logp, entropy, mb: -logp[:, :-1].mean()

    def ours_step(m, x):  # eager, as train_grpo.py's layouts other than one GPU stage run
        with m.numerics():
            m.head_loss(parallel.stage_forward(m, None, x), {"tgt": x.roll(-1, 1)}, next_token).backward()
    if cli.train_graphs:  # the trainer's replayed micro-batch; padded to its bucket, the mean above would change
        assert (graphs.bucket(cli.batch, 4), graphs.bucket(cli.seq, 8)) == (cli.batch, cli.seq), \
            f"--batch {cli.batch} x --seq {cli.seq} is not a bucket's shape (graphs.bucket): choose e.g. 8 x 320"
        step_graphs = graphs.StepGraphs(ours, None, log=lambda *a: None)
        ours_step = lambda m, x: step_graphs.train(m, None, [{"input_ids": x, "tgt": x.roll(-1, 1)}],  # noqa: F811
                                                   next_token)
    if cli.compile == "background":  # a first step hands its shape to the thread; the timing starts once it is compiled
        t0 = time.perf_counter()
        ours_step(ours, ids)
        ours.zero_grad(set_to_none=True)
        done = ours.background.join()
        took = f"{time.perf_counter() - t0:.1f} s after the first step began" if done else "failed: eager blocks"
        print(f"  background compile: {took}", flush=True)
    ref_step = lambda m, x: F.cross_entropy(m(x).logits[:, :-1].flatten(0, 1).float(), x[:, 1:].flatten()).backward()
    for name, model, step in (("nano-dsv4-rl", ours, ours_step), ("transformers", ref, ref_step))[:2 - cli.no_peer]:
        base = torch.cuda.memory_allocated() if cuda else 0
        torch.cuda.reset_peak_memory_stats() if cuda else None
        with amp if name == "transformers" else contextlib.nullcontext():
            t, host, first = time_train(model, ids, step, cli.steps, cli.warmup, device)
        results[name] = t
        mem = f", {(torch.cuda.max_memory_allocated() - base) / 1e9:.1f} GB over its start" if cuda else ""
        print(f"  {name:14s} {ids.numel() / t:10.0f} tokens/s   ({t * 1e3:.0f} ms/step)   MFU {flops / t / peak:.1%}   "
              f"(host issued it in {host * 1e3:.0f} ms{mem}; the first call {first:.1f} s)", flush=True)
    if ref is not None:
        print(f"  ratio ours / transformers: {results['transformers'] / results['nano-dsv4-rl']:.2f}x")
    if cli.profile:  # with stacks: the kernels' time by the model's part (eager; a replayed graph shows no ops)
        prof = profiled(lambda: time_train(ours, ids, ours_step, 1, 0, device), device, 1, cli.trace,
                        record_shapes=bool(cli.trace), with_stack=True)
        trace_summary.by_region(prof.events())


if __name__ == "__main__":
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, cli.dtype)
    args = ModelArgs.from_json(cli.model)
    compile_policy.use_compile(cli.compile)
    cpu = f"{os.cpu_count()} cores" if cli.what == "sync" else f"{torch.get_num_threads()} threads"
    versions = f"{torch.cuda.get_device_name() if device.type == 'cuda' else f'CPU ({cpu})'}, torch {torch.__version__}"
    if cli.layers:
        n, args.num_hidden_layers = args.num_hidden_layers, cli.layers
        args.compress_ratios = args.compress_ratios[:cli.layers] + args.compress_ratios[n:]  # MTP's entries stay
        args.num_hash_layers = min(args.num_hash_layers, cli.layers)
    if cli.what == "sync":
        bench_sync(args, dtype, device, versions)
        raise SystemExit
    args.num_nextn_predict_layers = 0  # transformers has no MTP; compare the trunk
    args.compress_ratios = args.compress_ratios[:args.num_hidden_layers]
    torch.manual_seed(0)
    with torch.device("meta"):  # then made on the device and drawn there: Flash's widths are ~13 GB a layer in bf16
        ours = Transformer(copy.deepcopy(args), dtype=dtype)  # (--model=config/models/flash.json --layers=N)
    ours.to_empty(device=device).init_weights(draw_on=device)
    ours.set_kernels(choose_kernels(cli.kernels, args, device, dtype)).set_fp8_training(cli.train_quant == "fp8")
    if cli.compile != "off":
        compile_policy.compile_model(ours, cli.compile)
    if cli.what == "mismatch":
        from compare_logprobs import wide_init_
        bench_mismatch(wide_init_(ours), args, device, versions)
        raise SystemExit
    import transformers
    logging.getLogger("transformers").setLevel(logging.ERROR)
    ref = None
    if not cli.no_peer:  # the peer: a copy of ours, through a checkpoint on disk
        with tempfile.TemporaryDirectory() as d:
            save_pretrained(ours, d)
            ref = transformers.DeepseekV4ForCausalLM.from_pretrained(d, dtype=dtype).to(device)
        ref.train(cli.what == "train")
    versions += f", transformers {transformers.__version__}"
    if cli.what == "decode":
        bench_decode(ours, ref, args, device, versions)
    else:
        bench_train(ours, ref, args, device, dtype, versions)
