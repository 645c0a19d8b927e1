"""A base checkpoint for the GRPO runs that are compared with each other (layouts, resume, faults).

A random model never writes "Answer: <digit>" in the toy task: every sample scores the same, every advantage is 0,
and such runs agree whatever the policy-gradient path does. This base writes the format and the right digit about
half the time, so a group of 4 samples mostly holds right and wrong answers: reward spread. It is made once a pytest
session, in the test process, and every compared run starts from it (--init_from), so every layout starts from the
same weights."""
import json
import os
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# What a compared run adds to its arguments, after --init_from:
#   10 new tokens hold "Answer: d" and EOS; rewards 0 / 1, no overlong penalty;
#   no entropy bonus: the policy gradient is the whole gradient (and the on-policy loss, -mean advantage, is 0 but
#   for rounding), so grad_norm > 0 says that it is non-zero;
#   embeddings and head only, at lr 3e-4: the base's body is random, and a step on all of it (even at lr 1e-4), or on
#   embeddings and head at lr 3e-3, undoes the format, and the next steps have no reward spread;
#   no TIS: the loss does not read the engine's logprobs, which move in the 7th digit with the order in which the
#   server batches requests (a resumed or restarted run batches them otherwise), so those runs train bit for bit alike.
ARGS = ["--data=toy", "--eval_data=toy", "--max_new_tokens=10", "--overlong_buffer=0", "--entropy_coef=0",
        "--trainable=io", "--lr=3e-4", "--tis_cap=0"]


def make_base(path, steps=40, seed=0):
    """The default run's model (config/models/tiny.json) with its random body, and its output end (hc_head, final
    norm, head) fitted by `steps` full-batch Adam steps to 'Answer: <digit>' + EOS after each toy prompt: the right
    digit with probability 0.55, each other one 0.05. The body stays as initialised, so its streams are computed
    once. Saved in the official layout, config.json included -> the last loss (nats per response)."""
    from checkpoint import save_pretrained
    from model_dsv4 import ModelArgs, Transformer
    from tasks import ByteTokenizer, prompt_ids, toy_problems
    torch.manual_seed(seed)
    model = Transformer(ModelArgs.from_json(os.path.join(ROOT, "config", "models", "tiny.json")), dtype=torch.float32)
    model.init_weights(seed)
    tok, problems = ByteTokenizer(), toy_problems()
    lead, digits = tok.encode("Answer: "), torch.tensor(tok.encode("0123456789"))
    prompts = torch.tensor([prompt_ids(tok, p["prompt"]) for p in problems])  # [10, P]
    P = prompts.shape[1]
    # every prompt, then "Answer: " and each digit: [10 prompts, 10 digits, P + 9] -> [100, P + 9]
    ids = torch.cat([prompts[:, None].expand(-1, 10, -1), torch.tensor(lead).expand(10, 10, -1),
                     digits.expand(10, -1)[..., None]], -1).flatten(0, 1)
    with torch.no_grad(), model.numerics():  # the body's streams from the last prompt token on
        model.stack_experts()
        x = model.embed_streams(ids)
        for layer in model.layers.values():
            x = layer(x, ids)
        x = x.view(10, 10, *x.shape[1:])[:, :, P - 1:]  # [prompt, digit, 10 positions, ...]
    # before the digit, the ten sequences of a prompt are one; after it, one per digit (whose target is EOS)
    shared, after = x[:, 0, :-1], x[:, :, -1]
    want = torch.tensor(lead).expand(10, -1)  # [10, 8]: the targets before the digit
    w = torch.tensor([[0.05 + 0.5 * (str(d) == p["answer"]) for d in range(10)] for p in problems])  # [10, 10]
    opt = torch.optim.Adam([p for n, p in model.named_parameters() if n.startswith(("head.", "norm.", "hc_head_"))],
                           lr=3e-2)
    for _ in range(steps):
        with model.numerics():
            lp = model.logits(shared).log_softmax(-1)  # [10, 9, vocab]: "Answer: ", then the digit
            lp_eos = model.logits(after).log_softmax(-1)[..., tok.eos_id]  # [10, 10]: EOS after each digit
        loss = -(lp[:, :-1].gather(-1, want[..., None]).sum() + ((lp[:, -1, digits] + lp_eos) * w).sum()) / 10
        opt.zero_grad()
        loss.backward()
        opt.step()
    save_pretrained(model, path)
    return loss.item()


def make_math_base(path, problems, steps=80, seed=0):
    """The default run's model (config/models/micro.json) with its random body and its output end fitted, as
    make_base's, to answer each math problem with "Answer: <n>" + EOS: the right n with probability 0.97, 0.5 and 0.03
    in turn over the problems, else n + 1. Most groups of 4 samples on the first and last kinds are flat (all right or
    all wrong): dynamic sampling drops them and draws again. -> the last loss (nats per problem)."""
    from checkpoint import save_pretrained
    from model_dsv4 import ModelArgs, Transformer
    from tasks import ByteTokenizer, prompt_ids
    torch.manual_seed(seed)
    model = Transformer(ModelArgs.from_json(os.path.join(ROOT, "config", "models", "micro.json")), dtype=torch.float32)
    model.init_weights(seed)
    tok, rows = ByteTokenizer(), []  # (prompt, answer line, weight): two a problem, the right and the wrong answer
    for i, p in enumerate(problems):
        right = (0.97, 0.5, 0.03)[i % 3]
        for answer, w in ((p["answer"], right), (str(int(p["answer"]) + 1), 1 - right)):
            rows.append((prompt_ids(tok, p["prompt"]), tok.encode(f"Answer: {answer}") + [tok.eos_id], w))
    T = max(len(p) + len(a) for p, a, _ in rows)
    ids, mask = torch.full((len(rows), T), tok.pad_id), torch.zeros(len(rows), T - 1)
    for b, (p, a, w) in enumerate(rows):  # right-padded; the mask weighs the answer line's targets
        ids[b, :len(p) + len(a)] = torch.tensor(p + a)
        mask[b, len(p) - 1:len(p) + len(a) - 1] = w
    with torch.no_grad(), model.numerics():  # the body's streams, computed once
        model.stack_experts()
        x = model.embed_streams(ids)
        for layer in model.layers.values():
            x = layer(x, ids)
    opt = torch.optim.Adam([p for n, p in model.named_parameters() if n.startswith(("head.", "norm.", "hc_head_"))],
                           lr=3e-2)
    for _ in range(steps):
        with model.numerics():
            lp = model.logits(x[:, :-1]).log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
        loss = -(lp * mask).sum() / len(problems)
        opt.zero_grad()
        loss.backward()
        opt.step()
    save_pretrained(model, path)
    return loss.item()


def base_checkpoint(tmp_path_factory):
    """The base's directory, made at the first call of the pytest session (config.json is written last)."""
    path = tmp_path_factory.getbasetemp() / "grpo_base"
    if not (path / "config.json").exists():
        n = torch.get_num_threads()
        torch.set_num_threads(1)  # small ops: a second thread only waits on the other processes' time slices
        try:
            make_base(str(path))
        finally:
            torch.set_num_threads(n)
    return str(path)


def assert_policy_gradient(records):
    """Each step (metrics.jsonl records) had reward spread within a group: with ARGS' entropy_coef=0 the policy
    gradient is the whole gradient, and it is 0 exactly when every group's rewards are equal (all advantages 0)."""
    for r in records:
        assert r["reward_std"] > 0 and r["grad_norm"] > 0, {k: r.get(k) for k in ("step", "reward_std", "grad_norm")}


def run(out, *args, nproc=1):
    """The real entry point, tiny and quick: the toy task, rewards as graded, a checkpoint a step."""
    base = ["--out_dir=" + str(out), "--init_from=scratch", "--model_config=config/models/tiny.json", "--data=toy",
            "--eval_data=toy", "--n_prompts=4", "--n_samples=4",
            "--eval_interval=0", "--n_microbatches=2", "--dynamic_sampling=False",
            "--checkpoint_interval=1", "--keep_checkpoints=5", "--lr=3e-3"]
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc > 1
           else [sys.executable]) + [os.path.join(ROOT, "train_grpo.py"), *base, *args]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


def weights(ckpt):
    from checkpoint import load_state_dict
    return load_state_dict(ckpt)
