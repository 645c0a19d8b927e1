"""dsv4_kernels/fast.py's fast paths where they meet training state and the engine: the experts' stacked weights
(trained in place through the parameters' views, gradients that add up, re-stacked after a cast or a load, followed
by the engine's weight loads), and on a GPU the engine's CUDA-graph decode against its eager decode and the forward,
and with the decode kernels' programmatic dependent launch against without.
The kernels themselves against their references: test_fast_paths.py."""
import copy

import pytest
import torch

from conftest import SMALL, TINY, randomize_
from model_dsv4 import Transformer

CUDA = torch.cuda.is_available()


@pytest.mark.skipif(not CUDA, reason="CUDA graphs")
def test_engine_cuda_graphs_equal_eager_and_forward():
    """bf16 on the GPU: the graphed decode samples the eager decode's tokens (until a near-tie parts them) with
    logprobs equal up to bf16 rounding (the graph reads every compressed entry, masked, and pads the batch to its
    bucket; eager reads only the visible entries: other GEMM shapes, ~3e-3 in a logprob), and it is as close to the
    full forward as the reference kernels' engine is to theirs (bf16 rounding differs between a batched decode and a
    full forward). A near-tie in a top-k pick (a token's experts, the indexer's entries) can also flip between the
    two and move a logprob, and a few after it, by 0.1-0.6 (on an H200, 1-3 such tokens of 40 with random prompts),
    so most tokens, not all, must agree to rounding; a wrong path misses on most."""
    from engine import Engine, SamplingParams
    model = randomize_(Transformer(copy.deepcopy(TINY), dtype=torch.float32), TINY.n_routed_experts,
                       TINY.num_experts_per_tok, seed=6).set_dtype(torch.bfloat16).cuda().set_kernels(True)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(2, TINY.vocab_size, (n,), generator=gen).tolist() for n in (5, 37, 64, 20)]
    params = [SamplingParams(temperature=0.8, max_new_tokens=40, ignore_eos=True, seed=s) for s in range(4)]
    engines = [Engine(model, max_batch=4, max_len=160, cuda_graphs=g) for g in (True, False)]
    assert engines[0].graphs is not None and engines[1].graphs is None
    runs = [e.generate(prompts, params) for e in engines]
    assert len(engines[0].graphs) > 0
    same, diffs = 0, []
    for a, b in zip(*runs):  # sampled tokens may part at a near-tie (bf16 rounding); up to there, the same logprobs
        n = next((i for i, (x, y) in enumerate(zip(a.output_ids, b.output_ids)) if x != y), len(a.output_ids))
        same += n  # (not the parted tokens' logprobs: a near-tie of logit + Gumbel noise, not of the logits)
        diffs.append((torch.tensor(a.output_logprobs[:n]) - torch.tensor(b.output_logprobs[:n])).abs())
    assert same >= 0.75 * sum(len(r.output_ids) for r in runs[0]), same
    d = torch.cat(diffs)
    assert (d <= 0.05).float().mean() >= 0.9 and d.mean() <= 0.02, d

    def mean_gap(m, reqs):
        gaps = []
        for r in reqs:
            ids = torch.tensor(r.input_ids + r.output_ids, device="cuda")[None]
            with torch.no_grad():
                lp = (m(ids)[0, len(r.input_ids) - 1:-1] / 0.8).log_softmax(-1)
            lp = lp.gather(-1, ids[0, len(r.input_ids):, None])[:, 0].cpu()
            gaps.append((lp - torch.tensor(r.output_logprobs)).abs())
        return torch.cat(gaps).mean().item()
    ref_model = copy.deepcopy(model).set_kernels(False)
    ref_gap = mean_gap(ref_model, Engine(ref_model, max_batch=4, max_len=160).generate(prompts, params))
    assert mean_gap(model, runs[0]) <= 2 * ref_gap + 0.01, (mean_gap(model, runs[0]), ref_gap)



@pytest.mark.slow
def test_stacked_experts_train_in_place():
    """Training with the experts' weights stacked (Transformer.stack_experts, the parameters views of the stacks):
    the optimizer's steps write through the views, so the stacks stay the parameters' storage, and after two steps
    of two micro-batches each (the gradients add up, then zero_grad sets them to None) the model equals the
    reference one (per-expert loop) trained alike. Each expert's gradient is its view of its stack's gradient. A
    dtype cast and a load that assigns new parameters re-stack on the next forward."""
    from dsv4_kernels.fast import is_stacked
    ref = randomize_(Transformer(copy.deepcopy(SMALL), dtype=torch.float32), SMALL.n_routed_experts,
                     SMALL.num_experts_per_tok, seed=3)
    fast = copy.deepcopy(ref).set_kernels(True)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9) for m in (fast, ref)]
    g = torch.Generator().manual_seed(6)
    for step in range(2):
        ids = torch.randint(0, SMALL.vocab_size, (2, 64), generator=g)
        for m, opt in zip((fast, ref), opts):
            for half in ids.chunk(2):
                m(half).log_softmax(-1)[..., 3].mean().backward()
            if m is fast:
                moe = fast.layers["0"].ffn
                assert moe.experts["7"].w2.weight.grad.data_ptr() == moe.stacked[1].grad[7].data_ptr()
            opt.step()
            opt.zero_grad()
        assert is_stacked(list(moe.experts.values()), moe.stacked), step
    for (n, a), b in zip(fast.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-5)
    old = moe.stacked
    fast.set_dtype(torch.bfloat16)(ids)
    assert is_stacked(list(moe.experts.values()), moe.stacked) and moe.stacked[0].dtype == torch.bfloat16
    assert old[0].dtype == torch.float32
    before = fast(ids)  # a load that assigns new parameters breaks the views too: re-stacked, the same model
    fast.load_state_dict({k: v.clone() for k, v in fast.state_dict().items()}, assign=True)
    assert not is_stacked(list(moe.experts.values()), moe.stacked)
    torch.testing.assert_close(fast(ids), before, rtol=0, atol=0)
    assert is_stacked(list(moe.experts.values()), moe.stacked)


def test_stacked_expert_grads_add_to_what_parameters_hold():
    """A backward adds to the gradients the experts' parameters hold, also ones that are not views of the stacks'
    gradients (set by hand), as for any parameter: the same backward run twice doubles every gradient."""
    model = randomize_(Transformer(copy.deepcopy(SMALL), dtype=torch.float32), SMALL.n_routed_experts,
                       SMALL.num_experts_per_tok, seed=9).set_kernels(True)
    ids = torch.randint(0, SMALL.vocab_size, (2, 48), generator=torch.Generator().manual_seed(10))
    model(ids).log_softmax(-1)[..., 3].mean().backward()
    want = {n: 2 * p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert sum(".experts." in n for n in want) == 3 * SMALL.n_routed_experts * SMALL.num_hidden_layers
    for p in model.parameters():
        if p.grad is not None:
            p.grad = p.grad.clone()  # no longer the stacks' views
    model(ids).log_softmax(-1)[..., 3].mean().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want.get(n), rtol=1e-5, atol=1e-7, msg=n)


def test_engine_stacked_experts_follow_weight_loads():
    """The engine's stacked expert weights are the parameters' storage: a weight load reaches the grouped GEMM,
    and a deepcopy (which breaks the views) falls back to stacking per call, with equal results."""
    from engine import Engine
    from dsv4_kernels.fast import is_stacked
    model = randomize_(Transformer(copy.deepcopy(SMALL), dtype=torch.float32), SMALL.n_routed_experts,
                       SMALL.num_experts_per_tok, seed=7).set_kernels(True)
    ids = torch.randint(0, SMALL.vocab_size, (1, 40), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        before = model(ids)
        engine = Engine(model, max_batch=2, max_len=64)
        moe = model.layers["0"].ffn
        assert is_stacked(list(moe.experts.values()), moe.stacked)
        torch.testing.assert_close(model(ids), before, rtol=0, atol=0)
        w = moe.experts["3"].w2.weight
        engine.load_weights({"layers.0.ffn.experts.3.w2.weight": w * 2})
        assert torch.equal(moe.stacked[1][3], w) and not torch.equal(model(ids), before)
        twin = copy.deepcopy(model)
        assert not is_stacked(list(twin.layers["0"].ffn.experts.values()), twin.layers["0"].ffn.stacked)
        torch.testing.assert_close(twin(ids), model(ids), rtol=0, atol=0)


@pytest.mark.slow
def test_engine_fused_projections_equal_separate_and_follow_loads(monkeypatch):
    """The engine's decode runs each layer's attention projections of one input as one GEMM on their weights fused
    into one tensor (Transformer.fuse_projections, dsv4_kernels.fast.fused_projections): each projection's slice
    equals its own linear; 12 cached decode steps (a window and a CSA and HCA compressor's windows completing among
    them) give the logits of the same steps with every projection on its own (fp32, to 1e-5 of the largest); a weight
    load writes through into the fused tensor; a deepcopy (which breaks the views) runs the projections on their
    own."""
    from dataclasses import replace

    from engine import Engine
    from dsv4_kernels.fast import fused_projections
    import kv_cache
    args = replace(SMALL, compress_ratios=[4, 0, 16, 4, 0])
    model = randomize_(Transformer(copy.deepcopy(args), dtype=torch.float32), args.n_routed_experts,
                       args.num_experts_per_tok, seed=11).set_kernels(True)
    engine = Engine(model, max_batch=2, max_len=64)
    mods = [b.attn for b in model.layers.values()]
    assert not hasattr(model.layers["0"].ffn, "fused")  # the shared expert goes with the routed ones (experts_triton)
    assert all(m.fused is not None for m in mods)
    attn = model.layers["0"].attn
    x = torch.randn(3, 1, args.hidden_size, generator=torch.Generator().manual_seed(12))
    p = fused_projections(attn, x)
    assert list(p) == attn.fused_names() and len(p) == 7  # wq_a, wkv, the compressor's 2, the indexer's 3
    for n, v in p.items():
        torch.testing.assert_close(v, x @ attn.get_submodule(n).weight.T, rtol=1e-5, atol=1e-6, msg=n)
    gen = torch.Generator().manual_seed(13)
    prompts = [torch.randint(2, args.vocab_size, (n,), generator=gen).tolist() for n in (20, 9)]
    tokens = torch.randint(2, args.vocab_size, (12, 2), generator=gen)
    fused, used = {m: m.fused for m in mods}, []
    monkeypatch.setattr(kv_cache, "fused_projections",  # how many projections each of decode's calls got
                        lambda m, h: (r := fused_projections(m, h), used.append(len(r)))[0])

    def decode(on):
        for m in mods:
            m.fused = fused[m] if on else None
        cache, pos = kv_cache.KVCache(model, 2, 64, "cpu"), torch.tensor([20, 9])
        with torch.no_grad():
            out = [cache.prefill(model, [0, 1], prompts)]
            for t in tokens:
                out.append(cache.decode(model, torch.arange(2), t, pos))
                pos = pos + 1
        return torch.stack(out)
    off, on = decode(False), decode(True)
    assert used == [0] * 12 * 4 + [7, 2, 4, 7] * 12  # 12 steps, each layer's attention
    assert (on - off).abs().max() <= 1e-5 * off.abs().max(), ((on - off).abs().max(), off.abs().max())
    new = attn.compressor.wgate.weight * 2
    engine.load_weights({"layers.0.attn.compressor.wgate.weight": new})
    rows = sum(attn.get_submodule(n).weight.shape[0] for n in ("wq_a", "wkv", "compressor.wkv"))
    assert torch.equal(attn.fused[rows:rows + new.shape[0]], new)
    torch.testing.assert_close(fused_projections(attn, x)["compressor.wgate"], 2 * p["compressor.wgate"])
    twin = copy.deepcopy(model)
    assert twin.layers["0"].attn.fused is not None and fused_projections(twin.layers["0"].attn, x) == {}
    attn.wkv.weight.data = attn.wkv.weight.data.double()  # one dtype per fused tensor, or none: no silent upcast
    model.fuse_projections()
    assert attn.fused is None and fused_projections(attn, x) == {} and model.layers["1"].attn.fused is not None
