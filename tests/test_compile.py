"""kernels.compile_layers: whole layers (Block.forward) and the engine's per-layer decode step under torch.compile,
against the eager functions they replace (on the CPU with the aot_eager backend, on a GPU with inductor), and the
CPU refusals of compile='layers' (inductor's C++ code for the decode step does not build there)."""
import copy
import os
import subprocess
import sys

import pytest
import torch

from conftest import SMALL, randomize_
from model_dsv4 import Transformer

CUDA = torch.cuda.is_available()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def compile_layers():
    """kernels.compile_layers for one test: call it to switch on; the eager functions come back at the end
    (it swaps them on the classes). Yields the switch; it returns dynamo's counters. On the CPU the backend is
    aot_eager (the same graphs, autograd and cache writes, run without code generation: inductor's C++ build
    takes minutes on 2 cores); on a GPU inductor."""
    import engine
    import grpo
    import kernels
    import model_dsv4
    saved = (model_dsv4.Block.forward, model_dsv4.Transformer.logits, engine.Engine._decode_layer, engine.sample_tokens,
             grpo.grpo_loss, grpo.token_logprobs)

    def on(graphs=False):
        torch._dynamo.reset()
        kernels.compile_layers(backend="inductor" if CUDA else "aot_eager", graphs=graphs)
        return torch._dynamo.utils.counters
    yield on
    (model_dsv4.Block.forward, model_dsv4.Transformer.logits, engine.Engine._decode_layer, engine.sample_tokens,
     grpo.grpo_loss, grpo.token_logprobs) = saved
    torch._dynamo.reset()


def test_compile_layers_train_as_accurate_as_eager(compile_layers):
    """compile_layers, bf16: logits and the gradients of every parameter are as close to the fp32 model as eager
    bf16 is (inductor keeps some intermediates in fp32 where eager rounds, so the two bf16 runs differ by bf16
    rounding). The trainer's activation recompute (parallel.stage_forward(recompute=True): each compiled layer run
    again inside the backward) gives the same logits and gradients as the compiled step without it. Then the GRPO
    step's shapes: micro-batches of other sizes and lengths, padded as train_grpo pads them (a multiple of the
    window and the compress ratios), and the GRPO loss compile nothing after their first: the batch and length are
    symbolic from the first call (kernels._dynamic_batch_and_length)."""
    import parallel
    from grpo import grpo_loss, make_microbatches
    from kernels import length_multiple
    dev = "cuda" if CUDA else "cpu"
    m32 = randomize_(Transformer(copy.deepcopy(SMALL), dtype=torch.float32), SMALL.n_routed_experts,
                     SMALL.num_experts_per_tok, seed=4).set_kernels(True).to(dev)
    bf = copy.deepcopy(m32).set_dtype(torch.bfloat16)
    pad_to = length_multiple(SMALL)  # train_grpo's, 128
    ids = torch.randint(0, SMALL.vocab_size, (2, 2 * pad_to), generator=torch.Generator().manual_seed(5)).to(dev)

    def run(m, recompute=None, ids=ids):
        logits = m(ids) if recompute is None else parallel.stage_forward(m, None, ids, recompute)
        logits.log_softmax(-1)[..., 3].mean().backward()
        grads = torch.cat([p.grad.float().flatten() for p in m.parameters() if p.grad is not None])
        m.zero_grad()
        return logits.detach().float(), grads
    exact, eager = run(m32), run(bf)
    counters = compile_layers()
    compiled = run(bf)
    assert counters["stats"]["unique_graphs"] >= 3  # the layers ran compiled: one graph per kind of layer
    for c, e, x in zip(compiled, eager, exact):
        err_c, err_e = ((t - x).norm() / x.norm() for t in (c, e))
        assert err_c <= 1.5 * err_e + 1e-4, (err_c, err_e)
    graphs = counters["stats"]["unique_graphs"]
    for a, b in zip(run(bf, recompute=True), run(bf, recompute=False)):  # a GPU's atomic adds may reorder sums
        assert torch.equal(a, b) if not CUDA else (a - b).norm() <= 1e-3 * b.norm()
    assert counters["stats"]["unique_graphs"] == graphs  # the same compiled layers, not new graphs
    g = torch.Generator().manual_seed(6)
    # padded lengths of 256, 384 and 384 (not 128: one HCA entry, a size dynamo specialises, compiles its own)
    for n, lengths in ((3, (150, 201)), (2, (140, 333)), (5, (300, 290))):
        groups = [(torch.randint(2, SMALL.vocab_size, (8,), generator=g).tolist(),
                   [{"output_ids": torch.randint(2, SMALL.vocab_size, (L - 8,), generator=g).tolist(),
                     "logprobs": [-1.0] * (L - 8)} for L in lengths], [1.0, -1.0])] * n
        for mb in make_microbatches(groups, 2, 4.0, device=dev, pad_to=pad_to):
            loss, _ = grpo_loss(bf(mb["input_ids"]), mb)
            loss.backward()
        if n == 3:
            graphs = counters["stats"]["unique_graphs"]  # the GRPO loss's (and token_logprobs') first compile
    assert counters["stats"]["unique_graphs"] == graphs


def test_reference_expert_loop_runs_eagerly_in_compiled_layers(compile_layers):
    """fp32 on a GPU (and kernels off anywhere) takes MoE.loop_experts, which reads the row counts on the host:
    compiled layers call it eagerly (a graph break; inductor had failed on its data-dependent slices on an H200, in
    train_grpo.py's fp32 default) and give eager's logits and gradients."""
    dev, args = "cuda" if CUDA else "cpu", copy.deepcopy(SMALL)
    args.num_hidden_layers, args.num_nextn_predict_layers = 1, 0  # one layer: one graph to compile
    args.compress_ratios, args.num_hash_layers = args.compress_ratios[:1], 0
    model = randomize_(Transformer(args, dtype=torch.float32), args.n_routed_experts, args.num_experts_per_tok,
                       seed=4).set_kernels(False).to(dev)

    def run(ids):
        logits = model(ids)
        logits.log_softmax(-1)[..., 3].mean().backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        model.zero_grad()
        return logits.detach(), grads
    batches = [torch.randint(0, SMALL.vocab_size, (2, 40), generator=torch.Generator().manual_seed(4)).to(dev)]
    eager = [run(ids) for ids in batches]
    counters = compile_layers()
    for ids, (logits, grads) in zip(batches, eager):
        c_logits, c_grads = run(ids)
        assert (c_logits - logits).abs().max() <= 1e-4 * logits.abs().max()
        assert (c_grads - grads).abs().max() <= 1e-4 * grads.abs().max()
    assert any("loop_experts" in k for k in counters["graph_break"])


@pytest.mark.skipif(not CUDA, reason="CUDA graphs")
def test_compile_graphs_equal_compiled_step_after_step(compile_layers):
    """compile_layers(graphs=True): each layer's forward and backward replayed from CUDA graphs give the logits and
    gradients of the same compiled layers run without graphs, for three steps on other batches (a replay writes
    into the buffers of the last one: a step that read a stale buffer would differ here)."""
    model = randomize_(Transformer(copy.deepcopy(SMALL), dtype=torch.float32), SMALL.n_routed_experts,
                       SMALL.num_experts_per_tok, seed=4).set_kernels(True).set_dtype(torch.bfloat16).to("cuda")
    g = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, SMALL.vocab_size, (2, 96), generator=g).cuda() for _ in range(3)]

    def steps():
        out = []
        for ids in batches:
            torch.compiler.cudagraph_mark_step_begin()
            logits = model(ids)
            logits.log_softmax(-1)[..., 3].mean().backward()
            out.append(torch.cat([logits.detach().float().flatten()] +
                                 [p.grad.float().flatten() for p in model.parameters() if p.grad is not None]))
            model.zero_grad(set_to_none=True)
        return out
    compile_layers()
    plain = steps()
    compile_layers(graphs=True)
    steps()  # inductor's first call of each layer warms up without graphs; the next ones record, then replay
    for a, b in zip(steps(), plain):  # not bit-equal: the backward's scatter-adds are atomic on a GPU
        assert (a - b).norm() <= 1e-3 * b.norm(), ((a - b).norm(), b.norm())


def test_compile_layers_decode_as_close_as_eager(compile_layers):
    """The engine's compiled decode step (kernels.compile_layers, CPU, bf16): its logprobs are as close to the
    training forward's as the eager engine's are, and it samples from the same distributions."""
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
    counters = compile_layers()
    compiled = gap(Engine(model, max_batch=4, max_len=80).generate(prompts, params))
    assert counters["stats"]["unique_graphs"] >= 2
    assert compiled <= 2 * eager + 0.01, (compiled, eager)


def test_compiled_sampler_and_sinkhorn_equal_eager(compile_layers):
    """What compile_layers swaps in for the engine's sampler draws the eager sampler's tokens, and the Sinkhorn loop
    that compiled code takes without autograd (model_dsv4.sinkhorn_entries, one tensor per entry) gives the batched
    loop's mixes, and compiled code with autograd keeps the batched loop (mixes and gradient as eager's)."""
    import engine
    from model_dsv4 import hc_split_sinkhorn
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 500, generator=g) * 3
    params = torch.tensor([[1.0, 1.0, 500], [0.5, 1.0, 500], [0.0, 1.0, 500], [1.0, 0.9, 500], [1.0, 1.0, 7],
                           [0.7, 0.8, 20]], dtype=torch.float64)  # temperature, top_p, top_k
    draws = torch.tensor([[11, 0], [12, 5], [13, 9], [2 ** 62, 1], [5, 100], [6, 3]])  # seed, token index
    eager = engine.sample_tokens
    want = [eager(logits[:k], params[:k], draws[:k], k > 3) for k in (3, 6)]
    compile_layers()
    assert engine.sample_tokens is not eager
    for k, w in zip((3, 6), want):
        got = engine.sample_tokens(logits[:k], params[:k], draws[:k], k > 3)
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


def test_compiled_grpo_losses_equal_eager(compile_layers):
    """The GRPO losses compile_layers compiles (grpo.grpo_loss with KL and entropy terms, grpo.token_logprobs): the
    loss, every metric and the logits' gradient as eager's, fp32, two sequence lengths (the second compiles with
    dynamic shapes)."""
    import grpo
    g = torch.Generator().manual_seed(7)
    runs = []
    for T in (40, 57):
        logits = torch.randn(2, T, 300, generator=g) * 4
        mb = {"tgt": torch.randint(0, 300, (2, T), generator=g), "mask": torch.rand(2, T, generator=g) < 0.8,
              "adv": torch.randn(2, 1, generator=g).expand(2, T), "rollout_lp": -torch.rand(2, T, generator=g) * 3,
              "ref_lp": -torch.rand(2, T, generator=g) * 3, "weight": torch.full((2, T), 0.01),
              "first": torch.zeros(2, T, dtype=torch.bool)}
        mb["first"][:, 3] = True
        runs.append((logits, mb))
    eager_fns = grpo.grpo_loss, grpo.token_logprobs
    counters = compile_layers()
    assert grpo.grpo_loss is not eager_fns[0] and grpo.token_logprobs is not eager_fns[1]
    for logits, mb in runs:
        out = []
        for loss_fn, lp_fn in (eager_fns, (grpo.grpo_loss, grpo.token_logprobs)):
            x = logits.clone().requires_grad_()
            loss, metrics = loss_fn(x, mb, kl_coef=0.05, entropy_coef=0.01)
            lp = lp_fn(x, mb)
            (gx,) = torch.autograd.grad(loss + lp.sum() * 1e-3, [x])
            out.append((loss, lp, gx, metrics))
        (l0, lp0, g0, m0), (l1, lp1, g1, m1) = out
        torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lp1, lp0, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(g1, g0, rtol=1e-4, atol=1e-7)
        assert m1.keys() == m0.keys() and all(torch.allclose(m1[k].float(), m0[k].float(), rtol=1e-5, atol=1e-5) for k in m0)
    assert counters["stats"]["unique_graphs"] >= 2  # both ran compiled, whole (no graph break: explain() says none)


CPU_ONLY = pytest.mark.skipif(CUDA, reason="the refusal is for machines without a GPU")


@pytest.mark.parametrize("cmd,expect", [
    pytest.param(["train_grpo.py", "--compile=layers"], "compile='layers' needs a GPU", marks=CPU_ONLY),
    pytest.param(["rollout.py", "--serve", "--model", ".", "--compile", "layers"], "--compile layers needs a GPU",
                 marks=CPU_ONLY),
    (["train_grpo.py", "--invariant=True", "--compile=hot"], "invariant=True runs eager"),
    (["rollout.py", "--serve", "--model", ".", "--invariant", "--compile", "hot"], "--invariant runs eager")])
def test_startup_refusals(cmd, expect):
    """Exit 2 with the reason at startup, not an inductor error at the first rollout: compile='layers' without a
    GPU, and compiling with path-invariant numerics (a dispatch mode the compiled graphs would bypass)."""
    p = subprocess.run([sys.executable, *cmd], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and expect in p.stderr, p.stderr[-2000:]


def test_engine_warm_up_compiles_every_batch_size_first(compile_layers):
    """Engine.warm_up (rollout.py --serve --compile layers, before the ready line) decodes once at every batch
    bucket on the scratch slot: the compiles of the decode step happen there (the first bucket with a static batch,
    the next with a dynamic one), and decodes at other batch sizes afterwards compile nothing."""
    from dataclasses import replace
    from engine import Engine
    args = replace(SMALL, num_hidden_layers=2, compress_ratios=[0, 4, 0], num_nextn_predict_layers=1)
    dev = "cuda" if CUDA else "cpu"
    model = randomize_(Transformer(copy.deepcopy(args), dtype=torch.float32), args.n_routed_experts,
                       args.num_experts_per_tok, seed=6).set_dtype(torch.bfloat16).set_kernels(True).to(dev)
    counters = compile_layers()
    engine = Engine(model, max_batch=8, max_len=64)
    engine.warm_up()
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 4  # two kinds of layer and the head, each again once the batch size moved
    for b in (3, 5, 8):
        engine.decode(torch.arange(b), torch.randint(2, args.vocab_size, (b,)), torch.full((b,), 7))
    assert counters["stats"]["unique_graphs"] == graphs
