"""GRPO: advantages, dynamic sampling, the token loss and its aggregation; the real entry point end to end."""
import pytest
import torch

from chunked_head import from_logits
from grpo import group_advantages, grpo_loss, keep_group, make_microbatches
from helpers.grpo_base import ARGS as BASE_ARGS, assert_policy_gradient, base_checkpoint, run


def test_advantages_and_dynamic_sampling():
    adv = group_advantages([1, 0, 0, 1])
    rewards = torch.tensor([1., 0, 0, 1])
    torch.testing.assert_close(torch.tensor(adv), (rewards - 0.5) / (rewards.std() + 1e-6))
    assert group_advantages([1, 1, 1]) == [0.0, 0.0, 0.0] and group_advantages([0.0]) == [0.0]
    assert keep_group([0, 1]) and not keep_group([1, 1, 1]) and not keep_group([0.0, 0.0])


def groups_fixture():
    s = lambda out, lp: {"output_ids": out, "logprobs": lp}
    return [([5, 6, 7], [s([8, 9], [-1.0, -2.0]), s([10, 11, 12], [-0.5, -0.1, -0.2])], [1.0, -1.0]),
            ([3], [s([4], [-3.0]), s([4, 5, 6, 7], [-1.0, -1.0, -1.0, -1.0])], [0.5, -0.5])]


@pytest.mark.parametrize("agg", ["seq_mean_token_mean", "token_mean"])
def test_microbatches_place_tokens_and_weights(agg):
    groups = groups_fixture()
    norm = 4 if agg == "seq_mean_token_mean" else 10  # samples / response tokens over every DP rank
    mbs = make_microbatches(groups, 2, norm, agg)
    total = sum(mb["weight"].sum().item() for mb in mbs)
    assert abs(total - 1.0) < 1e-6  # each sample 1/4 (seq mean), or each token 1/10
    mb = mbs[0]  # samples 0 and 2: prompt [5,6,7] + [8,9], prompt [3] + [4]
    assert mb["input_ids"][0].tolist()[:5] == [5, 6, 7, 8, 9] and mb["tgt"][0].tolist()[:4] == [6, 7, 8, 9]
    assert mb["mask"][0].tolist()[:5] == [False, False, True, True, False]  # logits at 2, 3 score tokens 8, 9
    assert mb["rollout_lp"][0, 2:4].tolist() == [-1.0, -2.0] and mb["adv"][0, 2].item() == 1.0
    assert mb["first"][0].nonzero().tolist() == [[2]] and mb["first"][1].nonzero().tolist() == [[0]]
    if agg == "seq_mean_token_mean":
        assert mb["weight"][0, 2].item() == pytest.approx(1 / (2 * 4))


def test_microbatches_padded_to_a_multiple_add_only_empty_positions():
    """pad_to (train_grpo with compile='layers'): each micro-batch's length rounded up; the added positions carry no
    token, mask or weight, and the rest equals the unpadded micro-batch."""
    plain, padded = make_microbatches(groups_fixture(), 2, 4), make_microbatches(groups_fixture(), 2, 4, pad_to=8)
    for p, q in zip(plain, padded):
        T = p["input_ids"].shape[1]
        assert q["input_ids"].shape[1] == 8 and T < 8
        for k in p:
            assert torch.equal(q[k][:, :T], p[k]) and not q[k][:, T:].any(), k


def stats(logits, mb):
    """Each position's logprob of its target and entropy, as Transformer.head_loss hands them to the loss."""
    return from_logits(logits, mb["tgt"])


def test_on_policy_step_is_exactly_reinforce():
    """Without old logprobs the ratio is exactly 1, nothing is clipped, approx KL is 0, and the gradient is
    -sum(A * w * grad logp): plain REINFORCE with group-normalised advantages."""
    torch.manual_seed(0)
    mb = make_microbatches(groups_fixture(), 1, 4)[0]
    logits = torch.randn(*mb["input_ids"].shape, 16, requires_grad=True)
    mb["rollout_lp"] = torch.zeros_like(mb["rollout_lp"])
    loss, m = grpo_loss(*stats(logits, mb), mb, tis_cap=0)
    assert m["ratio_dev"].item() == 0.0 and m["clip"].item() == 0 and m["kl"].item() == 0.0
    loss.backward()
    ref = logits.detach().clone().requires_grad_()
    lp = ref.log_softmax(-1).gather(-1, mb["tgt"][..., None])[..., 0]
    (-(mb["adv"] * mb["weight"] * mb["mask"] * lp).sum()).backward()
    torch.testing.assert_close(logits.grad, ref.grad)
    assert logits.grad.abs().max() > 0


def test_entropy_bonus_adds_the_weighted_entropys_gradient():
    """entropy_coef: the loss's gradient moves by -entropy_coef times the gradient of the weighted entropy; the
    entropy metric is the masked sum of -sum p log p, with the bonus or without."""
    g = torch.Generator().manual_seed(3)
    mb = make_microbatches(groups_fixture(), 1, 4)[0]
    logits = torch.randn(*mb["input_ids"].shape, 16, generator=g) * 3
    lp = logits.log_softmax(-1).gather(-1, mb["tgt"][..., None])[..., 0]
    mb["old_lp"], mb["ref_lp"] = lp - 0.3 * torch.randn(lp.shape, generator=g), lp + 0.2

    def grad(entropy_coef=0.0):
        x = logits.clone().requires_grad_()
        loss, m = grpo_loss(*stats(x, mb), mb, tis_cap=2.0, kl_coef=0.1, entropy_coef=entropy_coef)
        loss.backward()
        assert m["clip"] > 0  # some tokens clipped
        return x.grad, m["entropy"]
    (plain, ent0), (bonus, ent1) = grad(), grad(0.01)
    x = logits.clone().requires_grad_()
    p = x.softmax(-1)
    entropy = -(p * p.log()).sum(-1)
    (entropy * mb["weight"] * mb["mask"]).sum().backward()
    torch.testing.assert_close(bonus - plain, -0.01 * x.grad, rtol=1e-4, atol=1e-8)
    assert x.grad.abs().max() > 1e-4
    assert ent0.item() == ent1.item() == pytest.approx((entropy * mb["mask"]).sum().item(), rel=1e-5)


def test_clipping_tis_and_kl():
    mb = make_microbatches(groups_fixture(), 1, 4)[0]
    logits = torch.randn(*mb["input_ids"].shape, 16)
    lp = logits.log_softmax(-1).gather(-1, mb["tgt"][..., None])[..., 0]
    mb["old_lp"] = lp - 0.5  # ratio e^0.5 = 1.65: clipped where A > 0 (at 1.28), not where A < 0
    mb["rollout_lp"] = mb["old_lp"] - 5.0  # pi_old / pi_rollout = e^5: TIS capped at 2
    loss, m = grpo_loss(*stats(logits.requires_grad_(), mb), mb, tis_cap=2.0)
    pos = (mb["adv"] > 0) & mb["mask"]
    assert m["clip"].item() == pos.sum().item()
    assert m["tis"].item() == pytest.approx(2.0 * mb["mask"].sum().item())
    expect = torch.maximum(-mb["adv"] * 0.5 ** 0 * torch.exp(torch.tensor(0.5)), -mb["adv"] * 1.28 * (mb["adv"] > 0)
                           - mb["adv"] * torch.exp(torch.tensor(0.5)) * (mb["adv"] <= 0))
    assert loss.item() == pytest.approx((2.0 * expect * mb["weight"] * mb["mask"]).sum().item(), rel=1e-5)
    mb["ref_lp"] = lp.detach() + 0.3  # k3(d) = e^d - d - 1 with d = ref - logp = 0.3
    loss_kl, _ = grpo_loss(*stats(logits, mb), mb, tis_cap=2.0, kl_coef=0.1)
    k3 = (torch.exp(torch.tensor(0.3)) - 0.3 - 1).item()
    assert loss_kl.item() - loss.item() == pytest.approx(0.1 * k3 * (mb["weight"] * mb["mask"]).sum().item(), rel=1e-4)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """Runs that are compared start from grpo_base's checkpoint, whose groups carry reward spread."""
    return [f"--init_from={base_checkpoint(tmp_path_factory)}", *BASE_ARGS]


@pytest.mark.slow
def test_minibatches_score_against_the_policy_before_the_step(tmp_path, base):
    """n_minibatches=2: two updates from one rollout. The second minibatch's ratio is to the policy that drew the
    samples, which the first update has moved: |ratio - 1| > 0 (a run that took the old logprobs after the first
    update scores it on-policy again, ratio 1, and PPO's clip never binds)."""
    rows = run(tmp_path / "m", "--max_steps=1", "--n_minibatches=2", "--lr=3e-3", *base)
    assert_policy_gradient(rows)
    assert rows[0]["ratio_abs_dev"] > 1e-4, rows[0]["ratio_abs_dev"]
    # the step's record holds both processes' peak memory (on the CPU their peak resident sizes; the embedded
    # server's from its /server_info), torch loaded in each
    assert rows[0]["trainer_mem_gb"] > 0.1 and rows[0]["server_mem_gb"] > 0.1, rows[0]


@pytest.mark.slow
def test_tensor_sync_starts_the_server_from_the_config_alone(tmp_path, base):
    """weight_sync='tensor': the embedded server starts from config.json alone (--load-format dummy: random weights,
    none written to disk) and takes the trainer's weights in a first sync, before the first rollout: its samples carry
    that version, and the trainer scores them as the server did (random weights would be off by nats a token)."""
    rows = run(tmp_path / "t", "--max_steps=1", "--weight_sync=tensor", *base)
    assert sorted(p.name for p in (tmp_path / "t" / "weights").iterdir()) == ["config.json",
                                                                             "model.safetensors.index.json"]
    # the samples carry the first sync's version (1, none stale), the step's own sync makes 2
    assert rows[0]["stale_samples"] == 0 and rows[0]["weight_version"] == 2, rows[0]
    assert rows[0]["train_tokens"] > 0 and rows[0]["logprob_abs_diff"] < 1e-4, rows[0]


@pytest.mark.slow
def test_invariant_run_scores_rollouts_exactly(tmp_path):
    """invariant=True (model.set_invariant in the trainer's stages, --invariant on the embedded server): a bf16 run
    on 2 pipeline stages with activation recompute re-scores every sampled token exactly as the server did
    (without it this run's mean |Δ logprob| is ~5e-5 on one rank, bf16)."""
    r = run(tmp_path / "inv", "--max_steps=1", "--max_new_tokens=8", "--dtype=bfloat16", "--invariant=True",
            "--recompute=True", "--trainable=all", "--pp_size=2", nproc=2)[0]
    assert r["train_tokens"] > 0 and r["logprob_abs_diff_max"] == 0.0 and r["logprob_abs_diff"] == 0.0, r
