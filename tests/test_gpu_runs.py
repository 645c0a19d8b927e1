"""The user's GPU commands, short, on one GPU (part of the GPU tier, `python -m pytest -m gpu`): train_sft.py and
train_grpo.py with training graphs (train_graphs='auto': micro-batches of a token budget), the micro model in bf16,
the embedded server decoding the rollouts and the evals on the same GPU. Each run replays every micro-batch from a graph
captured once for its shape (none eager, no graph captured again), its padding reported, and the graphed GRPO step
scores and updates as the eager one does."""
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU commands need a GPU")]
GRAPHS = ("graph_replayed", "graph_captured", "graph_eager")


def run(script, out, *args, cache):
    """script's run to out (one shared kernel-check cache) -> (its metrics rows, its output)."""
    p = subprocess.run([sys.executable, script, f"--out_dir={out}", f"--compile_cache={cache}", *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))], p.stdout


def check_graphs(rows, log, later_captures):
    """Every micro-batch from a graph: none eager, each shape captured once (at most later_captures after the first
    step, as the last micro-batch of a step meets a new size), replays in every step after the first."""
    assert "train graphs: on" in log and "moved" not in log, log[-3000:]
    rows = [r for r in rows if "graph_replayed" in r]
    assert len(rows) >= 2 and all(r["graph_eager"] == 0 for r in rows), [{k: r[k] for k in GRAPHS} for r in rows]
    assert sum(r["graph_captured"] for r in rows[1:]) <= later_captures, [[r[k] for k in GRAPHS] for r in rows]
    assert sum(r["graph_replayed"] for r in rows[1:]) >= len(rows) - 1


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """train_sft.py config/sft_micro.py in bf16 on the GPU, 16 steps, then its held-out eval (the in-process engine's
    CUDA-graph decode): the base every GRPO run here starts from."""
    d = tmp_path_factory.mktemp("gpu")
    rows, log = run("train_sft.py", d / "base", "config/sft_micro.py", "--dtype=bfloat16", "--max_steps=16",
                    "--train_graphs=auto", "--pack_samples=True",
                    "--micro_batch_tokens=1024", "--n_test=16", "--eval_n_samples=2", "--log_interval=1",
                    cache=d / "cache")
    return d, rows, log


def test_sft_replays_each_micro_batch_shape(base):
    """SFT with training graphs: micro-batches of 1,024 tokens (several a step, packed, some padding), every one
    replayed from its graph after the first, the loss falling, the eval run on what it wrote."""
    _, rows, log = base
    check_graphs(rows, log, later_captures=3)
    assert all(r["micro_batches"] >= 2 and 0 <= r["padding"] < 0.5 for r in rows), rows
    assert rows[-1]["loss"] < 0.7 * rows[0]["loss"] and "eval_pass@1" in rows[-1], rows[-1]


def test_grpo_graphed_steps_equal_eager_and_replay(base):
    """train_grpo.py from that base with training graphs (the embedded server decoding on the same GPU, CUDA IPC
    weight sync), 4 steps with evals, and the same job eager for 2 steps: the same rollouts (seeded) scored and
    updated alike within bf16, the graphed run replaying every micro-batch and its engine and trainer agreeing."""
    d, _, _ = base
    job = [f"--init_from={d / 'base'}", "--dtype=bfloat16", "--weight_sync=tensor", "--dynamic_sampling=False",
           "--n_prompts=8", "--n_samples=8", "--max_new_tokens=48", "--micro_batch_tokens=1024", "--lr=1e-4",
           "--checkpoint_interval=0", "--eval_limit=16", "--eval_n_samples=2"]
    rows, log = run("train_grpo.py", d / "graphed", *job, "--max_steps=4", "--eval_interval=2", "--train_graphs=auto",
                    cache=d / "cache")
    eager, elog = run("train_grpo.py", d / "eager", *job, "--max_steps=2", "--eval_interval=0", "--train_graphs=off",
                      cache=d / "cache")
    check_graphs(rows, log, later_captures=3)
    steps = [r for r in rows if "loss" in r]
    assert "train graphs: off (train_graphs='off')" in elog and len(steps) == 4
    assert [r["step"] for r in rows if "eval_pass@1" in r] == [0, 2, 4]
    for r in steps:
        assert r["response_tokens"] > 0 and r["train_tokens"] > 0 and r["micro_batches"] >= 2, r
        assert r["logprob_abs_diff"] < 2e-2 and 0 <= r["padding"] < 0.5, r  # bf16 engine and bf16 trainer
    g, e = steps[0], eager[0]  # one policy, the same seeded rollouts: the step's numbers within bf16
    assert g["response_tokens"] == e["response_tokens"] and g["reward_mean"] == e["reward_mean"], (g, e)
    assert abs(g["loss"] - e["loss"]) <= 1e-3 and abs(g["entropy"] - e["entropy"]) <= 1e-2 * e["entropy"], (g, e)
    assert e["grad_norm"] > 0 and abs(g["grad_norm"] - e["grad_norm"]) <= 3e-2 * e["grad_norm"], (g, e)
    assert all(r["grad_norm"] > 0 for r in steps)


def test_grpo_fp8_actor_against_the_fp8_engine(base):
    """FP8 rollouts (the W8A8 engine) and FP8 training from the same base, graphed, 2 steps: every micro-batch
    replayed, the FP8 grouped experts' backward on any row counts, and the trainer scoring the engine's tokens far
    closer than a bf16 trainer against the same engine."""
    d, _, _ = base
    job = [f"--init_from={d / 'base'}", "--dtype=bfloat16", "--weight_sync=tensor", "--dynamic_sampling=False",
           "--n_prompts=8", "--n_samples=8", "--max_new_tokens=48", "--micro_batch_tokens=1024", "--max_steps=2",
           "--checkpoint_interval=0", "--eval_interval=0", "--rollout_quant=fp8"]
    fp8, log = run("train_grpo.py", d / "fp8", *job, "--train_quant=fp8", "--train_graphs=auto", cache=d / "cache")
    bf16, _ = run("train_grpo.py", d / "fp8_bf16", *job, cache=d / "cache")
    check_graphs(fp8, log, later_captures=3)
    assert all(r["grad_norm"] > 0 and r["train_tokens"] > 0 for r in fp8), fp8
    assert fp8[0]["logprob_abs_diff"] < 0.5 * bf16[0]["logprob_abs_diff"], (fp8[0], bf16[0])
