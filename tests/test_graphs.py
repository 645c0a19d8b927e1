"""Training micro-batches as CUDA graphs (graphs.py): the buckets, padding that changes no loss, metric or gradient,
AdamW's chunked step equal to the whole one, and on a GPU graphed GRPO steps equal to eager ones, the graphs reading
the parameters where the optimizer and a load in place write them."""
import copy
import threading

import pytest
import torch

import parallel
from conftest import SMALL, randomize_
from graphs import StepGraphs, bucket, pad
from grpo import grpo_loss, make_microbatches, token_logprobs
from model_dsv4 import Transformer, pack_multiple
from optimizer import AdamW

CUDA = torch.cuda.is_available()


def test_buckets_bound_the_padding_and_the_shapes():
    """Every size rounds up by at most 1 / per_octave, and a range of sizes meets few buckets."""
    for per in (4, 8):
        sizes = [bucket(n, per) for n in range(1, 5000)]
        assert all(n <= b <= n * (1 + 1 / per) for n, b in enumerate(sizes, 1))
        assert len(set(sizes[1000:2000])) <= per + 1 and sizes == sorted(sizes)
    assert bucket(300, 8) == 320 and bucket(8, 4) == 8 and bucket(9, 4) == 10


def grpo_microbatches(seed, longest, n_micro=2, device="cpu"):
    """Packed GRPO micro-batches: groups of short samples and one of `longest` tokens, two samples a row (they start
    at multiples of pack_multiple, 128), advantages and rollout logprobs off the policy."""
    g = torch.Generator().manual_seed(seed)
    groups = []
    for i in range(4):
        lengths = [longest if i == 0 and j == 0 else int(torch.randint(30, 120, (1,), generator=g)) for j in range(4)]
        prompt = torch.randint(2, SMALL.vocab_size, (6,), generator=g).tolist()
        samples = [{"output_ids": torch.randint(2, SMALL.vocab_size, (L - 6,), generator=g).tolist(),
                    "logprobs": (-torch.rand(L - 6, generator=g) * 3).tolist()} for L in lengths]
        groups.append((prompt, samples, torch.randn(4, generator=g).tolist()))
    return make_microbatches(groups, n_micro, 16.0, device=device, args=SMALL, pack=pack_multiple(SMALL))


def small_model(device="cpu", dtype=torch.float32):
    m = randomize_(Transformer(copy.deepcopy(SMALL), dtype=torch.float32), SMALL.n_routed_experts,
                   SMALL.num_experts_per_tok, seed=3)
    return m.set_kernels(device != "cpu").set_dtype(dtype).to(device)


def test_padding_changes_no_loss_metric_or_gradient():
    """A packed micro-batch (window, CSA and HCA layers, a hash-routed one) and the same padded to more rows and a
    longer length: the loss, every metric and every parameter's gradient agree, fp32, CPU."""
    model = small_model()
    mb = grpo_microbatches(0, 230)[0]
    assert "seg" in mb and mb["mask"].sum() > 0
    out = []
    for m in (mb, pad(mb, mb["input_ids"].shape[0] + 3, mb["input_ids"].shape[1] + 37)):
        loss, extra, _ = parallel.stage_loss(model, None, m, grpo_loss)
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        out.append((loss.detach(), extra, grads))
        model.zero_grad(set_to_none=True)
    (l0, m0, g0), (l1, m1, g1) = out
    assert g0.norm() > 0 and l0 != 0
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-6)
    assert all(torch.allclose(m1[k].float(), m0[k].float(), rtol=1e-5, atol=1e-6) for k in m0)
    assert (g1 - g0).norm() <= 1e-5 * g0.norm()


def test_adamw_chunks_equal_torchs_adamw():
    """AdamW.step a few parameters at a time (chunk=70 elements) and all at once: for two steps, bf16 and fp32
    parameters, the weights of torch's AdamW on fp32 copies of them (matrices decayed), and every gradient taken."""
    torch.manual_seed(0)
    shapes = ((8, 8), (30,), (5, 7), (64,), (3,))
    dtypes = [torch.bfloat16 if i % 2 else torch.float32 for i in range(len(shapes))]
    ref = [torch.nn.Parameter(torch.randn(s).to(d).float()) for s, d in zip(shapes, dtypes)]  # the masters' start
    runs = [[torch.nn.Parameter(p.detach().to(d)) for p, d in zip(ref, dtypes)] for _ in range(2)]
    opts = [AdamW(ps, lr=1e-2, weight_decay=0.1) for ps in runs]
    torch_opt = torch.optim.AdamW([{"params": [p for p in ref if p.dim() >= 2], "weight_decay": 0.1},
                                   {"params": [p for p in ref if p.dim() < 2], "weight_decay": 0.0}],
                                  lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    for _ in range(2):
        for i, p in enumerate(ref):
            p.grad = torch.randn_like(p).to(runs[0][i].dtype).float()
            for ps in runs:
                ps[i].grad = p.grad.to(ps[i].dtype)
        opts[0].step(chunk=70)
        opts[1].step()
        torch_opt.step()
        assert all(p.grad is None for ps in runs for p in ps)
    for i, p in enumerate(ref):
        assert torch.equal(runs[0][i], runs[1][i]) and torch.equal(runs[0][i], p.detach().to(runs[0][i].dtype))
        assert not torch.equal(p, torch.zeros_like(p))


class Spy(AdamW):
    """AdamW that keeps a copy of the gradients it steps on."""
    def step(self, **kw):
        self.seen = torch.cat([p.grad.float().flatten() for p in self.params])
        super().step(**kw)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs")
def test_graphed_grpo_steps_equal_eager():
    """bf16, packed rows, window / CSA / HCA layers, hash and learned routers, activation recompute: four GRPO steps
    through StepGraphs (a capture, replays, a new length's capture) against the eager 1F1B schedule from the same
    weights. Each step's loss, grad norm and gradients agree within bf16 rounding, and differ from step to step (the
    replays read new inputs and the weights AdamW wrote, at the addresses they had). Then the no-grad logprob pass
    replayed equals eager, and after a load in place into the parameters, equals eager's new output. No graph is
    captured twice: the parameters keep their addresses from the first capture on."""
    grid = parallel.init_distributed(1, 1)
    base = small_model("cuda", torch.bfloat16)
    steps = [grpo_microbatches(s, L, device="cuda") for s, L in ((1, 240), (2, 250), (3, 245), (4, 300))]
    runs = []
    logs = []
    for graphed in (False, True):
        model = copy.deepcopy(base)
        opt = Spy(model.parameters(), lr=1e-3)
        graphs = StepGraphs(model, grid, log=logs.append) if graphed else None
        model.stack_experts()  # as the first forward, or StepGraphs before its first capture, would
        where = [p.data_ptr() for p in model.parameters()]
        out = []
        for mbs in steps:
            m = parallel.train_step(model, grid, opt, mbs, grpo_loss, 1.0, graphs.train if graphs else "1f1b", True)
            out.append((m["loss"], m["grad_norm"], opt.seen, graphs.take_counts() if graphs else None))
        assert [p.data_ptr() for p in model.parameters()] == where
        runs.append((model, graphs, out))
    (_, _, e_out), (model, graphs, g_out) = runs
    seen, expect = set(), []  # a bucket's first micro-batch is captured, its later ones replayed
    for mbs in steps:
        expect.append(dict(graph_replayed=0, graph_captured=0, graph_eager=0))
        for mb in mbs:
            B, T = mb["input_ids"].shape
            key = (bucket(B, 4), bucket(T, 8), tuple(sorted(mb)))
            expect[-1]["graph_replayed" if key in seen else "graph_captured"] += 1
            seen.add(key)
    assert [c for *_, c in g_out] == expect and sum(c["graph_replayed"] for c in expect) >= 3
    assert not any("moved" in line for line in logs), logs  # each bucket captured once
    for (l0, n0, g0, _), (l1, n1, g1, _) in zip(e_out, g_out):
        assert abs(l1 - l0) <= 5e-3 + 1e-2 * abs(l0) and abs(n1 - n0) <= 2e-2 * n0, (l0, l1, n0, n1)
        assert (g1 - g0).norm() <= 3e-2 * g0.norm(), ((g1 - g0).norm(), g0.norm())
    assert all((a[2] - b[2]).norm() > 0.1 * b[2].norm() for a, b in zip(e_out[1:], e_out))  # the steps differ
    mbs = steps[0]
    lp_eager = parallel.forward_only(model, grid, mbs, token_logprobs)
    for _ in range(2):  # captured, then replayed
        for a, b in zip(graphs.forward_only(model, grid, mbs, token_logprobs), lp_eager):
            assert a.shape == b.shape and (a - b).abs().max() <= 0.05, (a - b).abs().max()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.9)
    new = parallel.forward_only(model, grid, mbs, token_logprobs)
    for a, b, old in zip(graphs.forward_only(model, grid, mbs, token_logprobs), new, lp_eager):
        assert (a - b).abs().max() <= 0.05 < (b - old).abs().max()


@pytest.mark.skipif(not CUDA, reason="CUDA graphs")
def test_background_compile_takes_over_the_graphs():
    """compile='background' under StepGraphs (bf16, window / CSA / HCA layers, hash and learned routers): the first
    step replays graphs of the eager blocks while a side thread compiles them (inductor); once it is done the graphs
    are captured again and run the compiled blocks. Every step's loss, grad norm and gradients agree with the eager
    schedule's from the same weights within bf16, and the no-grad logprob pass compiles and agrees too."""
    import compile_policy
    grid = parallel.init_distributed(1, 1)
    base = small_model("cuda", torch.bfloat16)
    steps = [grpo_microbatches(s, 240, device="cuda") for s in (1, 2, 3)]
    runs, logs = [], []
    for background in (False, True):
        torch._dynamo.reset()
        model, calls = copy.deepcopy(base), []
        opt = Spy(model.parameters(), lr=1e-3)
        graphs = None
        if background:
            compile_policy.compile_model(model, "background", log=logs.append)
            compiled = model.background.compiled
            model.background.compiled = lambda *a, **kw: (calls.append(threading.current_thread().name)
                                                          or compiled(*a, **kw))
            graphs = StepGraphs(model, grid, log=logs.append)
        out = []
        for i, mbs in enumerate(steps):
            m = parallel.train_step(model, grid, opt, mbs, grpo_loss, 1.0, graphs.train if graphs else "1f1b", False)
            out.append((m["loss"], m["grad_norm"], opt.seen, calls.count(threading.main_thread().name)))
            if background and i == 0:
                assert model.background.join(600) and model.background.failed is None, logs
        runs.append((model, graphs, out))
    (_, _, e_out), (model, graphs, g_out) = runs
    assert g_out[0][3] == 0 < g_out[1][3], g_out  # eager blocks in the first step, compiled ones from the second
    assert any("ready" in line for line in logs) and any("capturing" in line for line in logs), logs
    for (l0, n0, g0, _), (l1, n1, g1, _) in zip(e_out, g_out):
        assert abs(l1 - l0) <= 5e-3 + 1e-2 * abs(l0) and abs(n1 - n0) <= 2e-2 * n0, (l0, l1, n0, n1)
        assert (g1 - g0).norm() <= 3e-2 * g0.norm(), ((g1 - g0).norm(), g0.norm())
    lp_eager = parallel.forward_only(model, grid, steps[0], token_logprobs)
    graphs.forward_only(model, grid, steps[0], token_logprobs)  # hands the no-grad shape over
    assert model.background.join(600), logs
    for a, b in zip(graphs.forward_only(model, grid, steps[0], token_logprobs), lp_eager):
        assert a.shape == b.shape and (a - b).abs().max() <= 0.05, (a - b).abs().max()
