"""compile_policy.compile_engine in the embedded engine: the compiled decode step against the eager engine and the
forward, the compiled sampler and the Sinkhorn loop compiled code takes, Engine.warm_up's compiles before the first
request (on the CPU with the aot_eager backend, on a GPU with inductor); and the startup refusals of compile='layers' on
the CPU (inductor's C++ code for the decode step does not build there) and of compiling with --invariant. The trainer's
side: test_compile.py."""
import copy
import os

import pytest
import torch

from conftest import SMALL, randomize_
from helpers.script import run_script
from model_dsv4 import Transformer

CUDA = torch.cuda.is_available()


@pytest.mark.slow
def test_compiled_decode_warms_up_once_a_kind_and_is_as_close_as_eager(compile_layers):
    """The engine's compiled decode step (compile_policy.compile_engine, CPU, bf16), CSA and HCA layers. Engine.warm_up
    (server.py --compile layers, before the ready line) prefills twice and decodes once at every batch bucket
    on the scratch slot: the compiles happen there, the decode's once for every bucket (the batch is symbolic from
    the first call, compile_policy._dynamic_dims; a second bucket compiling again doubled a cold start), and decodes
    at other batch sizes and a prefill of another batch size afterwards compile nothing. Then its logprobs are as
    close to the training forward's as the eager engine's are, and it samples from the same distributions."""
    from dataclasses import replace
    from engine import Engine, SamplingParams
    args = replace(SMALL, num_hidden_layers=2, compress_ratios=[4, 128, 4], num_nextn_predict_layers=1)
    dev = "cuda" if CUDA else "cpu"
    model = randomize_(Transformer(copy.deepcopy(args), dtype=torch.float32), args.n_routed_experts,
                       args.num_experts_per_tok, seed=6).set_dtype(torch.bfloat16).set_kernels(True).to(dev)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(2, args.vocab_size, (n,), generator=g).tolist() for n in (5, 19, 40)]
    params = [SamplingParams(temperature=1.0, max_new_tokens=24, ignore_eos=True, seed=s) for s in range(3)]

    def gap(reqs):
        out = []
        for r in reqs:
            ids = torch.tensor(r.input_ids + r.output_ids, device=dev)[None]
            with torch.no_grad(), torch.compiler.set_stance("force_eager"):  # the reference: eager forward
                lp = model(ids)[0, len(r.input_ids) - 1:-1].log_softmax(-1)
            lp = lp.gather(-1, ids[0, len(r.input_ids):, None])[:, 0].cpu()
            out.append((lp - torch.tensor(r.output_logprobs)).abs())
        return torch.cat(out).mean().item()
    eager = gap(Engine(model, max_batch=4, max_len=80).generate(prompts, params))
    engine = Engine(model, max_batch=8, max_len=80)
    counters = compile_layers(engine)
    calls, graphs = [], []
    engine.warm_up(lambda *a: (calls.append(a), graphs.append(counters["stats"]["unique_graphs"])))
    assert engine.buckets == [2, 4, 8] and len(set(graphs)) == 1, graphs  # no bucket after the first compiles
    assert calls == [(i + 1, len(engine.buckets), b) for i, b in enumerate(engine.buckets)]  # the log's progress
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 4  # two kinds of layer and the head, in the prefill and the decode
    for b in (3, 5, 8):  # without autograd in any caller's mode (inductor fails with it on the H200: mm_f32)
        out = engine.decode(torch.arange(b), torch.randint(2, args.vocab_size, (b,)), torch.full((b,), 7))
        assert not out.requires_grad
    out = engine.prefill([0, 1, 2, 3], [[5] * n for n in (3, 60, 17, 40)])  # 4 prompts up to 60 tokens, padded
    assert not out.requires_grad and counters["stats"]["unique_graphs"] == graphs
    compiled = gap(engine.generate(prompts, params))
    assert compiled <= 2 * eager + 0.01, (compiled, eager)


@pytest.mark.slow
def test_compiled_sampler_and_sinkhorn_equal_eager(compile_layers):
    """The sampler compile_engine gives an engine draws the eager sampler's tokens, and the Sinkhorn loop
    that compiled code takes without autograd (mhc.sinkhorn_entries, one tensor per entry) gives the batched
    loop's mixes, and compiled code with autograd keeps the batched loop (mixes and gradient as eager's)."""
    import engine
    from mhc import hc_split_sinkhorn
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 500, generator=g) * 3
    params = torch.tensor([[1.0, 1.0, 500], [0.5, 1.0, 500], [0.0, 1.0, 500], [1.0, 0.9, 500], [1.0, 1.0, 7],
                           [0.7, 0.8, 20]], dtype=torch.float64)  # temperature, top_p, top_k
    draws = torch.tensor([[11, 0], [12, 5], [13, 9], [2 ** 62, 1], [5, 100], [6, 3]])  # seed, token index
    eager = engine.sample_tokens
    want = [eager(logits[:k], params[:k], draws[:k], k > 3) for k in (3, 6)]
    model = Transformer(copy.deepcopy(SMALL), dtype=torch.float32)
    compiled = engine.Engine(model, max_batch=4, max_len=16)
    compile_layers(compiled)
    assert compiled.sample_tokens is not eager and engine.sample_tokens is eager  # the engine's, not the module's
    for k, w in zip((3, 6), want):
        got = compiled.sample_tokens(logits[:k], params[:k], draws[:k], k > 3)
        assert torch.equal(got[0], w[0]) and (got[1] - w[1]).abs().max() < 1e-5
    mixes = torch.randn(2, 7, 24, generator=g, requires_grad=True)
    args = (mixes, torch.randn(3, generator=g), torch.randn(24, generator=g), 4, 20, 1e-6)
    dys = [torch.randn(2, 7, *s, generator=g) for s in ((4,), (4,), (4, 4))]
    grad_of = lambda outs: torch.autograd.grad(sum((o * d).sum() for o, d in zip(outs, dys)), mixes)[0]
    want = hc_split_sinkhorn(*args)
    want_grad = grad_of(want)
    counts = {}
    for grad in (False, True):
        torch._dynamo.reset()
        with torch.set_grad_enabled(grad):
            graph = torch._dynamo.explain(hc_split_sinkhorn)(*args).graphs[0]
            got = torch.compile(hc_split_sinkhorn, backend="aot_eager")(*args)
        counts[grad] = sum(n.target is torch.stack for n in graph.graph.nodes)  # sinkhorn_entries stacks its entries
        for a, b in zip(want, got):
            assert (a - b).abs().max() < 1e-6
        if grad:
            assert (grad_of(got) - want_grad).abs().max() < 1e-5 * want_grad.abs().max()
    assert counts == {False: 5, True: 0}, counts


CPU_ONLY = pytest.mark.skipif(CUDA, reason="the refusal is for machines without a GPU")


@pytest.mark.parametrize("cmd,expect", [
    pytest.param(["train_grpo.py", "--compile=layers"], "compile='layers' needs a GPU", marks=CPU_ONLY),
    pytest.param(["server.py", "--model", ".", "--compile", "layers"], "--compile layers needs a GPU",
                 marks=CPU_ONLY),
    (["train_grpo.py", "--invariant=True", "--compile=layers"], "invariant=True runs eager"),
    (["server.py", "--model", ".", "--invariant", "--compile", "layers"], "--invariant runs eager")])
def test_startup_refusals(cmd, expect):
    """Exit 2 with the reason at startup, not an inductor error at the first rollout: compile='layers' without a
    GPU, and compiling with path-invariant numerics (a dispatch mode the compiled graphs would bypass)."""
    code, _, err = run_script(*cmd)  # in this process: the check comes before anything is built
    assert code == 2 and expect in err, err[-2000:]


@pytest.mark.slow
def test_compiled_prefill_equals_eager_and_stops_compiling(compile_layers):
    """The engine's compiled prefill (KVCache.prefill_layer under compile_kv_cache, its prompts padded to a multiple of
    model_dsv4.length_multiple: 128 here) against the eager one: SMALL's window, CSA and HCA layers, fp32, prompts of
    5, 19 and 150 tokens (padded to 256), then 4 eager decode steps from the caches it filled. The last-position
    logits of the prefill and every decode step's logits to 1e-5 of the largest: the padding reaches nothing that is
    read. (The compiled decode: the warm-up test above.) Then prefills of 2 prompts of 130 and 470 tokens (512) and of
    4 of 10-300 (384): the second may compile again once (batch and length of a graph's piece after a break become
    dynamic), the third compiles nothing: the lengths fall in one class of the compiled layers' guards. (A first
    prefill padded to 128 holds one HCA entry, a size dynamo specialises: the next length compiles every layer
    again, ~10 s here. Each prefill holds its own number of tokens: a piece that saw one count twice keeps it
    static.)"""
    from dataclasses import replace
    from kv_cache import KVCache
    args = replace(SMALL, num_hidden_layers=3, compress_ratios=[0, 4, 128, 0], num_nextn_predict_layers=1)
    dev = "cuda" if CUDA else "cpu"
    model = randomize_(Transformer(copy.deepcopy(args), dtype=torch.float32), args.n_routed_experts,
                       args.num_experts_per_tok, seed=4).to(dev)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, args.vocab_size, (n,), generator=g).tolist() for n in (5, 19, 150)]
    tokens = torch.randint(2, args.vocab_size, (4, 3), generator=g).to(dev)
    slots, L = torch.tensor([2, 0, 1], device=dev), torch.tensor([5, 19, 150], device=dev)

    def run(compile=False):
        cache = KVCache(model, 4, 600, dev)
        if compile:
            run.counters = compile_layers(cache)
        with torch.no_grad():
            out = [cache.prefill(model, slots.tolist(), prompts)]
            with torch.compiler.set_stance("force_eager"):  # compiling the decode too doubles the test's time
                out += [cache.decode(model, slots, tokens[i], L + i) for i in range(4)]
        return cache, out
    _, eager = run()
    cache, compiled = run(compile=True)
    counters = run.counters
    for e, c in zip(eager, compiled):
        assert (e - c).abs().max() <= 1e-5 * e.abs().max(), ((e - c).abs().max(), e.abs().max())
    with torch.no_grad():
        second = [torch.randint(2, args.vocab_size, (n,), generator=g).tolist() for n in (130, 470)]
        cache.prefill(model, [3, 1], second)
        graphs = counters["stats"]["unique_graphs"]
        cache.prefill(model, [0, 1, 2, 3],
                      [torch.randint(2, args.vocab_size, (n,), generator=g).tolist() for n in (270, 300, 10, 140)])
    assert counters["stats"]["unique_graphs"] == graphs


def test_warnings_once_and_the_cache_dir(monkeypatch):
    """compile_policy.warn_once: a warning shows once even though the filters change between its repeats (as
    torch.compile's catch_warnings does, which makes Python's own once-per-place memory forget it); another text still
    shows. set_cache_dir: the compile cache goes where the config says, unless TORCHINDUCTOR_CACHE_DIR is set."""
    import warnings
    import compile_policy
    shown = []
    monkeypatch.setattr(warnings, "showwarning", lambda message, *a, **k: shown.append(str(message)))
    monkeypatch.setattr(warnings, "filters", [])
    warnings.simplefilter("default")  # Python's own policy: once per place

    def warn_three_times():
        for _ in range(3):
            warnings.warn("inductor decides to split the reduction", UserWarning)
            with warnings.catch_warnings():  # what dynamo and inductor's CUDA-graph trees do around their work
                pass
        warnings.warn("another text", UserWarning)
    warn_three_times()
    assert shown.count("inductor decides to split the reduction") == 3  # without warn_once: every time
    shown.clear()
    compile_policy.warn_once()
    compile_policy.warn_once()  # a second call wraps nothing more
    warn_three_times()
    assert shown == ["inductor decides to split the reduction", "another text"], shown
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    for torch_default in (None, default_cache_dir()):  # importing inductor sets the variable to its default
        if torch_default:
            monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", torch_default)
        assert compile_policy.set_cache_dir("~/cc") == os.environ["TORCHINDUCTOR_CACHE_DIR"] == \
            os.path.expanduser("~/cc")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/mine")
    assert compile_policy.set_cache_dir("out/compile_cache") == "/tmp/mine"
