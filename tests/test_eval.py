"""Tests for eval_aime.py: the grader on the DAPO rule's edge cases, pass@k against the binomial
closed form, the overlong penalty, and load_problems on tiny files in each schema (CPU, no network, fast)."""
import json, math, subprocess, sys, threading

import pytest

from eval_aime import (DAPO_TEMPLATE, extract_answer, load_problems, math_reward, normalize_answer,
                       overlong_penalty, pass_at_k, pass_at_k_table)

FILLER = "\nLet me double-check this by another route, which gives the same thing." * 6  # > 300 characters


@pytest.mark.parametrize("response, truth, reward", [
    ("... so the total is 204.\nAnswer: 204", "204", 1.0),
    ("Answer: 025", "25", 1.0),                         # DAPO says 0: "025" != "25"
    ("Answer: 204.", "204", 1.0),                       # DAPO says 0
    ("Answer: **204**", "204", 1.0),                    # DAPO says 0
    ("The answer is \\boxed{204}", "204", 1.0),         # no "Answer:" line: the last \boxed{} (DAPO says 0)
    ("Answer: 204\nAnswer: 205", "205", 1.0),           # the last match wins...
    ("Answer: 204\nAnswer: 205", "204", 0.0),           # ...so the earlier one does not count
    ("Answer: x = 204", "204", 1.0),
    ("answer : 1,000", "1000", 1.0),
    ("Answer: $204$", "204", 1.0),
    ("Answer: \\boxed{204}", "204", 1.0),
    ("Answer: 204 minutes", "204", 1.0),
    ("Answer: \\(204\\)", "204", 1.0),
    ("Answer: $-2015028$", "-2015028", 1.0),            # negative
    ("Answer: -5", "5", 0.0),
    ("Answer: \u22127", "-7", 1.0),                     # unicode minus
    ("Answer: 22000000000000000000001", "22000000000000000000001", 1.0),  # beyond int64 and float precision
    ("Answer: 22000000000000000000001", "22000000000000000000000", 0.0),
    ("Answer: 12,345,678", "12345678", 1.0),
    ("Answer: 12, 13", "12", 0.0),                      # hedging over several candidates earns nothing
    ("First \\boxed{12}, but on reflection \\boxed{13}", "13", 1.0),
    ("First \\boxed{12}, but on reflection \\boxed{13}", "12", 0.0),
    ("Answer: 13", "12", 0.0),
    ("Answer: 204" + FILLER, "204", 0.0),               # only the last 300 characters are read
    ("\\boxed{204}" + FILLER, "204", 0.0),
    ("", "204", 0.0),
    (None, "204", 0.0),
    ("I could not solve it.", "204", 0.0),
])
def test_math_reward(response, truth, reward):
    assert math_reward(response, truth) == reward


def test_extract_answer_returns_raw_string():
    assert extract_answer("Answer: **204**.") == "**204**."
    assert extract_answer("so \\boxed{\\frac{1}{2}} is it") == "\\frac{1}{2}"  # balanced braces
    assert extract_answer("Answer:\n\\boxed{7}") == "\\boxed{7}"  # \s* crosses the newline, as in DAPO
    assert extract_answer("cut off by max_tokens: \\boxed{\\frac{1}{2") is None
    assert extract_answer("Answer: 204" + FILLER) is None
    assert extract_answer(None) is None and extract_answer("") is None


@pytest.mark.parametrize("raw, norm", [
    ("025", "25"), ("-0", "0"), ("+7", "7"), ("-0042", "-42"), ("1,000", "1000"), ("1,2", "1,2"),
    ("\\text{(A)}", "(A)"), ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"), ("\\frac12", "\\frac{1}{2}"),
    ("\\sqrt2", "\\sqrt{2}"), ("\\overline{3}", "3"), ("\\textbf{5}.", "5"), ("10^\\circ", "10"),
    ("5\\text{ cm}", "5"), ("x = \\$ 3", "3"), ("\\left(1,2\\right)", "\\left(1,2\\right)"),
])
def test_normalize_answer(raw, norm):
    assert normalize_answer(raw) == norm


def test_math_verify_fallback_for_non_integers():
    pytest.importorskip("math_verify")
    assert math_reward("Answer: 1/2", "\\frac{1}{2}") == 1.0
    assert math_reward("Answer: 0.5", "\\frac{1}{2}") == 1.0
    assert math_reward("so \\boxed{\\dfrac{1}{2}}", "0.5") == 1.0
    assert math_reward("Answer: 0.6", "\\frac{1}{2}") == 0.0
    # no signal.alarm timeouts: the fallback must also work outside the main thread (threaded graders)
    out = []
    t = threading.Thread(target=lambda: out.append(math_reward("Answer: 1/2", "0.5")))
    t.start(), t.join()
    assert out == [1.0]


def test_integer_truth_never_uses_math_verify():
    # "408/2" equals 204, but an integer truth is decided by the string/int rule alone, as in DAPO
    assert math_reward("Answer: 408/2", "204") == 0.0


def test_import_is_light():
    code = "import sys, eval_aime; print(sorted({'datasets', 'math_verify', 'pyarrow', 'torch'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_pass_at_k_matches_closed_form():
    for n in range(1, 11):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)
    assert pass_at_k(32, 4, 8) == pytest.approx(0.704505, abs=1e-6)  # values checked in the doc
    assert pass_at_k(16, 1, 8) == pytest.approx(0.5)
    assert pass_at_k(16, 0, 8) == 0.0 and pass_at_k(16, 9, 8) == 1.0
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 8)


def test_pass_at_k_table():
    table = pass_at_k_table([0, 4, 16], n=16)
    assert list(table) == [1, 2, 4, 8, 16]
    assert table[1] == pytest.approx((0 + 4 / 16 + 1) / 3)  # pass@1 = mean(c / n)
    assert table[16] == pytest.approx(2 / 3)
    assert list(pass_at_k_table([3], n=12)) == [1, 2, 4, 8]


def test_overlong_penalty():
    assert overlong_penalty(1000, 20480, 4096) == 0.0
    assert overlong_penalty(16384, 20480, 4096) == 0.0
    assert overlong_penalty(18432, 20480, 4096) == pytest.approx(-0.5)
    assert overlong_penalty(20480, 20480, 4096) == pytest.approx(-1.0)
    assert overlong_penalty(20480, 20480, 4096, factor=0.5) == pytest.approx(-0.5)
    assert overlong_penalty(20480, 20480, 0) == 0.0  # disabled


# ----------------------------------------------------------------------------- load_problems

def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def write_parquet(path, rows):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def chat(text):
    return [{"content": text, "role": "user"}]


def test_load_flat_jsonl(tmp_path, capsys):
    src = write_jsonl(tmp_path / "flat.jsonl", [
        {"id": "p0", "problem": "What is 1+1?", "answer": "2"},
        {"id": "p1", "problem": "What is {x}?", "answer": 34},  # int answer, braces in the problem
        {"id": "p2", "problem": "No key.", "answer": ""},
        {"id": "p3", "problem": "No key either.", "answer": None},
        {"id": "p0", "problem": "What is 1+1?", "answer": "2"},  # duplicate id
    ])
    probs = load_problems(src)
    assert [p["id"] for p in probs] == ["p0", "p1"]
    assert probs[0] == {"id": "p0", "problem": "What is 1+1?", "answer": "2",
                        "prompt": DAPO_TEMPLATE.replace("{problem}", "What is 1+1?")}
    assert probs[1]["answer"] == "34" and "What is {x}?\n\nRemember" in probs[1]["prompt"]
    assert "skipped 2 rows without an answer, dropped 1 duplicate" in capsys.readouterr().out
    assert len(load_problems(src, limit=1)) == 1
    boxed = "Put the answer in \\boxed{$Answer}.\n\n{problem}"  # slime-style template: braces are fine
    assert load_problems(src, template=boxed)[0]["prompt"] == "Put the answer in \\boxed{$Answer}.\n\nWhat is 1+1?"


def test_load_slime_jsonl_dedups_by_prompt_text(tmp_path):
    src = write_jsonl(tmp_path / "slime.jsonl", [
        {"prompt": chat("Templated A"), "label": "34"},
        {"prompt": chat("Templated B"), "label": "-7"},
        {"prompt": chat("Templated A"), "label": "34"},
    ])
    probs = load_problems(src)
    assert [(p["prompt"], p["answer"]) for p in probs] == [("Templated A", "34"), ("Templated B", "-7")]


def test_load_verl_parquet_dedups_by_index(tmp_path, capsys):
    # The hub DAPO copy repeats each problem ~100 times with the same extra_info.index.
    rows = [{"data_source": "math_dapo", "prompt": [{"content": "sys", "role": "system"}] + chat(f"T{i % 3}"),
             "ability": "MATH", "reward_model": {"ground_truth": str(10 * (i % 3)), "style": "rule"},
             "extra_info": {"index": f"uuid-{i % 3}"}} for i in range(12)]
    rows.append({**rows[0], "reward_model": {"ground_truth": None, "style": "rule"}, "extra_info": {"index": "u9"}})
    probs = load_problems(write_parquet(tmp_path / "dapo.parquet", rows))
    assert [(p["id"], p["prompt"], p["answer"]) for p in probs] == [
        ("uuid-0", "T0", "0"), ("uuid-1", "T1", "10"), ("uuid-2", "T2", "20")]  # user turn, as is
    assert "skipped 1 rows without an answer, dropped 9 duplicate" in capsys.readouterr().out


def test_load_flat_parquet(tmp_path):
    src = write_parquet(tmp_path / "aime.parquet", [{"problem": "P1", "answer": 73}, {"problem": "P2", "answer": 5}])
    probs = load_problems(src, template="Q: {problem}")
    assert [(p["id"], p["prompt"], p["answer"], p["problem"]) for p in probs] == [
        ("0", "Q: P1", "73", "P1"), ("1", "Q: P2", "5", "P2")]


def test_malformed_files(tmp_path):
    src = write_jsonl(tmp_path / "noanswer.jsonl", [{"problem": "P", "solution": "long text"}])
    with pytest.raises(ValueError, match="noanswer.jsonl.*missing field 'answer'"):
        load_problems(src)
    src = write_jsonl(tmp_path / "noproblem.jsonl", [{"question": "P", "answer": "1"}])
    with pytest.raises(ValueError, match="noproblem.jsonl.*missing field 'problem' or 'prompt'"):
        load_problems(src)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "P", "answer": "1"}\n{"problem": oops\n')
    with pytest.raises(ValueError, match="bad.jsonl"):
        load_problems(str(bad))
    src = write_parquet(tmp_path / "cols.parquet", [{"text": "P", "answer": "1"}])
    with pytest.raises(ValueError, match="cols.parquet.*missing field 'problem'"):
        load_problems(src)
