"""Faults injected into the real trainer (tests/fault_run.py): preemption and resume, a rank killed mid-step, a
hung step, NaN losses, the rollout server killed mid-generation and mid-sync. A run that recovers must end where
the uninterrupted run ends: the same rewards, losses and weights (no data lost)."""
import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest
import torch

from model_dsv4 import load_state_dict

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
BASE = ["--n_prompts=4", "--n_samples=4", "--max_new_tokens=8", "--format_warmup_steps=0", "--overlong_buffer=7",
        "--eval_interval=0", "--n_microbatches=2", "--dynamic_sampling=False", "--lr=3e-3", "--max_steps=2"]
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def train(out, fault, *args, timeout=240):
    """One process of train_grpo.py with the fault -> (exit code, stdout + stderr, seconds)."""
    t0 = time.time()
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "fault_run.py"), fault, f"--out_dir={out}", *BASE,
                        *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=ENV)
    return p.returncode, p.stdout + p.stderr, time.time() - t0


def metrics(out):
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


def ckpts(out):
    return sorted(d for d in os.listdir(out) if d.startswith("ckpt_"))


def same_run(out, reference):
    """Steps, rewards, losses and the last checkpoint's weights equal the uninterrupted run's."""
    (ref, ref_out), recs = reference, metrics(out)
    assert [r["step"] for r in recs] == [r["step"] for r in ref] and not any("skipped" in r for r in recs)
    assert all(r["stale_samples"] == 0 for r in recs)  # every trained sample came from the current weights
    for a, b in zip(recs, ref):
        for k in ("reward_mean", "response_len_mean", "loss", "grad_norm"):
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-8), (a["step"], k)
    wa, wb = load_state_dict(os.path.join(out, "ckpt_000001")), load_state_dict(os.path.join(ref_out, "ckpt_000001"))
    assert max((wa[k] - wb[k]).abs().max().item() for k in wb) <= 1e-6


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    code, log, _ = train(out, "none", "--checkpoint_interval=1", "--keep_checkpoints=1")
    assert code == 0, log[-3000:]
    assert ckpts(out) == ["ckpt_000001"]  # keep_checkpoints=1: the older one went
    return metrics(out), out


def test_sigterm_checkpoints_and_resume_equals_uninterrupted(reference, tmp_path):
    code, log, _ = train(tmp_path, "sigterm@0", "--checkpoint_interval=0")  # no checkpoint but the preemption's
    assert code == 143 and "stopped by SIGTERM after step 0" in log, log[-3000:]
    assert ckpts(tmp_path) == ["ckpt_000000"]
    # a crash while writing leaves ckpt_N.tmp; a directory without meta.json is no checkpoint either
    for junk in ("ckpt_000005.tmp", "ckpt_000009"):
        os.makedirs(tmp_path / junk)
    code, log, _ = train(tmp_path, "none", "--resume=True", "--checkpoint_interval=1")
    assert code == 0 and "ignoring incomplete ['ckpt_000005.tmp', 'ckpt_000009']" in log, log[-3000:]
    assert "resumed from" in log and "ckpt_000000 at step 1" in log
    assert "ckpt_000005.tmp" not in ckpts(tmp_path)  # cleaned up by the next save
    same_run(tmp_path, reference)


@pytest.mark.parametrize("fault,args", [
    ("kill_server_gen@1", []),
    ("kill_server_sync@0", ["--weight_sync=distributed", "--weight_sync_bucket_mb=8", "--dist_timeout=30"])],
    ids=["mid-generation", "mid-sync"])
def test_rollout_server_killed_then_restarted_and_resynced(reference, tmp_path, fault, args):
    code, log, _ = train(tmp_path, fault, "--checkpoint_interval=1", *args)
    assert code == 0 and "fault: kill -9 of the rollout server" in log, log[-3000:]
    assert "exited with -9: restarting it" in log, log[-3000:]
    same_run(tmp_path, reference)  # the step redone with the same seeds


def test_nan_loss_skips_the_step_then_stops_the_run(tmp_path):
    code, log, _ = train(tmp_path, "nan_from@1", "--checkpoint_interval=1", "--max_steps=4", "--max_consecutive_skips=2")
    assert code == 1 and "2 steps in a row skipped (the last, step 2" in log, log[-3000:]
    assert "step 1: loss nan in micro-batch 1 of 2" in log
    recs = metrics(tmp_path)
    assert [r.get("skipped") for r in recs] == [None] + ["non-finite loss in micro-batch [1]"] * 2
    w0, w1 = (load_state_dict(os.path.join(tmp_path, d)) for d in ("ckpt_000000", "ckpt_000001"))
    assert all(torch.equal(w0[k], w1[k]) for k in w0)  # the skipped step changed nothing
    mb = torch.load(tmp_path / "nonfinite" / "step000001_rank00000_mb1.pt", weights_only=True)
    assert mb["input_ids"].shape[0] == 8 and "adv" in mb  # the offending micro-batch, for a post-mortem


def test_watchdog_prints_stacks_of_a_hung_step(tmp_path):
    code, log, seconds = train(tmp_path, "hang@1", "--watchdog_s=6", "--checkpoint_interval=0")
    assert code == 124 and "rank 0: watchdog: step 1 has run for over 6 s" in log, log[-3000:]
    assert re.search(r'fault_run.py", line \d+ in first_forward', log)  # where the main thread hangs
    assert seconds < 60


def test_kill9_one_rank_mid_step_stops_every_rank(tmp_path):
    """4 ranks (pp 2 x dp 2), each its own process; rank 1 is killed with SIGKILL in step 1's forward. The
    others must exit non-zero within the collective timeout, naming the group, the operation and their rank."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs, logs, t0 = [], [open(tmp_path / f"rank{r}.log", "w+") for r in range(4)], time.time()
    for rank in range(4):
        env = dict(ENV, RANK=str(rank), WORLD_SIZE="4", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "fault_run.py"), "sigkill@1:1",
                                       f"--out_dir={tmp_path}", *BASE, "--pp_size=2", "--dist_timeout=30",
                                       "--checkpoint_interval=0"], cwd=ROOT, env=env, stdout=logs[rank],
                                      stderr=subprocess.STDOUT))
    t_dead = None
    try:
        while any(p.poll() is None for p in procs) and time.time() - t0 < 240:
            if t_dead is None and procs[1].poll() is not None:
                t_dead = time.time()
            time.sleep(0.2)
    finally:
        for p in procs:
            p.kill()
    waited, codes = time.time() - t_dead, [p.wait() for p in procs]
    outs = [open(f.name).read() for f in logs]
    assert codes[1] == -9 and all(c != 0 for c in codes), (codes, outs)
    assert waited < 30 + 10, f"the survivors took {waited:.0f} s after the kill"  # dist_timeout 30
    t_kill = metrics(tmp_path)  # step 0 finished on every rank before the kill
    assert [r["step"] for r in t_kill] == [0]
    for rank in (0, 2, 3):
        assert re.search(rf"on ranks \[[\d, ]+\] failed on rank {rank}|\(rank {rank}, pp \d/2, .*\) failed",
                         outs[rank]), outs[rank][-3000:]
    pid = int(re.search(r"rollout server ready at .* pid (\d+)\)", outs[0]).group(1))
    time.sleep(2)  # the embedded server follows its trainer (--parent-pid)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
