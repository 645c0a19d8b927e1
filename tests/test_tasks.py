"""The math task (tasks.py): pools disjoint by computation, a fixed held-out set, seeds, worked solutions that are right
step by step and graded 1.0 by the reward, the noisy teacher's slips, the difficulty knobs, and a clear error for a pool
too small."""
import random
import re

import pytest

from eval_aime import INT_RE, extract_answer, math_reward
from tasks import SPLITS, math_batch, math_problem, math_problems, math_split, math_step

KNOBS = [dict(), dict(words=1.0), dict(steps=1, digits=2), dict(steps=3, digits=3, ops="+-*", words=0.5),
         dict(steps=4, digits=2, ops="*-")]


def every_computation(steps, digits, ops="+-"):
    """The whole space of a small task config, by brute force, as math_problem keys ("3+8-5")."""
    top, keys = 10 ** digits, []

    def walk(value, key, left):
        if not left:
            return keys.append(key)
        for op in ops:
            for b in range(2, 10) if op == "*" else range(min(value, top - 1) + 1) if op == "-" else range(top):
                walk({"+": value + b, "-": value - b, "*": value * b}[op], f"{key}{op}{b}", left - 1)
    for x in range(top):
        walk(x, str(x), steps)
    return keys


def test_pools_partition_the_computations_and_never_meet():
    """The default config's 2,605 computations, each in exactly one pool; the held-out set, the RL prompts and a long
    run's supervised batches (what train_sft trains on) lie in their own pools, worded or not."""
    space = every_computation(2, 1)
    pools = {s: {k for k in space if math_split(k) == s} for s in SPLITS}
    assert sum(map(len, pools.values())) == len(space) == 2605 and all(len(p) > 200 for p in pools.values())
    for words in (0.0, 0.5):
        test = math_problems("test", 200, words=words)
        rl = math_problems("rl", 400, seed=7, words=words)
        sft = math_batch(random.Random(1), 4000, words=words)
        keys = {name: {p["key"] for p in ps} for name, ps in (("test", test), ("rl", rl), ("sft", sft))}
        assert len(keys["test"]) == 200 and len(keys["rl"]) == 400  # distinct computations
        for name, ks in keys.items():
            assert ks <= pools[name], name
        assert len(keys["sft"]) > 0.75 * len(pools["sft"])  # the supervised stream covers most of its pool
        assert not (keys["test"] & keys["sft"] or keys["rl"] & keys["sft"] or keys["test"] & keys["rl"])


def test_held_out_set_is_fixed_and_seeds_decide_the_rest():
    assert math_problems("test", 100) == math_problems("test", 100)  # the held-out set: no seed to forget
    assert math_problems("rl", 50, seed=3) == math_problems("rl", 50, seed=3)
    assert math_problems("rl", 50, seed=3) != math_problems("rl", 50, seed=4)
    draw = lambda s: [p["prompt"] for p in math_batch(random.Random(s), 64, words=0.5)]
    assert draw(1) == draw(1) and draw(1) != draw(2)


@pytest.mark.parametrize("knobs", KNOBS)
def test_worked_solutions_are_right_and_graded_one(knobs):
    """Every solution earns reward 1.0 against its answer, ends in a well-formed integer answer, and is right step by
    step: each column fact ("9+7=16", "4*6+4=28", "13-7=6"), each step's result, which its columns' digits spell (the
    last column in full, then the units of the others), and the answer, the prompt's value under Python's arithmetic
    (parentheses where "*" follows "+" or "-")."""
    rng = random.Random(0)
    for _ in range(300):
        p = math_problem(rng, **knobs)
        assert math_reward(p["solution"], p["answer"]) == 1.0
        assert INT_RE.fullmatch(extract_answer(p["solution"]).strip())
        for a, op, b, carry, c in re.findall(r"(\d+)([-+*])(\d+)(?:\+(\d+))?=(\d+)\b", p["solution"]):
            assert {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op] + int(carry or 0) == int(c), p
        for a, op, b, cols, c in re.findall(r"(\d+)([-+*])(\d+): ([^.]*), so (\d+)\.", p["solution"]):
            digits = [int(col.split("=")[1]) for col in cols.split(", ")]  # units first; the last column in full
            written = int(str(digits[-1]) + "".join(str(d % 10) for d in digits[-2::-1]))  # the columns, read back
            assert eval(f"{a}{op}{b}") == int(c) == written, p
        expr = p["prompt"][:-2] if p["prompt"].endswith("=?") else p["solution"].split("=?")[0]
        assert eval(expr) == int(p["answer"]) >= 0, p  # worded: the solution's first line is the arithmetic prompt


@pytest.mark.parametrize("knobs", KNOBS)
def test_noisy_teacher_miscopies_once_and_is_graded_zero(knobs):
    """A slipped solution reads like a right one: well-formed, the prompt's operations in order, each step right
    (math_step) from the value it starts from, which is the previous step's result, except that one step after the
    first starts one too high; so its answer is off the true one and graded 0.0. A one-step problem cannot slip."""
    rng = random.Random(1)
    for _ in range(300):
        p = math_problem(rng, **knobs, slip=rng.random())
        work = p["solution"].split("=? ")[-1]  # worded: past the arithmetic prompt
        value, slipped = int(re.match(r"\d+", p["key"]).group()), []
        for i, (op, b) in enumerate(re.findall(r"([-+*])(\d+)", p["key"])):
            s = next(s for s in (0, 1) if work.startswith(math_step(value + s, op, int(b))[0]))
            text, value = math_step(value + s, op, int(b))
            slipped += [i] * s
            work = work[len(text):].lstrip()
        assert work == f"Answer: {value}" and INT_RE.fullmatch(extract_answer(p["solution"]).strip()), p
        assert len(slipped) == (len(re.findall(r"[-+*]", p["key"])) > 1) and 0 not in slipped
        assert math_reward(p["solution"], p["answer"]) == (0.0 if slipped else 1.0), p


def test_teacher_error_rate_and_what_it_leaves_alone():
    """math_batch's share of slipped solutions is teacher_error (3 standard errors); the problems drawn are the same for
    every teacher_error, only solutions change; the held-out and RL problems (math_problems, no teacher) are right."""
    for err in (0.0, 0.1, 0.4):
        batch = math_batch(random.Random(5), 4000, teacher_error=err)
        wrong = sum(math_reward(p["solution"], p["answer"]) == 0.0 for p in batch) / len(batch)
        assert abs(wrong - err) <= 3 * (err * (1 - err) / len(batch)) ** 0.5 + 1e-9, (err, wrong)
        assert [p["key"] for p in batch] == [p["key"] for p in math_batch(random.Random(5), 4000)]
    for split, seed in (("test", 0), ("rl", 1337)):
        assert all(math_reward(p["solution"], p["answer"]) == 1.0 for p in math_problems(split, 200, seed, words=0.5))
    with pytest.raises(ValueError, match="teacher_error"):
        math_batch(random.Random(0), 1, teacher_error=1.0)


def test_teacher_bug_fails_exactly_the_problems_that_borrow():
    """The misconception (teacher_bug): a borrowing column takes its 10 and the lender keeps its digit. Its solutions
    are wrong on every problem with a borrow (some a - b whose last i digits are below b's) and right on the rest;
    the problems are those any other teacher gets."""
    assert math_step(83, "-", 47, no_borrow=True) == ("83-47: 13-7=6, 8-4=4, so 46.", 46)
    assert math_step(103, "-", 5, no_borrow=True) == ("103-5: 13-5=8, 0-0=0, 1-0=1, so 108.", 108)
    assert math_step(58, "-", 7, no_borrow=True) == math_step(58, "-", 7)

    def borrows(key):
        value, hit = int(re.match(r"\d+", key).group()), False
        for op, b in re.findall(r"([+*-])(\d+)", key):
            b = int(b)
            hit |= op == "-" and any(value % 10 ** i < b % 10 ** i for i in range(1, len(str(value)) + 1))
            value = {"+": value + b, "-": value - b, "*": value * b}[op]
        return hit
    buggy = math_batch(random.Random(5), 1000, steps=3, digits=2, teacher_bug=0.999999)
    assert [p["key"] for p in buggy] == [p["key"] for p in math_batch(random.Random(5), 1000, steps=3, digits=2)]
    wrong = [math_reward(p["solution"], p["answer"]) == 0.0 for p in buggy]
    assert wrong == [borrows(p["key"]) for p in buggy] and 0.3 < sum(wrong) / len(wrong) < 0.8
    with pytest.raises(ValueError, match="teacher_bug"):
        math_batch(random.Random(0), 1, teacher_error=0.5, teacher_bug=0.5)


def test_columns_read_as_on_paper():
    assert math_step(3, "+", 8) == ("3+8=11.", 11)
    assert math_step(97, "+", 70) == ("97+70: 7+0=7, 9+7=16, so 167.", 167)
    assert math_step(58, "+", 7) == ("58+7: 8+7=15, 5+0+1=6, so 65.", 65)
    assert math_step(83, "-", 47) == ("83-47: 13-7=6, 7-4=3, so 36.", 36)
    assert math_step(103, "-", 5) == ("103-5: 13-5=8, 9-0=9, 0-0=0, so 98.", 98)  # a borrow through a zero
    assert math_step(47, "*", 6) == ("47*6: 7*6=42, 4*6+4=28, so 282.", 282)


def test_knobs_change_the_problems():
    rng = random.Random(0)
    ops_of = lambda p: re.findall(r"(?<=\d)[-+*]", p["key"])
    for steps in (1, 2, 4):
        assert all(len(ops_of(math_problem(rng, steps=steps))) == steps for _ in range(50))
    def operands(d):
        return [int(x) for _ in range(200) for x in re.findall(r"\d+", math_problem(rng, digits=d, ops="+")["key"])]
    assert max(operands(1)) == 9 and 10 <= min(max(operands(2)), 99) and max(operands(3)) >= 100
    assert all(set(ops_of(math_problem(rng, steps=3, ops="*"))) == {"*"} for _ in range(20))
    worded, plain = math_problem(rng, words=1.0), math_problem(rng, words=0.0)
    assert worded["prompt"].endswith("now?") and worded["solution"].split(" ")[0].endswith("=?")
    assert plain["prompt"].endswith("=?")
    # a harder config has longer solutions
    mean_len = lambda **k: sum(len(math_problem(rng, **k)["solution"]) for _ in range(200)) / 200
    assert mean_len(steps=1) < mean_len(steps=2) < mean_len(steps=2, digits=2) < mean_len(steps=3, digits=3)


def test_a_pool_too_small_is_a_clear_error():
    """steps=1 digits=1 has 155 computations, 17 of them held out: asking for 100 held-out problems cannot work."""
    assert sum(math_split(k) == "test" for k in every_computation(1, 1)) == 17
    assert len(math_problems("test", 17, steps=1, digits=1)) == 17  # the whole pool can be had
    with pytest.raises(ValueError, match=r"'test' pool .* gave only 17 distinct problems .* 100 asked"):
        math_problems("test", 100, steps=1, digits=1)
    for bad in (dict(steps=0), dict(digits=0), dict(ops="/"), dict(words=2.0)):
        with pytest.raises(ValueError, match="math task"):
            math_problem(random.Random(0), **bad)
    with pytest.raises(ValueError, match="split must be one of"):
        math_problems("train", 10)
