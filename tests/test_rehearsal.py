"""The seed layout's rehearsal (scripts/rehearsal.py, config/rehearsal.py): its first 2 steps, on 4 gloo ranks under
torchrun, from grpo_base's toy base (the rehearsal's own SFT base takes minutes to make). The 100-step run with its
kills is not part of the suite."""
import json
import math
import os
import subprocess
import sys

import pytest

from helpers.grpo_base import ARGS as SPREAD_ARGS, assert_policy_gradient, base_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_rehearsal_first_two_steps(tmp_path_factory, tmp_path):
    base = base_checkpoint(tmp_path_factory)
    p = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "rehearsal.py"), f"--out_dir={tmp_path}",
                        "--steps=2", "--kills=", f"--base={base}", "--", *SPREAD_ARGS, "--eval_limit=2",
                        "--eval_n_samples=2"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    log = open(tmp_path / "launch0.log").read() if (tmp_path / "launch0.log").exists() else ""
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:] + log[-3000:]
    assert "rehearsal: 2/2 steps completed (contiguous)" in p.stdout and "hangs 0; skipped steps 0" in p.stdout
    rep = json.load(open(tmp_path / "rehearsal.json"))
    assert rep["launches"] == [{"exit": 0, "done_to_it": None}] and rep["skipped_steps"] == {}
    # the engine serves FP8 weights, the trainer runs fp32: the logprobs differ, but not wildly
    assert len(rep["max_abs_dlogprob_per_step"]) == 2 and 1e-4 < rep["max_abs_dlogprob"] < 5, rep
    assert math.isfinite(rep["seconds_per_step"]["median"]) and rep["seconds_per_step"]["median"] > 0
    recs = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert_policy_gradient([r for r in recs if "t_train" in r])  # reward spread: the steps trained
    assert sorted(rep["eval_pass@1"]) == ["0", "2"]  # before the first step and after the last (JSON keys)
    # the seed's settings, as config/rehearsal.py sets them
    assert "pp 0/2 dp 0/2 ep 0/2" in log and "quant fp8" in log and "building the model" in log
    cfg = json.loads(next(line for line in log.splitlines() if line.startswith("config: {"))[len("config: "):])
    assert {k: cfg[k] for k in ("weight_sync", "rollout_quant", "recompute", "optimizer_offload", "resume")} == dict(
        weight_sync="distributed", rollout_quant="fp8", recompute=True, optimizer_offload=True, resume=True)
    assert os.listdir(tmp_path / "ckpt_000001")  # the last step's checkpoint
