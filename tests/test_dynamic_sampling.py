"""Dynamic sampling (DAPO) by one rule for every layout: which groups a step keeps and refills, and who trains them."""
import pytest

from grpo import deal
from helpers.grpo_base import make_math_base, run, weights


def test_deal_keeps_minibatches_whole_and_shares_even():
    kept = [(3, 0), (4, 1), (6, 1), (9, 1), (10, 1), (12, 0), (15, 1)]  # (stream position, rank that drew it)
    for dp, n_mini in [(1, 1), (2, 1), (2, 2), (4, 1), (8, 1), (3, 2)]:
        plan = deal([(i, r % dp) for i, r in kept], dp, n_mini)
        for m in range(n_mini):  # minibatch m holds kept[m::n_mini] as in one process, in shares within one
            parts = [plan[r][m] for r in range(dp)]
            assert sorted(i for part in parts for i in part) == sorted(i for i, _ in kept[m::n_mini])
            assert max(map(len, parts)) - min(map(len, parts)) <= 1
    plan = deal(kept, 2, 1)  # rank 0 drew 2 of 7, gets 4: it keeps its own and takes the first two spares
    assert plan == [[[3, 12, 10, 15]], [[4, 6, 9]]]


@pytest.fixture(scope="module")
def math_base(tmp_path_factory):
    from tasks import math_problems
    path = tmp_path_factory.mktemp("math_base")
    make_math_base(str(path), math_problems("rl", 24, 11))  # the RL pool of --n_rl=24 --seed=11
    return str(path)


@pytest.mark.slow
def test_dynamic_sampling_trains_the_same_batch_on_any_layout(tmp_path, math_base):
    """The default job (the math task, every parameter, DAPO's dynamic sampling) for two steps from a base whose
    groups are partly flat: 1 process and PP2 x EP2 on 4 ranks (2 DP ranks) draw the same prompts, refill with the
    same ones (the second step over-samples by the first's kept share), and train the same groups, the 4 ranks in
    micro-batches of a token budget. When each DP rank refilled from a stream of its own they did not."""
    job = [f"--init_from={math_base}", "--data=math", "--eval_data=math", "--n_rl=24", "--seed=11", "--n_prompts=8",
           "--n_samples=4", "--max_new_tokens=16", "--dynamic_sampling=True", "--max_sampling_rounds=4",
           "--trainable=all", "--lr=1e-4", "--max_steps=2", "--checkpoint_interval=2"]
    one = run(tmp_path / "one", *job)
    # the 4 ranks in micro-batches of a token budget (several a step, as many on each DP rank, inert ones where a rank
    # needs fewer), the one process in n_microbatches (grpo_base's 2): the same step
    four = run(tmp_path / "four", *job, "--pp_size=2", "--ep_size=2", "--micro_batch_tokens=64", nproc=4)
    assert one[0]["sampled_groups"] > 8 and one[1]["sampled_groups"] > 8, one  # refills, then over-sampling
    assert all(r["micro_batches"] >= 3 and 0 <= r["padding"] < 1 for r in four), four
    for a, b in zip(one, four):
        assert a["trained_groups"] >= 2 and a["grad_norm"] > 0, a
        for k in ("sampled_groups", "trained_groups", "train_tokens", "response_tokens"):
            assert a[k] == b[k], (a["step"], k)
        for k in ("reward_mean", "reward_std", "kept_group_ratio", "entropy", "grad_norm"):
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-7), (a["step"], k)
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
    w0, w1, w4 = (weights(d) for d in (math_base, tmp_path / "one" / "ckpt_000001", tmp_path / "four" / "ckpt_000001"))
    moved = max((w1[k] - w0[k]).abs().max().item() for k in w1)
    # AdamW's first step moves an entry by up to lr (1e-4) and a different batch moves many by that much; rounding
    # that differs between the layouts shows only where a gradient is within a few 1e-8 of 0 (see test_replay.py)
    assert moved > 5e-5 and max((w1[k] - w4[k]).abs().max().item() for k in w1) <= 1e-5, moved
