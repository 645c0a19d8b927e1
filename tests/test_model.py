"""The model against transformers' DeepseekV4ForCausalLM (the independent reference), and its invariants."""
import copy
import logging

import pytest
import torch
import torch.nn.functional as F

from conftest import SMALL, SMALL_16, TINY, TINY_16, randomize_
from checkpoint import from_pretrained, save_pretrained
from mhc import hc_split_sinkhorn
from model_dsv4 import Transformer

transformers = pytest.importorskip("transformers")  # a test dependency: .ci/run installs it
logging.getLogger("transformers").setLevel(logging.ERROR)

# (config, sequence length): longer than the window and than 4 * index_topk; SMALL's T covers 2 HCA-128 entries
CASES = [(TINY_16, 160), (SMALL_16, 300)]


def ours(args, seed=0):
    model = Transformer(copy.deepcopy(args), dtype=torch.float32)
    return randomize_(model, args.n_routed_experts, args.num_experts_per_tok, seed)


@pytest.mark.slow
@pytest.mark.parametrize("args,T", CASES, ids=["tiny", "small"])
def test_parity_ours_to_transformers(args, T, tmp_path):
    """Save ours in official names; transformers loads it with its own key mapping; fp32 logits agree."""
    model = ours(args)
    save_pretrained(model, tmp_path)
    ref = transformers.DeepseekV4ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.randint(0, args.vocab_size, (2, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (model(ids) - ref(ids).logits).abs().max().item()
    assert diff <= 1e-4, f"max |logit diff| {diff:.2e} vs transformers"


@pytest.mark.slow
@pytest.mark.parametrize("args,T", CASES, ids=["tiny", "small"])
def test_parity_transformers_to_ours(args, T, tmp_path):
    """The reverse: a random transformers model, saved by transformers, loads into ours with equal logits."""
    cfg = transformers.DeepseekV4Config(**args.to_json())
    ref = randomize_(transformers.DeepseekV4ForCausalLM(cfg).float(), args.n_routed_experts, args.num_experts_per_tok,
                     3)
    ref.save_pretrained(tmp_path)
    model = from_pretrained(tmp_path, dtype=torch.float32)  # transformers writes no mtp.*: loads without MTP
    assert len(model.mtp) == 0
    ids = torch.randint(0, args.vocab_size, (2, T), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        diff = (model(ids) - ref.eval()(ids).logits).abs().max().item()
    assert diff <= 1e-4, f"max |logit diff| {diff:.2e} vs transformers"


@pytest.mark.slow
def test_parity_catches_untransposed_comb(tmp_path, monkeypatch):
    """The parity test has teeth: the classic mHC bug (comb used untransposed) is far outside tolerance."""
    import model_dsv4
    model = ours(TINY_16)
    save_pretrained(model, tmp_path)
    ref = transformers.DeepseekV4ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    bad = lambda self, f, x, post, comb: (post.unsqueeze(-1) * f.unsqueeze(-2) + comb @ x).to(x.dtype)
    monkeypatch.setattr(model_dsv4.Block, "hc_post", bad)
    ids = torch.randint(0, TINY.vocab_size, (1, 64))
    with torch.no_grad():
        assert (model(ids) - ref(ids).logits).abs().max().item() > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("args", [TINY, SMALL], ids=["tiny", "small"])
def test_causality_bit_identical(args):
    model = ours(args)
    T, t = 200, 137
    ids = torch.randint(0, args.vocab_size, (2, T))
    ids2 = ids.clone()
    ids2[:, t + 1:] = torch.randint(0, args.vocab_size, (2, T - t - 1))
    with torch.no_grad():
        a, b = model(ids), model(ids2)
    assert torch.equal(a[:, :t + 1], b[:, :t + 1])
    assert not torch.equal(a[:, t + 1:], b[:, t + 1:])


def test_sinkhorn_doubly_stochastic():
    n = 4
    mixes, base, scale = torch.randn(3, 5, (2 + n) * n), torch.randn((2 + n) * n), torch.tensor([1.0, 1.0, 1.0])
    pre, post, comb = hc_split_sinkhorn(mixes, scale, base, n, 20, 1e-6)
    assert comb.shape == (3, 5, n, n) and (comb > 0).all()
    torch.testing.assert_close(comb.sum(-2), torch.ones(3, 5, n), atol=1e-5, rtol=0)  # columns normalised last
    torch.testing.assert_close(comb.sum(-1), torch.ones(3, 5, n), atol=1e-2, rtol=0)  # rows: 20 iterations
    _, _, comb = hc_split_sinkhorn(mixes, scale, base, n, 500, 1e-6)  # and it converges
    torch.testing.assert_close(comb.sum(-1), torch.ones(3, 5, n), atol=1e-5, rtol=0)
    assert ((post > 0) & (post < 2)).all() and (pre > 0).all()


def test_hash_layers_route_by_table():
    model = ours(TINY)
    ids = torch.randint(0, TINY.vocab_size, (2, 40))
    x = torch.randn(80, TINY.hidden_size)
    for i, layer in enumerate(model.layers.values()):
        w, idx = layer.ffn.gate(x, ids.flatten())
        if i < TINY.num_hash_layers:
            assert torch.equal(idx, layer.ffn.gate.tid2eid[ids.flatten()])
        else:
            assert torch.equal(idx, (F.softplus(x @ layer.ffn.gate.weight.T).sqrt() + layer.ffn.gate.bias)
                               .topk(TINY.num_experts_per_tok).indices)
        torch.testing.assert_close(w.sum(-1), torch.full((80,), TINY.routed_scaling_factor))


@pytest.mark.slow
def test_every_parameter_gets_a_gradient():
    """LM loss + MTP loss reach every trainable parameter except the indexer's: its top-k selection is
    discrete, so no gradient flows to it (V4 trains it with a separate distillation loss)."""
    model = ours(TINY)
    ids = torch.randint(0, TINY.vocab_size, (2, 96))
    logits, mtp_logits = model(ids, mtp=True)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss = loss + F.cross_entropy(mtp_logits[:, :-1].flatten(0, 1), ids[:, 2:].flatten())
    loss.backward()
    # experts no token chose get no gradient by construction; route all to check the rest
    used = {(n.split(".experts.")[0], int(n.split(".experts.")[1].split(".")[0]))
            for n, _ in model.named_parameters() if ".experts." in n}
    none = [n for n, p in model.named_parameters() if (p.grad is None or not p.grad.abs().sum() > 0)
            and ".indexer." not in n and ".experts." not in n]
    assert none == [], f"no gradient: {none}"
    indexer = [n for n, p in model.named_parameters() if ".indexer." in n and p.grad is not None]
    assert indexer == [], indexer
    hit = sum(p.grad is not None for n, p in model.named_parameters() if ".experts." in n)
    assert hit > 0.9 * 3 * len(used)


@pytest.mark.slow
def test_bf16_mode():
    """bf16 parameters and activations with fp32 islands; fp32 logits; close to the fp32 model."""
    model = Transformer(copy.deepcopy(TINY), dtype=torch.float32)  # the from-scratch init
    low = copy.deepcopy(model).set_dtype(torch.bfloat16)
    fp32 = {n for n, p in low.named_parameters() if p.dtype == torch.float32}
    assert fp32 and all(any(k in n for k in ("hc_", "attn_sink", "ape", "norm.weight")) for n in fp32), fp32
    assert low.layers["3"].ffn.gate.bias.dtype == torch.float32 and low.embed.weight.dtype == torch.bfloat16
    ids = torch.randint(0, TINY.vocab_size, (1, 96))
    with torch.no_grad():
        ref, out = model(ids).log_softmax(-1), low(ids)
    assert out.dtype == torch.float32
    target = lambda lp: lp[:, :-1].gather(-1, ids[:, 1:, None])
    assert (target(out.log_softmax(-1)) - target(ref)).abs().mean().item() < 0.02


def test_top_k_mask_is_a_stable_sorts_first_k():
    """model_dsv4.top_k_mask (the CSA indexer's pick) against the first k of a stable descending sort, exactly:
    scores with many ties (few distinct values, the ReLU's zeros) and masked -inf entries, rows shorter and longer
    than k."""
    from model_dsv4 import top_k_mask
    g = torch.Generator().manual_seed(0)
    for S in (5, 40, 300):
        score = (torch.randint(-3, 6, (3, 7, S), generator=g).float() / 2).relu()
        score = score.masked_fill(torch.rand(3, 7, S, generator=g) < 0.3, float("-inf"))
        for k in (1, 4, S - 1, S, S + 3, 512):
            idx = score.sort(dim=-1, descending=True, stable=True).indices[..., :k]
            want = torch.zeros_like(score, dtype=torch.bool).scatter_(-1, idx, True)
            assert torch.equal(top_k_mask(score, k), want), (S, k)


def test_moe_row_moves_equal_index_ops_both_ways():
    """dispatch's copy of each token's row once per pick (Picks) and combine's sum of a token's rows (PickSum), whose
    backward passes are gathers written by hand, against the same moves as autograd's index ops (x[order // K]; an
    index_add_ by token), forward and backward, in fp64; and gradcheck on both."""
    from moe import Picks, PickSum, inverse_permutation
    g = torch.Generator().manual_seed(0)
    N, K, D = 9, 3, 5
    order = torch.randint(0, 4, (N * K,), generator=g).argsort(stable=True)  # pairs sorted by a random expert id
    inv = inverse_permutation(order)
    x = torch.randn(N, D, dtype=torch.float64, generator=g, requires_grad=True)
    rows = torch.randn(N * K, D, dtype=torch.float64, generator=g, requires_grad=True)
    dy, drows = torch.randn(N, D, dtype=torch.float64, generator=g), torch.randn(N * K, D, dtype=torch.float64,
                                                                                  generator=g)
    cases = ((Picks.apply(x, order, inv, K), x[order // K], x, drows),
             (PickSum.apply(rows, order, inv, K), torch.zeros(N, D, dtype=torch.float64).index_add(0, order // K, rows),
              rows, dy))
    for ours, ref, leaf, grad in cases:
        torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(torch.autograd.grad(ours, leaf, grad)[0], torch.autograd.grad(ref, leaf, grad)[0],
                                   rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lambda t: Picks.apply(t, order, inv, K), (x,))
    assert torch.autograd.gradcheck(lambda t: PickSum.apply(t, order, inv, K), (rows,))


def test_expert_order_counted_and_sorted_equal_the_stable_sort():
    """dispatch's order of the (token, pick) pairs by expert, counted (a decode step) and radix-sorted, each equal to a
    stable argsort and its inverse, with the pairs per expert: ids over 256 experts (an int32 key), experts that get
    no pair."""
    from moe import expert_order, inverse_permutation
    g = torch.Generator().manual_seed(0)
    for P, E in ((1, 8), (384, 64), (5000, 64), (700, 300), (64, 256)):
        flat = torch.randint(0, E, (P,), generator=g)
        ref = flat.argsort(stable=True)
        for count in (True, False):
            order, inv, per = expert_order(flat, E, count)
            assert torch.equal(order, ref) and torch.equal(inv, inverse_permutation(ref)), (P, E, count)
            assert torch.equal(per, torch.bincount(flat, minlength=E)), (P, E, count)


def test_rope_angles_op_matches_its_fake_and_the_formula():
    """model_dsv4.rope_angles (the op that keeps cos and sin out of inductor's fused kernels): torch.library.opcheck
    (its fake shapes, schema, and use under compile) for the prefill's positions [T] and the decode's [B, 1], and its
    values against cos and sin of pos * inv."""
    from model_dsv4 import rope_angles
    inv = torch.rand(8)
    for pos in (torch.arange(13), torch.tensor([[3], [70], [5]])):
        torch.library.opcheck(rope_angles, (pos, inv))
        cos, sin = rope_angles(pos, inv)
        ang = pos.float()[:, None] * inv  # [T, 8] or [B, 1, 8]
        assert cos.shape == ang.shape and torch.equal(cos, ang.cos()) and torch.equal(sin, ang.sin())
