"""Where the engine's prefill spends its time (session 29): KVCache.prefill of 64 prompts of 32 tokens on bench_2b (the
batch bench.py's decode admits; 109-157 ms a call in session 28 on an H200, eager). Two warm calls timed, then one
under torch.profiler: the wall time against the device's kernel time, the host's waits on the device (synchronising
calls and device-to-host copies), the ops with the most host time and the kernels with the most device time.
python bench/probe_prefill.py [--model config/models/bench_2b.json] [--batch 64] [--seq 32] [--compile]   (a GPU; a CPU
runs tiny)"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from kv_cache import KVCache  # noqa: E402
from model_dsv4 import ModelArgs, Transformer  # noqa: E402

cuda = torch.cuda.is_available()
p = argparse.ArgumentParser()
p.add_argument("--model", default="config/models/bench_2b.json" if cuda else "config/models/tiny.json")
p.add_argument("--batch", type=int, default=64)
p.add_argument("--seq", type=int, default=32)
p.add_argument("--compile", action="store_true", help="also compile_layers' prefill, timed after the eager one")
cli = p.parse_args()
dev = torch.device("cuda" if cuda else "cpu")
args = ModelArgs.from_json(cli.model)
args.num_nextn_predict_layers = 0
torch.manual_seed(0)
model = Transformer(args, dtype=torch.bfloat16 if cuda else torch.float32).to(dev)
model.set_kernels(cuda)
model.stack_experts()
cache = KVCache(model, cli.batch + 1, cli.seq + 64, dev)
prompts = torch.randint(2, args.vocab_size, (cli.batch, cli.seq)).tolist()
slots = list(range(cli.batch))


def run():
    with torch.no_grad():
        cache.reset(slots)
        out = cache.prefill(model, slots, prompts)
    if cuda:
        torch.cuda.synchronize()
    return out


def gap(got, ref):
    """max |Δ logits| / max |logits| against ref's, and |Δ logprob| averaged under ref's distribution"""
    lp, lp_ref = got.float().log_softmax(-1), ref.float().log_softmax(-1)
    return ((got - ref).abs().max() / ref.abs().max()).item(), (lp_ref.exp() * (lp - lp_ref).abs()).sum(-1).mean().item()


for i in range(3):
    t0 = time.perf_counter()
    run()
    print(f"prefill {cli.batch} x {cli.seq} tokens, call {i + 1}: {(time.perf_counter() - t0) * 1e3:.1f} ms", flush=True)
if cli.compile:  # session 30: KVCache.prefill_layer compiled (kernels_torch.compile_layers; the length padded to 128)
    import copy
    import kernels_torch
    eager = run()
    with torch.no_grad():  # the scale of bf16's own error (session 31): both against an fp32 copy of the model
        m32 = copy.deepcopy(model).set_dtype(torch.float32)
        m32.stack_experts()
        ref = KVCache(m32, cli.batch + 1, cli.seq + 64, dev).prefill(m32, slots, prompts)
        del m32
    kernels_torch.compile_layers(backend="inductor" if cuda else "aot_eager")
    for i in range(3):
        t0 = time.perf_counter()
        got = run()
        print(f"compiled, call {i + 1}: {(time.perf_counter() - t0) * 1e3:.1f} ms", flush=True)
    print("compiled against eager: max |Δ logits| / max |logits| %.1e, mean |Δ logprob| %.2e" % gap(got, eager))
    for name, out in (("eager", eager), ("compiled", got)):
        print("%s against the fp32 model: max |Δ logits| / max |logits| %.1e, mean |Δ logprob| %.2e"
              % (name, *gap(out, ref)))
    print("the profile below is the compiled prefill's")
acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
with profile(activities=acts) as prof:
    t0 = time.perf_counter()
    run()
    wall = time.perf_counter() - t0
events = prof.key_averages()
kernel_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
waits = {e.key: e.count for e in events if e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize",
                                                      "cudaMemcpyAsync", "aten::item", "aten::_local_scalar_dense")}
print(f"profiled: wall {wall * 1e3:.1f} ms, kernel time {kernel_us / 1e3:.1f} ms; host calls {waits}")
print(events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
if cuda:
    print(events.table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=60))
