"""AIME / DAPO-Math grading, pass@k and problem loading. GRPO's reward is math_reward() from here: we train on the
grader we report (house style rule 16). It is DAPO's rule (verl math_dapo: last "Answer:" line in the last 300
characters, Minerva normalisation, exact match), reimplemented, plus fixes: a last \\boxed{} when there is no
"Answer:", "025" == "25", "204." and **bold** accepted, and math-verify for non-integer answers only. All DAPO-Math
and AIME answers are integers, so the training reward stays pure regex: fast and deterministic."""
import json
import math
import os
import re

ROOT = os.path.dirname(os.path.abspath(__file__))  # relative data paths fall back to the repository root
DAPO_TEMPLATE = ("Solve the following math problem step by step. The last line of your response should be of the "
                 "form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{problem}\n\n"
                 "Remember to put your answer on its own line after \"Answer:\".")

# -----------------------------------------------------------------------------
# RESEARCH: answer extraction and normalisation

ANSWER_RE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
INT_RE = re.compile(r"[+-]?[0-9]+")
THOUSANDS_RE = re.compile(r"[+-]?[0-9]{1,3}(,[0-9]{3})+")
# Minerva/DAPO: plain string replacements, applied in this order, then the filler and unit words are deleted.
SUBSTITUTIONS = [("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
                 (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}")]
# DAPO's list, which (unlike lm-eval's Minerva list) has no "ft": deleting it would turn \left( into \le(.
REMOVED = ["square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
           "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
           "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
           "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;",
           ",\\!", "{,}", '"', "\\dots"]


def _braced(s, start):
    """Contents of the {...} group whose "{" is at s[start], braces balanced; None if it never closes."""
    depth = 0
    for i in range(start, len(s)):
        depth += {"{": 1, "}": -1}.get(s[i], 0)
        if depth == 0:
            return s[start + 1:i]


def extract_answer(text):
    """The raw answer string: the last "Answer: ..." line, else the last \\boxed{...}, both searched only in
    the last 300 characters as DAPO does (an answer given early and then argued past does not count)."""
    tail = (text or "")[-300:]
    if found := ANSWER_RE.findall(tail):
        return found[-1]
    i = tail.rfind("\\boxed{")
    return _braced(tail, i + len("\\boxed")) if i != -1 else None  # None also for a \boxed{ cut off by max_tokens


def normalize_answer(s):
    """Minerva/DAPO normalisation plus our fixes (marked "ours"); the prediction and the truth both go through it."""
    s = s.replace("**", "").replace("\u2212", "-")  # ours: markdown bold, unicode minus
    s = s.split("=")[-1]  # "x = 204" -> "204"
    for before, after in SUBSTITUTIONS + [(word, "") for word in REMOVED]:
        s = s.replace(before, after)
    if m := re.search(r"\$(.*?)\$", s):  # keep only the first $...$ (Minerva)
        s = m.group(1)
    # \cmd{x} -> x, matching braces: Minerva's non-greedy regex turned \boxed{\frac{1}{2}} into \frac{1{2}}.
    for cmd in ("\\text{", "\\textbf{", "\\overline{", "\\boxed{"):
        while (i := s.find(cmd)) != -1 and (inner := _braced(s, i + len(cmd) - 1)) is not None:
            s = s[:i] + inner + s[i + len(cmd) + len(inner) + 1:]
    s = re.sub(r"frac([^{])(.)", r"frac{\1}{\2}", s)  # \frac12 -> \frac{1}{2}, also \dfrac, \tfrac
    s = re.sub(r"sqrt([^{])", r"sqrt{\1}", s)  # \sqrt2 -> \sqrt{2}
    s = s.replace("$", "").replace("\\(", "").replace("\\)", "").strip().rstrip(".,;")  # ours: \(..\), "204."
    # Thousands commas only ("1,000"); Minerva drops any comma between digits, so the list "1,2" became "12".
    s = s.replace(",", "") if THOUSANDS_RE.fullmatch(s) else s
    # ours: canonical integers, any size or sign ("025" -> "25", "-0" -> "0", "+7" -> "7")
    return str(int(s)) if INT_RE.fullmatch(s) else s


def math_reward(response, ground_truth):
    """1.0 if the response's final answer matches ground_truth, else 0.0. DAPO scores ±1 = 2 * (0/1) - 1: GRPO's
    group normalisation (r - mean) / std makes the two identical, and without the std they differ by a factor 2
    only. But an overlong penalty added on top weighs twice as much against 0/1. 0/1 doubles as accuracy."""
    if (pred := extract_answer(response)) is None:
        return 0.0
    g = normalize_answer(ground_truth)
    if normalize_answer(pred) == g:  # integers are canonical after normalize_answer: also the int() comparison
        return 1.0
    if INT_RE.fullmatch(g):  # integer truth (all of DAPO and AIME): the string rule decides, no sympy
        return 0.0
    # Non-integer truth: symbolic/numeric check by HF math-verify, imported only now (~1 s, sympy); skipped when
    # it is not installed. No timeouts: they use signal.alarm, which raises outside the main thread, and graders
    # may run in threads (math-verify logs a warning about it). TODO: an answer like 9^9^9^9 can hang sympy.
    try:
        from math_verify import parse, verify
    except ImportError:
        return 0.0
    wrap = lambda s: "$" + s.replace("$", "").replace("**", "").strip().rstrip(".") + "$"  # bare LaTeX: unparsed
    g, p = parse(wrap(ground_truth), parsing_timeout=None), parse(wrap(pred), parsing_timeout=None)
    return float(bool(g and p and verify(g, p, timeout_seconds=None)))


def overlong_penalty(n_tokens, max_tokens, buffer, factor=1.0):
    """DAPO's soft overlong punishment, added to the reward: 0 up to max_tokens - buffer, then linear down to -factor
    at max_tokens. buffer=0 turns it off."""
    exceed = n_tokens - (max_tokens - buffer)
    return -exceed / buffer * factor if buffer > 0 and exceed > 0 else 0.0


# -----------------------------------------------------------------------------
# RESEARCH: pass@k

def pass_at_k(n, c, k):
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021), in the product form: no huge binomials."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per problem, got n={n}")
    assert 0 <= c <= n, f"correct count {c} outside 0..{n}"
    # The product is C(n-c, k) / C(n, k). With n - c < k it has a zero factor (i = k): every k-subset holds a hit.
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def pass_at_k_table(correct_counts, n):
    """{k: pass@k averaged over problems} for k = 1, 2, 4, ... <= n; correct_counts holds one count per problem."""
    return {2 ** j: sum(pass_at_k(n, c, 2 ** j) for c in correct_counts) / len(correct_counts)
            for j in range(n.bit_length())}  # the largest k, 2 ** (n.bit_length() - 1), is <= n


# -----------------------------------------------------------------------------
# BOILERPLATE: problem loading

def data_path(source, key="data"):
    """A .jsonl / .parquet file as given (from the working directory), else from the repository root, so that a
    config's 'data/aime2024.jsonl' loads from any directory. key: the config key that named it, for the error."""
    for path in (source, os.path.join(ROOT, source)):  # join keeps an absolute source as it is
        if os.path.isfile(path):
            return path
    where = "" if os.path.isabs(source) else f" in the working directory ({os.getcwd()}) or the repository ({ROOT})"
    raise ValueError(f"{key}={source!r}: no such file{where}; give --{key}=<a .jsonl or .parquet file> or a hub "
                     f"dataset name (the hub needs network and the datasets package)")


def _read_rows(source, split, key):
    if source.endswith((".jsonl", ".parquet")):
        source = data_path(source, key)
    if source.endswith(".jsonl"):
        with open(source) as f:
            try:
                return [json.loads(line) for line in f if line.strip()]
            except json.JSONDecodeError as e:  # its own message names no file
                raise ValueError(f"{source}: not valid JSON lines ({e})") from None
    if source.endswith(".parquet"):
        import pyarrow.parquet as pq  # lazy, like datasets below: importing eval_aime should cost nothing
        return pq.read_table(source).to_pylist()  # list<struct> and struct columns come back as lists and dicts
    try:  # anything else is a hub dataset name
        import datasets
        return datasets.load_dataset(source, split=split)
    except Exception as e:  # not installed, no network, no such dataset or split: one message for all
        raise ValueError(f"{key}={source!r}: not a .jsonl or .parquet file, so a hub dataset name, which needs the "
                         f"datasets package and network ({type(e).__name__}: {str(e)[:300]}); give --{key}=<a .jsonl "
                         f"or .parquet file>") from None


def load_problems(source, split="train", template=DAPO_TEMPLATE, limit=None, key="data"):
    """[{"id", "prompt", "answer", "problem"}] from a .jsonl, a .parquet or a hub dataset name, in one of three schemas:
    flat {problem, answer}; slime {prompt: [chat], label}; verl/DAPO {prompt: [chat], reward_model.ground_truth,
    extra_info}. A chat prompt is used as is (it is templated); a bare problem goes into `template`. Duplicates are
    dropped (the hub DAPO-Math-17k repeats each ~100 times). key: the config key that named the source, for errors."""
    rows = _read_rows(source, split, key)
    first = rows[0] if len(rows) else {}  # the schema is read off the first row, as parquet columns are uniform
    chat = isinstance(first.get("prompt"), list)
    if not (chat or "problem" in first or "prompt" in first):
        raise ValueError(f"{source}: missing field 'problem' or 'prompt' (has {sorted(first)})")
    answer_key = next((k for k in ("reward_model", "label", "answer") if k in first), None)
    if answer_key is None:
        raise ValueError(f"{source}: missing field 'answer', 'label' or 'reward_model' (has {sorted(first)})")
    records, seen, n_skipped = [], set(), 0
    for i, row in enumerate(rows):
        extra, answer = row.get("extra_info") or {}, row.get(answer_key)
        answer = (answer or {}).get("ground_truth") if answer_key == "reward_model" else answer
        if answer is None or str(answer).strip() == "":
            n_skipped += 1
            continue
        if chat:
            prompt = [m["content"] for m in row["prompt"] if m["role"] == "user"][-1]
            problem = extra.get("problem", prompt)
        else:
            problem = row["problem"] if "problem" in row else row["prompt"]
            prompt = template.replace("{problem}", problem)  # not .format(): a template may hold \boxed{...}
        # One problem = one extra_info.index, else one id, else one prompt text (then the first copy wins).
        uid = extra.get("index", row.get("id", prompt))
        if uid not in seen:
            seen.add(uid)
            records.append({"id": str(row.get("id", extra.get("id", extra.get("index", i)))), "prompt": prompt,
                            "answer": str(answer).strip(), "problem": problem})
    n_dup = len(rows) - n_skipped - len(records)
    if n_skipped or n_dup:
        print(f"{source}: skipped {n_skipped} rows without an answer, dropped {n_dup} duplicate rows")
    return records[:limit]


# -----------------------------------------------------------------------------
# evaluation: n samples per problem from the rollout servers, pass@k by the unbiased estimator

def evaluate(client, tokenizer, problems, n_samples, sampling, seed=0, chat=True, desc="eval"):
    """-> {"pass@1", "pass@2", ..., "mean_len", "truncation_rate", "format_rate", "n_problems", "retried_requests",
    "failed_requests", "per_problem": [...]}. format_rate: the share of samples whose extracted answer is a plain
    integer, right or wrong (a base that can't write the answer line scores 0 however well it computes).
    A request the servers failed (after the client's retries) costs its problem: pass@k is over the problems whose
    n_samples all came back, n_problems counts them, failed_requests the samples lost (summary prints both)."""
    from tasks import prompt_ids  # the same prompt formatting as training
    outs = client.generate([prompt_ids(tokenizer, p["prompt"], chat=chat) for p in problems], n_samples, sampling,
                           seed=seed, desc=desc, partial=True)
    failed = sum(s is None for samples in outs for s in samples)
    retried = sum(s["attempts"] - 1 for samples in outs for s in samples if s is not None)
    whole = [(p, samples) for p, samples in zip(problems, outs) if None not in samples]
    if not whole:
        raise RuntimeError(f"{desc}: every problem lost a sample ({failed} of {len(problems) * n_samples} requests "
                           f"failed)")
    per, lens, trunc = [], [], 0
    for p, samples in whole:
        texts = [tokenizer.decode(s["output_ids"]) for s in samples]
        correct = sum(math_reward(t, p["answer"]) == 1.0 for t in texts)
        per.append({"id": p["id"], "answer": p["answer"], "correct": correct, "n": n_samples,
                    "answers": [extract_answer(t) for t in texts]})
        lens += [len(s["output_ids"]) for s in samples]
        trunc += sum(s["finish_reason"]["type"] == "length" for s in samples)
    res = {f"pass@{k}": v for k, v in pass_at_k_table([q["correct"] for q in per], n_samples).items()}
    answers = [a for q in per for a in q["answers"]]
    res.update(mean_len=sum(lens) / max(len(lens), 1), truncation_rate=trunc / max(len(lens), 1),
               format_rate=sum(a is not None and INT_RE.fullmatch(a.strip()) is not None for a in answers)
               / max(len(answers), 1), n_problems=len(per), retried_requests=retried, failed_requests=failed,
               per_problem=per)
    return res


def summary(res):
    """One line of an evaluate() result: pass@k, the well-formed share, the mean length, the problems' count."""
    return (" ".join(f"{k} {v:.3f}" for k, v in res.items() if k.startswith("pass@")) + f" | well-formed "
            f"{res['format_rate']:.3f} | mean_len {res['mean_len']:.0f} | truncated {res['truncation_rate']:.1%} | "
            f"{res['n_problems']} problems" + (f" | {res['retried_requests']} requests retried"
                                               if res.get('retried_requests') else "")
            + (f" | {res['failed_requests']} requests FAILED: their problems left out" if res.get('failed_requests')
               else ""))


if __name__ == "__main__":
    import argparse
    from rollout import RolloutClient
    from tasks import load_tokenizer, toy_problems
    ap = argparse.ArgumentParser(description="AIME-style evaluation through SGLang or the embedded server")
    ap.add_argument("--data", required=True, help="a .jsonl / .parquet file, a hub dataset name, or 'toy'")
    ap.add_argument("--rollout_url", required=True, help="comma-separated server URLs")
    ap.add_argument("--tokenizer", default="deepseek-v4", help="'deepseek-v4', 'bytes' or a tokenizer.json path")
    ap.add_argument("--n_samples", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top_p", type=float, default=0.7)
    ap.add_argument("--max_new_tokens", type=int, default=4096)
    ap.add_argument("--limit", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="eval_results.json")
    ap.add_argument("--no_chat", action="store_true", help="raw prompt, no DeepSeek chat formatting")
    a = ap.parse_args()
    probs = toy_problems() if a.data == "toy" else load_problems(a.data, split="test")
    res = evaluate(RolloutClient(a.rollout_url), load_tokenizer(a.tokenizer), probs[:a.limit or None], a.n_samples,
                   dict(temperature=a.temperature, top_p=a.top_p, max_new_tokens=a.max_new_tokens), a.seed,
                   chat=not a.no_chat and a.data != "toy")
    print(f"{'problem':>14s} {'answer':>8s} correct  sampled answers")
    for q in res["per_problem"]:
        print(f"{q['id']:>14s} {q['answer']:>8s} {q['correct']:3d}/{q['n']:<3d} {q['answers'][:8]}")
    print(f"{summary(res)}, n={a.n_samples}, T={a.temperature}, top_p={a.top_p}, max_new_tokens={a.max_new_tokens}")
    json.dump({"args": vars(a), **res}, open(a.out, "w"), indent=1)
    print(f"wrote {a.out}")
