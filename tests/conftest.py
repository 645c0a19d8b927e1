"""Shared helpers for the tests: small random configs, a non-trivial re-randomisation of weights, embedded servers."""
import os
import subprocess
import sys
import time
from dataclasses import replace

import pytest
import torch

import dsv4_kernels.fast
from model_dsv4 import ModelArgs

# Two tiny shapes that between them cover every mechanism: window-only, CSA (overlap compressor + indexer)
# and HCA layers, hash and learned routing, hc_mult 4 and 2, one and several heads per output group.
TINY = ModelArgs()  # spec §7.1: ratios 0,0,4,16,4,16,4,0 (+ MTP), 3 hash layers, window 32, index_topk 8
SMALL = ModelArgs(vocab_size=512, hidden_size=128, num_hidden_layers=4, num_attention_heads=2, head_dim=64,
                  qk_rope_head_dim=32, q_lora_rank=64, o_groups=1, o_lora_rank=64, sliding_window=16,
                  compress_ratios=[4, 0, 128, 4, 0], index_n_heads=2, index_head_dim=64, index_topk=4,
                  n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, num_hash_layers=1,
                  hc_mult=2, hc_sinkhorn_iters=5, rope_scaling={"type": "yarn", "factor": 8,
                  "original_max_position_embeddings": 128, "beta_fast": 32, "beta_slow": 1},
                  max_position_embeddings=1024)
# For comparisons with transformers: 16 indexer heads. With few heads, many indexer scores are exactly 0
# (every head's ReLU at 0), and transformers' torch.topk breaks such ties arbitrarily, while we pick the
# earliest entry (a stable sort): the comparison is only defined without ties at the top-k cut.
TINY_16, SMALL_16 = replace(TINY, index_n_heads=16), replace(SMALL, index_n_heads=16)


@torch.no_grad()
def randomize_(model, n_experts, top_k, seed=0):
    """Give every tensor a non-trivial value, by name, for our model and for transformers' alike.
    A fresh model has zero sinks, unit norms and (in transformers) an all-zero tid2eid: a parity test
    on that would prove little (spec §4.6)."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda t: torch.randn(t.shape, generator=g)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name.endswith("tid2eid"):
            t.copy_(torch.rand(t.shape[0], n_experts, generator=g).argsort(-1)[:, :top_k])
        elif not t.is_floating_point() or "inv_freq" in name:
            continue
        elif "ape" in name or "position_bias" in name:
            t.copy_(rnd(t) * 0.5)
        elif "weights_proj" in name:  # positive head weights: indexer scores >= 0, exact ties only at 0
            t.copy_(rnd(t).abs() / t.shape[-1] ** 0.5)
        elif t.dim() >= 2:
            t.copy_(rnd(t) / t.shape[-1] ** 0.5)
        elif "norm" in name:
            t.copy_(1 + 0.2 * rnd(t))
        elif name.endswith("scale"):  # mHC scales
            t.copy_(0.5 + 0.2 * rnd(t))
        elif "bias" in name:  # router correction bias: steers selection
            t.copy_(0.1 * rnd(t))
        else:  # sinks, mHC bases
            t.copy_(rnd(t))
    return model


# The GPU tier, `python -m pytest -m gpu` on a machine with a GPU (README): these modules' tests run their kernels,
# compiled paths and CUDA graphs on the GPU when there is one; so do tests marked gpu in other modules (GPU-only
# ones, and tests/test_gpu_runs.py's runs of the GPU commands) and every test parametrized with device="cuda".
T0 = time.time()  # the session's start, near enough (conftest is read first)
GPU_MODULES = {"test_chunked_head", "test_compile", "test_compile_engine", "test_decode_attention",
               "test_decode_kernels", "test_fast_paths", "test_fast_paths_engine", "test_fp8_training", "test_graphs",
               "test_kernel_check", "test_mhc_kernels", "test_routing_kernels", "test_weights_in_place"}


def pytest_collection_modifyitems(items):
    for item in items:
        on_cuda = getattr(item, "callspec", None) is not None and item.callspec.params.get("device") == "cuda"
        if item.module.__name__ in GPU_MODULES or on_cuda:
            item.add_marker(pytest.mark.gpu)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """GPU_TIER_OUT=path: the run's summary as JSON there (GPU, torch, commit, date, counts, what failed), the record
    bench/results/gpu_tier.json keeps of the GPU tier's last run."""
    path = os.environ.get("GPU_TIER_OUT")
    if not path:
        return
    import datetime
    import json
    stats = terminalreporter.stats
    count = {k: len(stats.get(k, [])) for k in ("passed", "failed", "error", "skipped", "xfailed")}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))).stdout.strip()
    with open(path, "w") as f:
        json.dump({"command": "python -m pytest -m gpu", "args": config.invocation_params.args,
                   "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                   "torch": torch.__version__, "commit": commit, "date": datetime.date.today().isoformat(),
                   "seconds": round(time.time() - T0, 1), **count,
                   "not_passed": [r.nodeid for k in ("failed", "error") for r in stats.get(k, [])]}, f, indent=1)


@pytest.fixture
def compile_layers():
    """compile_policy at the call site for one test: compile_layers(*objects, graphs=False) compiles each model
    (compile_model), engine (compile_engine, and its model) or KV cache (compile_kv_cache) it is given and returns
    dynamo's counters; nothing outside those objects changes. On the CPU the backend is aot_eager (the same graphs,
    autograd and cache writes, run without code generation: inductor's C++ build takes minutes on 2 cores); on a GPU
    inductor."""
    import compile_policy
    from engine import Engine
    from kv_cache import KVCache
    backend = "inductor" if torch.cuda.is_available() else "aot_eager"

    def on(*objects, graphs=False):
        torch._dynamo.reset()
        for obj in objects:
            if isinstance(obj, Engine):
                compile_policy.compile_model(obj.model, backend=backend)
                compile_policy.compile_engine(obj, backend)
            elif isinstance(obj, KVCache):
                compile_policy.compile_kv_cache(obj, backend)
            else:
                compile_policy.compile_model(obj, "graphs" if graphs else "layers", backend)
        return torch._dynamo.utils.counters
    yield on
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def gemm_f32_switch():
    """Transformer.set_kernels given path names (server.start does it) sets the process-wide GEMM switch
    (dsv4_kernels.fast.GEMM_F32): each test starts from the default, so none leaks into the next."""
    yield
    dsv4_kernels.fast.use_gemm_f32(True)


@pytest.fixture(scope="module")
def one_torch_thread():
    """For modules that run several torch processes at once: on 2 shared cores, two OpenMP threads per process wait
    on each other's time slices (10x slower here)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def start_servers(ckpt, n=1, quant="none", ports=None, device="cpu"):
    """n embedded fp32 servers of a checkpoint (subprocesses, started together) -> [[process, url]]."""
    procs = [subprocess.Popen([sys.executable, "server.py", "--model", ckpt, "--port", str(port),
                               "--dtype", "float32", "--device", device, "--max-len", "128", "--quant", quant],
                              cwd=os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."),
                              stdout=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
             for port in ports or [0] * n]
    lines = [next((line for line in p.stdout if "ready at http://" in line), "") for p in procs]
    assert all(lines), "a server did not start (its stderr is above)"
    return [[p, line.split("ready at ")[1].split()[0]] for p, line in zip(procs, lines)]


def stop(servers):
    for p, _ in servers:
        p.terminate()
        p.wait(timeout=30)
