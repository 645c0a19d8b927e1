"""train_sft.py end to end: a short run's metrics and checkpoint, PP2 x EP2 on 4 gloo ranks against one process, and
bad input as a usage error."""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from helpers.script import run_script
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the micro model (config/models/micro.json: window, CSA and HCA layers, a hash layer, 8 experts, mHC), a small batch
QUICK = ["--batch_size=8", "--n_microbatches=2", "--warmup_steps=0", "--log_interval=1"]


def run(out, *args, nproc=1):
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc > 1
           else [sys.executable]) + [os.path.join(ROOT, "train_sft.py"), f"--out_dir={out}", *QUICK, *args]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


@pytest.mark.slow
def test_short_run_logs_evaluates_and_writes_a_checkpoint(tmp_path):
    """Eight steps: one metrics row a step (loss, tokens/s), the held-out eval at steps 4 and 8 (pass@k and the
    well-formed share, from the checkpoint it wrote), a falling loss, and a checkpoint that loads strictly into a full
    model and into a pipeline stage as train_grpo --init_from loads it, with the trained weights in it."""
    from checkpoint import from_pretrained, load_weights
    import parallel
    from model_dsv4 import ModelArgs
    rows = run(tmp_path, "--max_steps=8", "--eval_interval=4", "--n_test=6", "--eval_n_samples=2",
               "--max_new_tokens=24", "--lr=3e-3")
    assert [r["step"] for r in rows] == list(range(8))
    assert all(r["tok_s"] > 0 and r["tokens"] > 0 and not r["skipped"] for r in rows)
    assert rows[-1]["loss"] < 0.8 * rows[0]["loss"], [r["loss"] for r in rows]
    evals = [r for r in rows if "eval_pass@1" in r]
    assert [r["step"] for r in evals] == [3, 7]
    for r in evals:
        assert r["eval_n_problems"] == 6 and 0 <= r["eval_pass@1"] <= r["eval_pass@2"] <= 1
        assert 0 <= r["eval_format_rate"] <= 1 and 0 < r["eval_mean_len"] <= 24
    model = from_pretrained(str(tmp_path), dtype=torch.float32)  # strict: every tensor, none extra
    fresh = ModelArgs.from_json(os.path.join(ROOT, "config", "models", "micro.json"))
    assert model.args == fresh
    stage = parallel.build_stage(fresh, parallel.init_distributed(), init=True, seed=1337)
    before = stage.embed.weight.clone()
    load_weights(stage, str(tmp_path), strict=False)
    assert torch.equal(stage.embed.weight, model.embed.weight) and not torch.equal(before, model.embed.weight)


def weights(path):
    from checkpoint import load_state_dict
    return load_state_dict(str(path))


@pytest.mark.slow
def test_sft_pp2_ep2_equals_one_rank(tmp_path):
    """One global batch a step, sharded over DP: 4 gloo ranks (2 stages x 2 DP ranks that also split the experts) train
    on the same examples as one process, so every step's loss and the weights after 3 steps agree to fp32 rounding. The
    one process runs 4 micro-batches, the same ones as the 2 DP ranks' 2 each, so that the comparison is of the layout
    alone. AdamW moves an entry whose gradient is near zero by up to lr whatever its rounding (it divides by the
    gradient's size), so the steps are small (lr 5e-4: ~3e-6 here); a batch drawn per rank, a loss normalised per rank
    or a missing gradient reduce moves weights by ~lr, and the losses apart at once."""
    args = ["--max_steps=3", "--n_test=0", "--lr=5e-4", "--pack_samples=False"]  # packed, each rank packs its own
    one = run(tmp_path / "one", *args, "--n_microbatches=4")
    four = run(tmp_path / "four", *args, "--pp_size=2", "--ep_size=2", nproc=4)
    for a, b in zip(one, four, strict=True):
        assert a["tokens"] == b["tokens"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    assert one[-1]["loss"] < one[0]["loss"]
    w1, w4 = weights(tmp_path / "one"), weights(tmp_path / "four")
    assert set(w1) == set(w4) and any(".experts." in k for k in w1)
    assert max((w1[k] - w4[k]).abs().max().item() for k in w1) <= 1e-5


# (argument, what stderr says; {tmp} is the test's tmp_path), as train_sft.py's exit 2
BAD_INPUT = [("--init_from={tmp}", "is not a checkpoint directory"),
             ("--model_config={tmp}/small.json", "259 ids, more than the model's vocab_size 200"),
             ("--math_steps=1", "gave only 17 distinct problems"),
             ("--math_teacher_error=1.0", "math_teacher_bug=0.0: shares of the solutions"),
             ("--math_teacher_bug=0.6", "math_teacher_error=0.4, math_teacher_bug=0.6")]


@pytest.mark.parametrize("bad,says", BAD_INPUT)
def test_bad_input_is_a_usage_error(tmp_path, bad, says):
    """Exit 2 with a message that names the problem, before any model is built: an init_from without a checkpoint, a
    tokenizer larger than the model's vocabulary, a held-out set the task config cannot fill, a teacher error that is
    not a share below 1."""
    small = json.load(open(os.path.join(ROOT, "config", "models", "micro.json")))
    small["vocab_size"] = 200
    json.dump(small, open(tmp_path / "small.json", "w"))
    code, _, err = run_script("train_sft.py", f"--out_dir={tmp_path / 'out'}", *QUICK, bad.format(tmp=tmp_path))
    assert code == 2 and says in err, (bad, err[-2000:])  # in this process: the check comes before anything is built


@pytest.mark.slow
def test_default_run_makes_the_base_then_trains_every_parameter_from_it(tmp_path):
    """train_grpo.py with no init_from (the README's main command, scaled down): it trains the base with train_sft.py
    into out_dir/base, then GRPO trains every parameter from it, with held-out evals before the first update and after
    the last; a second run finds the base and does not train another."""
    cfg = tmp_path / "sft.py"
    cfg.write_text(open(os.path.join(ROOT, "config", "sft_micro.py")).read()
                   + "max_steps = 4\nbatch_size = 8\nwarmup_steps = 0\nn_test = 4\neval_n_samples = 2\n")
    grpo = [sys.executable, os.path.join(ROOT, "train_grpo.py"), f"--out_dir={tmp_path / 'run'}", f"--sft_config={cfg}",
            "--n_test=8", "--eval_n_samples=2", "--n_prompts=2", "--n_samples=4", "--max_new_tokens=16",
            "--checkpoint_interval=0", "--max_sampling_rounds=1"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run(grpo + ["--max_steps=2", "--eval_interval=1"], cwd=ROOT, capture_output=True, text=True,
                       timeout=600, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "no base in" in p.stdout and os.path.isfile(tmp_path / "run" / "base" / "config.json")
    held = re.search(r"holds ([0-9.]+)M parameters, trains ([0-9.]+)M \(all\)", p.stdout)
    assert held and held[1] == held[2] and float(held[1]) > 2, p.stdout[-3000:]  # freeze_router would say so
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    evals = [r for r in rows if "eval_pass@1" in r]
    assert [r["step"] for r in evals] == [0, 1, 2] and rows[-1] == evals[-1] and "reward_mean" not in rows[-1]
    assert all(r["eval_n_problems"] == 8 and 0 <= r["eval_format_rate"] <= 1 for r in evals)
    p = subprocess.run(grpo + ["--max_steps=0"], cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0 and "no base in" not in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]
