"""Routing replay (R3) and indexer replay (replay.py): the embedded server returns SGLang's routed_experts and
indexer_topk, equal to what the trainer's own routers and indexers pick; the trainer's forward takes them (the Gate,
the Indexer), which changes its logprobs exactly where the two sides' picks differ; micro-batches carry them aligned;
a GRPO step with replay on PP2 x EP2 equals one process."""
import base64
import copy
import http.client
import json

import numpy as np
import pytest
import torch

import replay
import server
from conftest import SMALL, randomize_
from engine import Engine, SamplingParams
from grpo import make_microbatches
from helpers.grpo_base import assert_policy_gradient, run, weights
from model_dsv4 import Transformer, mask_picks, picks_mask
from rollout import parse_sample
from test_grpo import base  # noqa: F401 (the fixture)

BOTH = ("routed_experts", "indexer_topk")


@pytest.fixture(scope="module")
def model():
    """SMALL (layers: CSA, window, HCA, CSA; a hash layer first; 8 experts top-2; index_topk 4), every tensor random."""
    torch.manual_seed(0)
    return randomize_(Transformer(SMALL, dtype=torch.float32), SMALL.n_routed_experts, SMALL.num_experts_per_tok).eval()


def own_picks(model, ids):
    """The trainer's own picks in one full forward of ids [T] (hooks on every Gate and Indexer): experts [T, layers, K]
    and indexer picks [T, CSA layers, index_topk], in replay.py's layout."""
    got, hooks = {}, []
    for i, layer in model.layers.items():
        hooks.append(layer.ffn.gate.register_forward_hook(lambda m, a, out, i=i: got.__setitem__(("e", i), out[1])))
        if layer.attn.indexer is not None:
            hooks.append(layer.attn.indexer.register_forward_hook(
                lambda m, a, out, i=i: got.__setitem__(("x", i), mask_picks(out[0], model.args.index_topk))))
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):  # hooks inside compiled layers would not run
        model(torch.tensor(ids, device=next(model.parameters()).device)[None])
    for h in hooks:
        h.remove()
    experts = torch.stack([got[("e", i)] for i in model.layers], 1)
    return experts.cpu(), torch.stack([got[("x", i)] for i in model.layers if ("x", i) in got], 1).cpu()


def post(url, body):
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    conn.request("POST", "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    return resp.status, json.loads(resp.read())


def test_server_returns_sglangs_fields_equal_to_the_trainers_picks(model):
    """fp32, nothing differs: each position's experts (hash layer: tid2eid's row) and indexer picks, as raw int32
    base64 of SGLang's shapes, from routed_experts_start_len on, equal the trainer's own on prompt + output; the
    picks are not the trivial first k visible entries. Bad field values are a 400 naming the field."""
    srv = server.start(model, port=0, dtype=torch.float32, device="cpu", max_batch=8, max_len=128, record=BOTH)
    plain = server.start(model, port=0, dtype=torch.float32, device="cpu", max_batch=8, max_len=128)
    try:
        prompts, start = [[7, 3, 9, 4, 5, 6, 11, 2, 8], list(range(40, 70))], 3
        sampling = {"max_new_tokens": 40, "ignore_eos": True, "sampling_seed": 5}
        status, outs = post(srv.url, {"input_ids": prompts, "sampling_params": sampling, "return_routed_experts": True,
                                      "routed_experts_start_len": start, "return_indexer_topk": True,
                                      "return_logprob": True})
        assert status == 200, outs
        L, K, C, k = SMALL.num_hidden_layers, SMALL.num_experts_per_tok, len(replay.csa_layers(SMALL)), SMALL.index_topk
        for p, out in zip(prompts, outs):
            ids = p + out["output_ids"]
            n = len(ids) - 1  # the last token is sampled, never fed
            raw = lambda f: np.frombuffer(base64.b64decode(out["meta_info"][f]), dtype=np.int32)
            experts = torch.from_numpy(raw("routed_experts").copy()).view(n - start, L, K)
            index = torch.from_numpy(raw("indexer_topk").copy()).view(n, C, k)
            own_e, own_x = own_picks(model, ids)
            assert torch.equal(experts, own_e[start:n].int()) and torch.equal(index, own_x[:n])
            assert torch.equal(experts[:, 0], model.layers["0"].ffn.gate.tid2eid[torch.tensor(ids[start:n])].int())
            # 0 entries visible, 1, more than k
            assert (index[:3] == -1).all() and (index[3, :, 0] == 0).all() and (index[-1] >= 0).all()
            first_k = torch.arange(k).expand_as(index[-1])
            assert not torch.equal(index[-1], first_k), "the indexer's picks are the first k entries: a trivial case"
            parsed = parse_sample(srv.url, out, {"return_indexer_topk": True})
            assert parsed["indexer_topk"].shape == (n, C * k)
            assert torch.equal(parsed["indexer_topk"].view(n, C, k), index)
        bad = [({"return_routed_experts": "yes"}, srv, "return_routed_experts must be true or false"),
               ({"return_routed_experts": True, "routed_experts_start_len": -1}, srv, "routed_experts_start_len"),
               ({"return_routed_experts": True, "routed_experts_start_len": 10}, srv, "prompt tokens = 9"),
               ({"return_routed_experts": True, "sampling_params": {"max_new_tokens": 0}}, srv, "max_new_tokens >= 1"),
               ({"return_indexer_topk": True}, plain, "--enable-return-indexer-topk")]
        for fields, s, message in bad:
            status, out = post(s.url, {"input_ids": prompts[0], "sampling_params": {"max_new_tokens": 2}, **fields})
            assert status == 400 and message in out["error"]["message"], (fields, out)
        status, out = post(plain.url, {"input_ids": prompts[0], "sampling_params": {"max_new_tokens": 2},
                                       "return_logprob": True})
        with pytest.raises(RuntimeError, match="--enable-return-routed-experts"):  # a server without the flag
            parse_sample(plain.url, out, {"return_routed_experts": True})
    finally:
        srv.close()
        plain.close()


def generate(model, prompts, n_new=40):
    engine = Engine(model, max_batch=len(prompts), max_len=128, record=BOTH)
    reqs = engine.generate(prompts, [SamplingParams(max_new_tokens=n_new, ignore_eos=True, seed=i)
                                     for i in range(len(prompts))])
    return [(r.input_ids + r.output_ids, len(r.input_ids), r.output_logprobs, r.recorded) for r in reqs]


def scores(model, sample, fields=(), shift=0, grad=False):
    """The trainer's logprobs of a sample's output tokens, replaying `fields` of the engine's record (rows shifted by
    `shift` positions: a misaligned replay), and its routers' counts (differ, rows)."""
    (ids, P, _, rec), dev = sample, next(model.parameters()).device
    rep = {f: rec[f].roll(shift, 0)[None].to(dev) for f in fields}  # [1, T - 1, ...]: the last position routes itself
    rep = {f: torch.cat([t, torch.full_like(t[:, :1], -1)], 1) for f, t in rep.items()}
    stats, ids = [], torch.tensor(ids, device=dev)
    with torch.set_grad_enabled(grad):
        logits = model(ids[None], replay=rep, stats=stats)[0, P - 1:-1]
    lp = logits.log_softmax(-1).gather(-1, ids[P:, None])[:, 0].cpu()
    return lp, torch.stack(stats).sum(0).tolist() if stats else None


@pytest.mark.slow
def test_replay_restores_the_engines_logprobs_when_the_trainer_would_pick_otherwise(model):
    """The trainer's router bias and hash table, which steer selection only, and its indexer's weights perturbed: its
    own picks and logprobs move away from the engine's. Routing replay alone restores the experts (counted as
    differing), not the context; with indexer replay too the logprobs are the engine's again. Replaying rows shifted
    by one position moves them. The router still gets a gradient through the replayed experts' weights."""
    samples = generate(model, [[7, 3, 9, 4, 5, 6, 11, 2, 8], list(range(40, 70))])
    for s in samples:  # the unperturbed trainer: replay changes nothing, and no pick differs
        lp, (differ, rows) = scores(model, s, BOTH)
        assert differ == 0 and rows == SMALL.num_hidden_layers * (len(s[0]) - 1)
        torch.testing.assert_close(lp, torch.tensor(s[2]), rtol=0, atol=1e-5)
    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in other.layers.values():
            gate = layer.ffn.gate
            if gate.hash:
                gate.tid2eid.copy_((gate.tid2eid + 1) % SMALL.n_routed_experts)
            else:
                gate.bias.add_(torch.randn(gate.bias.shape, generator=g))
            if layer.attn.indexer is not None:
                layer.attn.indexer.weights_proj.weight.mul_(torch.rand(layer.attn.indexer.weights_proj.weight.shape,
                                                                       generator=g) * 2)
    gap = lambda lp, s: (lp - torch.tensor(s[2])).abs().max().item()
    for s in samples:
        alone, _ = scores(other, s)
        routed, (differ, rows) = scores(other, s, ("routed_experts",))
        both, _ = scores(other, s, BOTH)
        shifted, _ = scores(other, s, BOTH, shift=1)
        assert gap(alone, s) > 0.1 and differ > 0.3 * rows  # the perturbation changes picks and logprobs
        assert gap(routed, s) > 1e-3  # the indexer still picks otherwise (the long sample) or not (the short one)
        assert gap(both, s) < 1e-5 and gap(shifted, s) > 0.1
    # the count, independently: with both replays the perturbed trainer's layers see the engine's (the unperturbed
    # model's) inputs, so its routers' own picks are the perturbed Gate's on the unperturbed gates' inputs
    ids, inputs = samples[1][0], {}
    hooks = [layer.ffn.gate.register_forward_hook(lambda m, a, out, i=i: inputs.__setitem__(i, a))
             for i, layer in model.layers.items()]
    with torch.no_grad():
        model(torch.tensor(ids)[None])
        sets = lambda t: t.sort(-1).values
        want = sum((sets(other.layers[i].ffn.gate(*inputs[i])[1][:-1]) != sets(samples[1][3]["routed_experts"][:, j]))
                   .any(-1).sum().item() for j, i in enumerate(model.layers))
    for h in hooks:
        h.remove()
    assert scores(other, samples[1], BOTH)[1][0] == want
    lp, _ = scores(other, samples[1], BOTH, grad=True)
    lp.sum().backward()
    assert other.layers["1"].ffn.gate.weight.grad.abs().sum() > 0


def test_microbatches_carry_the_ids_aligned_and_a_stage_its_layers(model):
    """Row t of a micro-batch holds position t's ids (the position whose logits score token t+1); the last token and
    the padding hold -1; a pipeline stage keeps its layers' columns (indexer: its CSA layers'). A payload of the
    wrong size or with ids out of range is a ValueError naming the server."""
    (ids, P, lps, rec), = generate(model, [list(range(20, 40))], n_new=12)
    s = {"output_ids": ids[P:], "logprobs": lps, "url": "http://x", **{f: t.flatten(1) for f, t in rec.items()}}
    short = {"output_ids": [5], "logprobs": [0.0], "url": "http://x",
             **{f: t[:P].flatten(1) for f, t in rec.items()}}  # the same prompt, one output token
    cols = replay.columns(SMALL, ["2", "3"], BOTH)  # stage 1 of 2: its model.layers' keys
    assert cols == {"routed_experts": ([2, 3], (4, 2)), "indexer_topk": ([1], (2, 4))}
    mb = make_microbatches([(ids[:P], [s, short], [1.0, -1.0])], 1, 2, replay=cols, args=SMALL)[0]
    e, x = mb["routed_experts"], mb["indexer_topk"]
    T = len(ids)
    assert e.shape == (2, T, 2, 2) and x.shape == (2, T, 1, 4) and e.dtype == torch.int32
    assert torch.equal(e[0, :T - 1], rec["routed_experts"][:, 2:])
    assert torch.equal(x[0, :T - 1], rec["indexer_topk"][:, 1:])
    assert (e[0, T - 1] == -1).all() and (e[1, P:] == -1).all() and torch.equal(e[1, :P], rec["routed_experts"][:P, 2:])
    assert mb["input_ids"][0, :T].tolist() == ids and mb["mask"][0, P - 1] and mb["tgt"][0, P - 1] == ids[P]
    for bad, message in [({"routed_experts": s["routed_experts"][:-1]}, "is it serving this model"),
                         ({"routed_experts": s["routed_experts"] + SMALL.n_routed_experts}, "out of range"),
                         ({"indexer_topk": s["indexer_topk"].roll(-4, 0)}, "out of range")]:  # picks from the future
        with pytest.raises(ValueError, match=message):
            make_microbatches([(ids[:P], [{**s, **bad}], [1.0])], 1, 1, replay=cols, args=SMALL)


@pytest.mark.slow
def test_grpo_step_with_replay_pp2_ep2_equals_one_process(tmp_path, base):  # noqa: F811 (the fixture)
    """FP8 rollouts route some tokens otherwise than the fp32 trainer would (routing_disagree > 0), so replay moves
    the step. With both replays on, PP2 x EP2 (each stage its layers' ids, EP dispatch by them) trains as one process:
    the same metrics, disagreement included, and the same weights. Without replay, layouts train as one process in
    test_dynamic_sampling.py (the default job) and test_parallel.py."""
    every = ("--trainable=all", "--lr=3e-3", "--routing_replay=True", "--indexer_replay=True", "--rollout_quant=fp8")
    one = run(tmp_path / "one", "--max_steps=1", *base, *every)
    four = run(tmp_path / "four", "--max_steps=1", "--pp_size=2", "--ep_size=2", *base, *every, nproc=4)
    assert_policy_gradient(one)
    assert one[0]["routing_disagree"] > 0.01, one[0]
    for k in ("reward_mean", "reward_std", "entropy", "grad_norm", "train_tokens", "routing_disagree"):
        assert one[0][k] == pytest.approx(four[0][k], rel=1e-5, abs=1e-7), k
    assert 0 < four[0]["replay_ids_mib"] < one[0]["replay_ids_mib"]  # a rank holds its stage's layers, its DP share
    w1, w4 = weights(tmp_path / "one" / "ckpt_000000"), weights(tmp_path / "four" / "ckpt_000000")
    w0 = weights(base[0].removeprefix("--init_from="))
    norm = lambda d: sum(v.double().square().sum() for v in d.values()).sqrt().item()
    diff = {k: w1[k] - w4[k] for k in w1}
    # AdamW's first step moves an entry by lr * g / (|g| + 1e-8): where g is within a few 1e-8 of 0, the fp32
    # rounding in which the layouts differ shows (2e-5 to 1e-4 measured, a few entries a tensor; 3e-6 to 3e-5 of the
    # update's norm). A layout that lost or misplaced part of the gradient moves entries by up to 2 lr (6e-3), and
    # the update by a sizeable part of its norm.
    assert set(w1) == set(w4) and max(v.abs().max().item() for v in diff.values()) <= 5e-4
    assert norm(diff) <= 1e-3 * norm({k: w1[k] - w0[k] for k in w1})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and the decode kernels need a GPU")
def test_gpu_engine_records_under_cuda_graphs_and_compiled_layers(model, compile_layers):
    """bf16 with the kernels on: the engine's decode replays CUDA graphs (its layers eager, then compiled), which write
    the records; they name what the trainer's own forward picks (all but bf16 near-ties: on the CPU, 97% of the expert
    sets and 96% of the indexer picks here; a write that missed would agree by chance, ~1 in 28 expert pairs). The
    compiled trainer's replaying forward scores and counts as the eager one."""
    gpu = copy.deepcopy(model).set_dtype(torch.bfloat16).set_kernels(True).cuda()
    for compiled in (False, True):
        engine = Engine(gpu, max_batch=2, max_len=128, record=BOTH)
        if compiled:
            compile_layers(engine)
        assert engine.graphs is not None
        reqs = engine.generate([[7, 3, 9, 4, 5, 6, 11, 2, 8], list(range(40, 70))],
                               [SamplingParams(max_new_tokens=40, ignore_eos=True, seed=i) for i in range(2)])
        for r in reqs:
            ids = r.input_ids + r.output_ids
            own_e, own_x = own_picks(gpu, ids)
            e, x, n = r.recorded["routed_experts"], r.recorded["indexer_topk"], len(ids) - 1
            same_e = (e.sort(-1).values == own_e[:n].sort(-1).values.int()).all(-1).float().mean().item()
            picked = picks_mask(x, n)  # the engine's indexer picks; the share the trainer's own forward picks too
            same_x = ((picked & picks_mask(own_x[:n], n)).sum() / picked.sum()).item()
            assert same_e > 0.9 and same_x > 0.85, (compiled, same_e, same_x)
    sample = (ids, len(r.input_ids), r.output_logprobs, r.recorded)
    lp, counts = scores(gpu, sample, BOTH)  # its blocks compiled (compile_layers(engine) compiled its model)
    with torch.compiler.set_stance("force_eager"):
        lp_eager, counts_eager = scores(gpu, sample, BOTH)
    assert counts == counts_eager and (lp - lp_eager).abs().max() < 0.05
