"""compile_policy.compile_model in the trainer: whole layers (each block's forward), the head and the last stage's head
+ GRPO loss under torch.compile against eager (on the CPU with the aot_eager backend, on a GPU with inductor), CUDA
graphs of the compiled layers step after step, the compiles a GRPO run's new shapes cost, and compiling at the call
site: one model compiled leaves the modules' functions and other models eager. The engine's side and the startup
refusals: test_compile_engine.py. The `compile_layers` fixture: conftest.py."""
import copy
import threading
from dataclasses import replace

import pytest
import torch

from conftest import SMALL, randomize_
from model_dsv4 import Transformer

CUDA = torch.cuda.is_available()


@pytest.mark.slow
def test_compile_layers_train_as_accurate_as_eager(compile_layers):
    """compile_layers, bf16: token logprobs and the gradients of every parameter are as close to the fp32 model as eager
    bf16 is (inductor keeps some intermediates in fp32 where eager rounds, so the two bf16 runs differ by bf16
    rounding). The trainer's activation recompute (parallel.stage_forward(recompute=True): each compiled layer run
    again inside the backward) gives the same logits and gradients as the compiled step without it. Then the GRPO
    step's shapes: micro-batches of other sizes and lengths, padded as train_grpo pads them (a multiple of the
    window and the compress ratios), and the GRPO loss compile nothing after their first: the batch and length are
    symbolic from the first call (compile_policy._dynamic_dims). Two layers (a kind compiles in ~15 s on 2 CPU
    cores): CSA with a hash router and HCA with a learned one; the window kind's compiled forward and backward: the
    call-site test below."""
    import parallel
    from grpo import grpo_loss, make_microbatches
    from model_dsv4 import length_multiple
    dev, args = "cuda" if CUDA else "cpu", replace(SMALL, num_hidden_layers=2, compress_ratios=[4, 128, 0])
    m32 = randomize_(Transformer(copy.deepcopy(args), dtype=torch.float32), args.n_routed_experts,
                     args.num_experts_per_tok, seed=4).set_kernels(True).to(dev)
    bf = copy.deepcopy(m32).set_dtype(torch.bfloat16)
    pad_to = length_multiple(args)  # train_grpo's, 128
    ids = torch.randint(0, args.vocab_size, (2, 2 * pad_to), generator=torch.Generator().manual_seed(5)).to(dev)

    def run(m, recompute=False, ids=ids):  # the trainer's stage and its last stage's head_loss
        probe = lambda logp, entropy, mb: (logp.mean() + 0.1 * entropy.mean(), logp.detach())
        loss, logp = m.head_loss(parallel.stage_forward(m, None, ids, recompute), {"tgt": ids.roll(-1, 1)}, probe)
        loss.backward()
        grads = torch.cat([p.grad.float().flatten() for p in m.parameters() if p.grad is not None])
        m.zero_grad()
        return logp.float(), grads
    exact, eager = run(m32), run(bf)
    counters = compile_layers(bf)
    compiled = run(bf)
    assert counters["stats"]["unique_graphs"] >= 3  # the layers ran compiled: a graph per kind of layer, and the head
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
        for mb in make_microbatches(groups, 2, 4.0, device=dev, pad_to=pad_to):  # the trainer's path: head + loss
            loss, _ = bf.head_loss(parallel.stage_forward(bf, None, mb["input_ids"]), mb, grpo_loss)
            loss.backward()
        if n == 3:
            graphs = counters["stats"]["unique_graphs"]  # the GRPO loss's first compile
    assert counters["stats"]["unique_graphs"] == graphs


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
    compile_layers(model)
    plain = steps()
    compile_layers(model, graphs=True)
    steps()  # inductor's first call of each layer warms up without graphs; the next ones record, then replay
    for a, b in zip(steps(), plain):  # not bit-equal: the backward's scatter-adds are atomic on a GPU
        assert (a - b).norm() <= 1e-3 * b.norm(), ((a - b).norm(), b.norm())


@pytest.mark.slow
def test_compiled_grpo_loss_equals_eager():
    """grpo.grpo_loss compiled where it is called, with KL and entropy terms: the loss, every metric and the gradients
    of the logprobs and entropies as eager's, fp32, two sequence lengths (the second compiles with dynamic shapes)."""
    import grpo
    g = torch.Generator().manual_seed(7)
    runs = []
    for T in (40, 57):
        stats = -torch.rand(2, T, generator=g) * 4, torch.rand(2, T, generator=g) * 3  # logprob, entropy
        mb = {"mask": torch.rand(2, T, generator=g) < 0.8, "adv": torch.randn(2, 1, generator=g).expand(2, T),
              "rollout_lp": -torch.rand(2, T, generator=g) * 3, "ref_lp": -torch.rand(2, T, generator=g) * 3,
              "weight": torch.full((2, T), 0.01), "first": torch.zeros(2, T, dtype=torch.bool)}
        mb["first"][:, 3] = True
        mb["old_lp"] = stats[0] + 0.3 * torch.randn(2, T, generator=g)  # ratios off 1: some clipped
        runs.append((stats, mb))
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    compiled = torch.compile(grpo.grpo_loss, backend="inductor" if CUDA else "aot_eager")
    for stats, mb in runs:
        out = []
        for loss_fn in (grpo.grpo_loss, compiled):
            x = [t.clone().requires_grad_() for t in stats]
            loss, metrics = loss_fn(*x, mb, kl_coef=0.05, entropy_coef=0.01)
            out.append((loss, *torch.autograd.grad(loss, x), metrics))
        (l0, ga0, gb0, m0), (l1, ga1, gb1, m1) = out
        torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ga1, ga0, rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(gb1, gb0, rtol=1e-4, atol=1e-7)
        assert ga0.abs().max() > 0 and gb0.abs().max() > 0 and m0["clip"] > 0
        assert m1.keys() == m0.keys()
        assert all(torch.allclose(m1[k].float(), m0[k].float(), rtol=1e-5, atol=1e-5) for k in m0)
    assert counters["stats"]["unique_graphs"] >= 1  # it ran compiled
    torch._dynamo.reset()


@pytest.mark.slow
def test_compile_at_the_call_site_changes_only_that_model_whose_expert_loop_runs_eagerly(compile_layers):
    """compile_model gives one model's blocks, head and head_loss compiled callables of their own: the classes' and
    modules' functions stay eager, so another model (or a fork's new loss) is untouched and runs eager. fp32 on a GPU
    (and kernels off anywhere) takes MoE.loop_experts, which reads the row counts on the host: compiled layers call it
    eagerly (a graph break: inductor fails on its data-dependent slices on an H200, in train_grpo.py's fp32 default)
    and give eager's logits and gradients. One block of each model: which model compiles matters here, not how
    much."""
    import grpo
    import model_dsv4
    before = (model_dsv4.Block.forward, model_dsv4.Transformer.logits, model_dsv4.Transformer.head_loss,
              grpo.grpo_loss, grpo.token_logprobs)
    dev, args = "cuda" if CUDA else "cpu", copy.deepcopy(SMALL)
    args.num_hidden_layers, args.num_nextn_predict_layers = 1, 0
    args.compress_ratios, args.num_hash_layers = [0], 0  # a window layer: the cheapest kind to compile
    model, other = (randomize_(Transformer(args, dtype=torch.float32), args.n_routed_experts,
                               args.num_experts_per_tok, seed=4).set_kernels(False).to(dev) for _ in range(2))

    def run(m, ids):
        logits = m(ids)
        logits.log_softmax(-1)[..., 3].mean().backward()
        grads = torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None])
        m.zero_grad()
        return logits.detach(), grads
    ids = torch.randint(0, SMALL.vocab_size, (2, 40), generator=torch.Generator().manual_seed(4)).to(dev)
    logits, grads = run(model, ids)
    counters = compile_layers(model)
    counters.clear()  # dynamo's counters outlive its reset: this test's own
    assert before == (model_dsv4.Block.forward, model_dsv4.Transformer.logits, model_dsv4.Transformer.head_loss,
                      grpo.grpo_loss, grpo.token_logprobs)
    assert all("forward" in vars(layer) for layer in model.layers.values()) and "logits" in vars(model)
    assert not any("forward" in vars(layer) for layer in other.layers.values()) and "logits" not in vars(other)
    run(other, ids)
    assert counters["stats"]["unique_graphs"] == 0  # the other model ran eager
    c_logits, c_grads = run(model, ids)
    assert counters["stats"]["unique_graphs"] >= 2
    assert (c_logits - logits).abs().max() <= 1e-4 * logits.abs().max()
    assert (c_grads - grads).abs().max() <= 1e-4 * grads.abs().max()
    assert any("loop_experts" in k for k in counters["graph_break"])


def test_compiled_head_loss_equals_eager(compile_layers):
    """Transformer.head_loss, the trainer's last stage (the stream collapse, the chunked head and the GRPO loss),
    compiled as one graph without a break (the chunked head is a custom op): loss, metrics and the gradients of the
    streams and the head's parameters as eager's (bf16 on a GPU, fp32 on the CPU), the entropy bonus on (its
    gradient through the head) and off. The old-policy logprobs (forward_only's head_loss with grpo.token_logprobs)
    too."""
    import grpo
    dev, dtype = ("cuda", torch.bfloat16) if CUDA else ("cpu", torch.float32)
    m = randomize_(Transformer(copy.deepcopy(SMALL), dtype=torch.float32), SMALL.n_routed_experts,
                   SMALL.num_experts_per_tok, seed=4).set_kernels(True).set_dtype(dtype).to(dev)
    g = torch.Generator().manual_seed(8)
    B, T, V = 2, 48, SMALL.vocab_size
    x0 = torch.randn(B, T, SMALL.hc_mult, SMALL.hidden_size, generator=g).to(dev, dtype)
    mb = {"tgt": torch.randint(0, V, (B, T), generator=g), "mask": torch.rand(B, T, generator=g) < 0.8,
          "adv": torch.randn(B, 1, generator=g).expand(B, T), "rollout_lp": -torch.rand(B, T, generator=g) * 3,
          "weight": torch.full((B, T), 0.01), "first": torch.zeros(B, T, dtype=torch.bool)}
    mb = {k: v.to(dev) for k, v in mb.items()}
    params = [m.head.weight, m.hc_head_fn, m.norm.weight]
    m.loss_chunk = 40  # B * T = 96 tokens: three chunks, the last one short

    def run(entropy_coef):
        x = x0.clone().requires_grad_()
        loss, metrics = m.head_loss(x, mb, lambda lp, ent, mb: grpo.grpo_loss(lp, ent, mb, entropy_coef=entropy_coef))
        grads = torch.autograd.grad(loss, [x] + params)
        with torch.no_grad():
            lp = m.head_loss(x0, mb, grpo.token_logprobs)
        return [loss, lp, *grads], metrics
    eager = [run(c) for c in (0.0, 0.05)]
    counters = compile_layers(m)
    counters.clear()  # dynamo's counters outlive its reset: this test's own
    compiled = [run(c) for c in (0.0, 0.05)]
    assert counters["stats"]["unique_graphs"] >= 2 and not counters["graph_break"]  # compiled, whole
    for (c_out, metrics), (e_out, eager_metrics) in zip(compiled, eager):
        for c, e in zip(c_out, e_out):
            assert e.float().norm() > 0
            assert (c.float() - e.float()).norm() <= (2e-2 if CUDA else 1e-5) * e.float().norm() + 1e-6
        assert metrics.keys() == eager_metrics.keys()
        assert all(torch.allclose(metrics[k].float(), eager_metrics[k].float(), rtol=1e-3, atol=1e-4) for k in metrics)
    assert (compiled[1][0][2] - compiled[0][0][2]).norm() > 1e-3 * compiled[0][0][2].norm()  # the bonus's gradient


def test_background_compile_hands_over_without_touching_gradients():
    """compile_policy.Background on the CPU (aot_eager; inductor on a GPU: test_graphs.py): a shape's first forward and
    backward run the eager blocks and hand the shape to the side thread, which compiles it without touching any
    parameter's gradient; from then on that shape runs the compiled graph, with eager's logits and gradients, also
    under activation recompute. A no-grad call is a shape of its own, eager until compiled."""
    import compile_policy
    import parallel
    torch._dynamo.reset()
    args = replace(SMALL, num_hidden_layers=2, compress_ratios=[4, 128, 0])
    model = randomize_(Transformer(copy.deepcopy(args), dtype=torch.float32), args.n_routed_experts,
                       args.num_experts_per_tok, seed=4)
    eager = copy.deepcopy(model)
    logs, calls = [], []
    bg = compile_policy.compile_model(model, "background", backend="aot_eager", log=logs.append).background
    compiled = bg.compiled
    bg.compiled = lambda *a, **kw: calls.append(threading.current_thread().name) or compiled(*a, **kw)
    ids = torch.randint(0, args.vocab_size, (2, 256), generator=torch.Generator().manual_seed(5))

    def run(m, ids=ids, recompute=None):  # recompute: through the trainer's stage, each block checkpointed
        logits = m(ids) if recompute is None else m.logits(parallel.stage_forward(m, None, ids, recompute))
        loss = logits.log_softmax(-1)[..., 3].mean()
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None])
        m.zero_grad(set_to_none=True)
        return loss.detach(), grads
    want = run(eager)
    first = run(model)
    main = lambda: [c for c in calls if c == threading.main_thread().name]  # the trainer's calls of compiled blocks
    assert main() == [] and len(bg.seen) == 1
    assert bg.join(300) and bg.failed is None and bg.version == 1, logs
    assert all(p.grad is None for p in model.parameters())  # the thread's backward reached only its inputs
    assert "ready" in logs[-1]
    second = run(model)
    assert len(main()) == 2  # both blocks, compiled
    checkpointed = run(model, recompute=True)  # compiled blocks under activation recompute: run again in backward
    assert len(main()) == 6
    for got in (first, second, checkpointed):
        for a, b in zip(got, want):
            assert (a - b).abs().max() <= 1e-4 * b.abs().max(), (a - b).abs().max()
    with torch.no_grad():
        model(ids)
    assert len(main()) == 6 and len(bg.seen) == 2  # a new shape runs eager, handed over
    assert bg.join(300) and bg.version == 2, logs
