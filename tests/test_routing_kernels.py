"""dsv4_kernels/route.py's kernels against the code they replace: route_triton against moe.Gate.forward and
pair_order_triton against a stable sort, sort_pairs_triton against dispatch, alone and in the model's forward without
grad. Without a GPU, Triton's interpreter runs them on CPU tensors (the package's __init__ turns it on);
test_kernel_builds.py compiles them for sm_90 and gfx950."""
import copy
from dataclasses import replace

import pytest
import torch

from dsv4_kernels.route import (pair_order_triton, route_triton,  # before triton: without a GPU the package turns
                                sort_pairs_triton)                # on the interpreter
import dsv4_kernels.route
import moe
from conftest import TINY, randomize_
from model_dsv4 import Transformer
from moe import Gate, MoE

pytest.importorskip("triton", reason="Triton comes with torch's GPU builds; requirements.txt installs it for the CPU")

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("func", ["sqrtsoftplus", "sigmoid", "softmax"])
def test_route_triton_equals_gate(func):
    """The router from its logits, learned (top 6 of score + bias) and hash (tid2eid of the token), normalised or not,
    against Gate.forward: 37 tokens (3 programs, the last partial) over 40 experts (a block of 64), logits from -40
    to 40 (softplus' small values and its linear part above 20), a slice of wider rows as the decode's fused
    projections give them. The same experts in the same order; the weights to 1e-6 of the largest."""
    g = torch.Generator().manual_seed(len(func))
    N, E, K = 37, 40, 6
    logits = (torch.randn(N, E + 9, generator=g) * 8).clamp(-40, 40).to(DEV)[:, 5:5 + E]
    logits[0, :3] = torch.tensor([-40.0, 25.0, 39.0])
    ids = torch.randint(0, TINY.vocab_size, (N,), generator=g).to(DEV)
    for hash_layer in (True, False):
        for norm in (True, False):
            args = replace(TINY, n_routed_experts=E, num_experts_per_tok=K, scoring_func=func,
                                norm_topk_prob=norm, routed_scaling_factor=1.5)
            gate = randomize_(Gate(0 if hash_layer else TINY.num_hash_layers, args), E, K, seed=1).to(DEV)
            w, idx = route_triton(logits, gate.tid2eid if hash_layer else gate.bias, ids, K, func, hash_layer, norm,
                                  1.5)
            ref_w, ref_idx = gate(None, ids, logits)
            assert torch.equal(idx, ref_idx), (hash_layer, norm)
            assert w.dtype == torch.float32 and (w - ref_w).abs().max() <= 1e-6 * ref_w.abs().max(), (hash_layer, norm)


@pytest.mark.parametrize("P,E,bq", [(1, 8, 1024), (384, 64, 1024), (700, 300, 1024), (64, 256, 1024),
                                    (700, 64, 256)])
def test_pair_order_triton_equals_the_stable_sort(P, E, bq, monkeypatch):
    """A decode step's (token, pick) pairs put in expert order: order and its inverse equal a stable argsort's, the
    counts bincount's; pairs past a block, experts over 256, experts with no pair, and the pairs compared in several
    loads (256 at a time)."""
    monkeypatch.setattr(dsv4_kernels.route, "ORDER_BQ", bq)
    flat = torch.randint(0, E, (P,), generator=torch.Generator().manual_seed(P)).to(DEV)
    order, inv, counts = pair_order_triton(flat, E)
    ref = flat.argsort(stable=True)
    assert torch.equal(order, ref) and torch.equal(inv, torch.argsort(ref)) and counts.dtype == torch.int64
    assert torch.equal(counts, torch.bincount(flat, minlength=E))


@pytest.mark.parametrize("N,K,D,E,dtype", [(64, 6, 1536, 64, torch.bfloat16), (5, 2, 40, 300, torch.float32),
                                           (37, 3, 2100, 8, torch.float32)])
def test_sort_pairs_triton_equals_dispatch(N, K, D, E, dtype):
    """dispatch on one rank for a decode step in one kernel: the pairs' rows and weights in expert order equal
    dispatch's gathers (exactly: copies), order, inverse and counts expert_order's; rows wider than a block (2100)
    and blocks of pairs past the end."""
    g = torch.Generator().manual_seed(N)
    x = torch.randn(N, D, generator=g).to(DEV, dtype)
    w, idx = torch.rand(N, K, generator=g).to(DEV), torch.randint(0, E, (N, K), generator=g).to(DEV)
    xs, ws, order, inv, counts = sort_pairs_triton(x, w, idx, E)
    ref_order, ref_inv, ref_counts = moe.expert_order(idx.flatten(), E)
    assert torch.equal(order, ref_order) and torch.equal(inv, ref_inv) and torch.equal(counts, ref_counts)
    assert xs.dtype == dtype and torch.equal(xs, x[ref_order // K]) and torch.equal(ws, w.flatten()[ref_order])


@pytest.mark.slow
def test_model_without_grad_on_triton_routing_equals_reference(monkeypatch):
    """A forward without grad with the MoE's kernels on routes through route_triton in every layer (hash ones
    included) and, for one token a sequence (a decode step), orders the pairs by sort_pairs_triton: TINY's layers on
    5 sequences of one token, fp32, against the reference model, to 1e-5 of the largest logit."""
    calls = {"route": 0, "order": 0}
    monkeypatch.setattr(moe, "has_triton", lambda t: True)
    monkeypatch.setattr(moe, "route_triton", lambda *a: calls.update(route=calls["route"] + 1)
                        or route_triton(*a))
    monkeypatch.setattr(moe, "sort_pairs_triton", lambda *a: calls.update(order=calls["order"] + 1)
                        or sort_pairs_triton(*a))
    model = randomize_(Transformer(copy.deepcopy(TINY), dtype=torch.float32), TINY.n_routed_experts,
                       TINY.num_experts_per_tok, seed=8).to(DEV)
    ids = torch.randint(0, TINY.vocab_size, (5, 1), generator=torch.Generator().manual_seed(9)).to(DEV)
    with torch.no_grad():
        ref = model(ids)
        for m in model.modules():  # the MoEs only: the rest stays on the reference
            if isinstance(m, MoE):
                m.fast = m.fast_routing = True
        fast = model(ids)
    assert calls == {"route": TINY.num_hidden_layers, "order": TINY.num_hidden_layers}
    assert (fast - ref).abs().max() <= 1e-5 * ref.abs().max(), ((fast - ref).abs().max(), ref.abs().max())
