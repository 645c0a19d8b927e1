"""
A rehearsal of the seed run's layout on the CPU: config/rehearsal.py (PP2 x EP2 on 4 gloo ranks, recompute, optimizer
offload, distributed weight sync into FP8 rollouts, evals, checkpoints, resume) under torchrun for --steps GRPO steps,
with the job killed mid-run and resumed. It then reports what a "100 steps without a deadlock" claim rests on: the
steps completed, the hangs, the skipped steps, the max |delta logprob| between trainer and engine per step, and the
seconds per step.

    OMP_NUM_THREADS=1 python scripts/rehearsal.py                      # 100 steps; SIGTERM in step 33, SIGKILL in 66
    python scripts/rehearsal.py --steps=2 --kills= --base=DIR -- --data=toy --eval_data=toy   # a short one

1. The base: train_sft.py config/sft_micro.py into out_dir/base (the math task's SFT model, so steps have reward
   spread and train), unless --base names one or it is there already.
2. Launches of `torchrun --standalone --nproc_per_node=4 train_grpo.py config/rehearsal.py`, each in a process group
   of its own. A kill SIG@STEP waits for step STEP - 1's record in metrics.jsonl, then `--delay` seconds, so that it
   lands inside step STEP. SIGTERM goes to the 4 ranks only (a preemption: they finish the step, checkpoint and exit
   143; torchrun's agent would send a second SIGTERM, which exits at once); SIGKILL goes to the ranks and the agent
   (a crash: the resume redoes the steps after the newest checkpoint). The next launch resumes.
3. A hang is a launch whose metrics.jsonl gains no record for --stall_s (the group is then killed) or whose log shows
   train_grpo's own watchdog firing. The report reads the last record of each step: a redone step counts once.
Arguments after `--` go to train_grpo.py. The report is printed and written to out_dir/rehearsal.json.
"""
import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def records(out_dir):
    """metrics.jsonl's records; a torn last line (a kill mid-write) is skipped."""
    path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    rows = []
    for line in open(path).read().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return rows


def ranks_of(agent_pid):
    """The pids of the trainer ranks that torchrun's agent started (its children running train_grpo.py)."""
    try:
        with open(f"/proc/{agent_pid}/task/{agent_pid}/children") as f:
            kids = [int(p) for p in f.read().split()]
        return [p for p in kids if b"train_grpo.py" in open(f"/proc/{p}/cmdline", "rb").read()]
    except (FileNotFoundError, ProcessLookupError):  # the agent or a rank has just exited
        return []


def alive(pid):
    """Running (a zombie waits only to be reaped)."""
    try:
        return open(f"/proc/{pid}/stat").read().rpartition(") ")[2][:1] not in ("Z", "")
    except FileNotFoundError:
        return False


def signal_job(agent_pid, sig):
    """sig to the ranks; SIGKILL to the agent as well. Each rank runs in a session of its own (torchrun starts them
    so), so a signal to the agent's process group misses them: killed alone, the agent leaves them training on."""
    for pid in ranks_of(agent_pid):
        os.kill(pid, sig)
    if sig == signal.SIGKILL:
        os.killpg(agent_pid, signal.SIGKILL)


def launch(i, cmd, out_dir, kill, delay, stall_s):
    """One torchrun job until it exits -> (exit code, what was done to it). kill: (signal, step) or None."""
    log = open(os.path.join(out_dir, f"launch{i}.log"), "w")
    print(f"launch {i}: {' '.join(cmd)}" + (f" (then {kill[0].name} in step {kill[1]})" if kill else ""), flush=True)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    seen, last_change, did, ranks = len(records(out_dir)), time.time(), None, []
    while proc.poll() is None:
        time.sleep(1)
        ranks = ranks_of(proc.pid) or ranks
        recs = records(out_dir)
        if len(recs) != seen:
            seen, last_change = len(recs), time.time()
        if kill and did is None and any(r["step"] == kill[1] - 1 and "t_train" in r for r in recs):
            time.sleep(delay)  # into step kill[1]: its rollout or its training
            signal_job(proc.pid, kill[0])
            did = f"{kill[0].name} in step {kill[1]}"
            print(f"launch {i}: sent {did}", flush=True)
        if time.time() - last_change > stall_s:
            signal_job(proc.pid, signal.SIGKILL)
            did = f"hang: no record for {stall_s} s"
            print(f"launch {i}: {did}; killed", flush=True)
    code = proc.wait()
    log.close()
    deadline = time.time() + 30
    while any(alive(p) for p in ranks) and time.time() < deadline:
        time.sleep(1)
    if left := [p for p in ranks if alive(p)]:  # they would go on writing into out_dir beside the next launch
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        did = f"{did}; ranks {left} outlived torchrun by 30 s, killed"
    if "watchdog: step" in open(log.name).read():  # a rank's watchdog fired (torchrun's own exit code is then 1)
        did = "hang: train_grpo's watchdog fired"
    print(f"launch {i}: exit {code}" + (f" ({did})" if did else ""), flush=True)
    return code, did


def report(out_dir, steps, launches, wall_s):
    """The numbers of the run, from metrics.jsonl and the launches."""
    recs = records(out_dir)
    per_step, times_seen = {}, {}
    for r in recs:
        if r["step"] < steps:
            per_step[r["step"]] = r  # the last record wins: a redone step's second run
            times_seen[r["step"]] = times_seen.get(r["step"], 0) + 1
    done = sorted(per_step)
    trained = [per_step[s] for s in done if "t_train" in per_step[s]]
    secs = [r["t_rollout"] + r["t_train"] + r["t_sync"] for r in trained]
    dlp_max = [r.get("logprob_abs_diff_max", 0.0) for r in trained if "skipped" not in r]
    dlp_mean = [r.get("logprob_abs_diff", 0.0) for r in trained if "skipped" not in r]
    evals = {r["step"]: r["eval_pass@1"] for r in recs if "eval_pass@1" in r}
    rewards = [per_step[s]["reward_mean"] for s in done if "reward_mean" in per_step[s]]
    hangs = [d for c, d in launches if (d or "").startswith("hang")]
    rep = {
        "steps_completed": len(done), "steps_expected": steps, "contiguous": done == list(range(steps)),
        "steps_redone": sorted(s for s, n in times_seen.items() if n > 1),
        "launches": [{"exit": c, "done_to_it": d} for c, d in launches], "hangs": len(hangs),
        "skipped_steps": {s: per_step[s]["skipped"] for s in done if "skipped" in per_step[s]},
        "max_abs_dlogprob_per_step": [round(x, 4) for x in dlp_max],
        "max_abs_dlogprob": max(dlp_max, default=None), "mean_abs_dlogprob_range": [min(dlp_mean, default=None),
                                                                                     max(dlp_mean, default=None)],
        "seconds_per_step": {"median": statistics.median(secs) if secs else None, "max": max(secs, default=None),
                             "min": min(secs, default=None), "what": "t_rollout + t_train + t_sync, evals excluded"},
        "wall_s": round(wall_s), "eval_pass@1": evals,
        "reward_mean_first_last_10": [statistics.mean(rewards[:10]) if rewards else None,
                                      statistics.mean(rewards[-10:]) if rewards else None],
    }
    with open(os.path.join(out_dir, "rehearsal.json"), "w") as f:
        json.dump(rep, f, indent=1)
    f3 = lambda x: "-" if x is None else f"{x:.3f}"
    print(f"\nrehearsal: {rep['steps_completed']}/{steps} steps completed "
          f"({'contiguous' if rep['contiguous'] else 'GAPS'}), {len(rep['steps_redone'])} redone after a kill; "
          f"{len(launches)} launches, exits "
          f"{[c for c, _ in launches]}; hangs {rep['hangs']}; skipped steps {len(rep['skipped_steps'])} "
          f"{rep['skipped_steps'] or ''}")
    e2 = lambda x: "-" if x is None else f"{x:.2e}"
    print(f"max |delta logprob| per step: max {f3(rep['max_abs_dlogprob'])}, median "
          f"{f3(statistics.median(dlp_max) if dlp_max else None)}; mean |delta logprob| per step "
          f"{e2(rep['mean_abs_dlogprob_range'][0])} to {e2(rep['mean_abs_dlogprob_range'][1])}")
    s = rep["seconds_per_step"]
    print(f"seconds per step (rollout + train + sync): median {f3(s['median'])}, min {f3(s['min'])}, max "
          f"{f3(s['max'])}; wall {rep['wall_s']} s in all; reward mean, first / last 10 steps "
          f"{f3(rep['reward_mean_first_last_10'][0])} / {f3(rep['reward_mean_first_last_10'][1])}; eval pass@1 {evals}")
    print(f"wrote {os.path.join(out_dir, 'rehearsal.json')}")
    ok = rep["contiguous"] and not hangs and launches and launches[-1][0] == 0
    return 0 if ok else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out_dir", default="out/rehearsal")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--kills", default="TERM@33,KILL@66", help="SIG@STEP,...: TERM or KILL, in step STEP; '' for none")
    ap.add_argument("--base", default="", help="the GRPO start: a checkpoint dir or 'scratch' (a random "
                    "model_config); '' = out_dir/base, made if missing")
    ap.add_argument("--nproc", type=int, default=4, help="ranks: pp_size x dp, with config/rehearsal.py's PP2 x EP2")
    ap.add_argument("--delay", type=float, default=1.0, help="seconds after step STEP - 1's record that a kill waits")
    ap.add_argument("--stall_s", type=float, default=1500, help="seconds without a new record that count as a hang")
    a, extra = ap.parse_known_args()
    extra = [x for x in extra if x != "--"]
    out_dir = os.path.abspath(a.out_dir)
    try:
        kills = [(signal.Signals["SIG" + k.split("@")[0]], int(k.split("@")[1])) for k in a.kills.split(",") if k]
    except (ValueError, KeyError, IndexError):
        sys.exit(f"error: --kills={a.kills!r}: expected SIG@STEP,... with SIG TERM or KILL, e.g. TERM@33,KILL@66")
    if any(s not in (signal.SIGTERM, signal.SIGKILL) or not 0 < k < a.steps for s, k in kills):
        sys.exit(f"error: --kills={a.kills!r}: each SIG is TERM or KILL and each STEP within 1..{a.steps - 1}")
    os.makedirs(out_dir, exist_ok=True)
    for name in os.listdir(out_dir):  # a fresh run: the previous one's records and checkpoints go, the base stays
        if name.startswith(("ckpt_", "launch", "metrics.jsonl", "rehearsal.json", "weights", "nonfinite")):
            path = os.path.join(out_dir, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    t0 = time.time()
    base = a.base if a.base == "scratch" else os.path.abspath(a.base or os.path.join(out_dir, "base"))
    if not a.base and not os.path.isfile(os.path.join(base, "config.json")):
        print(f"making the base: train_sft.py config/sft_micro.py --out_dir={base}", flush=True)
        with open(os.path.join(out_dir, "sft.log"), "w") as log:
            if subprocess.run([sys.executable, "train_sft.py", "config/sft_micro.py", f"--out_dir={base}"], cwd=ROOT,
                              stdout=log, stderr=subprocess.STDOUT).returncode:
                sys.exit(f"error: train_sft.py failed; see {log.name}")
    t_base = time.time() - t0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={a.nproc}",
           "train_grpo.py", "config/rehearsal.py", f"--out_dir={out_dir}", f"--init_from={base}",
           f"--max_steps={a.steps}", "--resume=True", *extra]
    launches, t1 = [], time.time()
    for i in range(len(kills) + 1):
        launches.append(launch(i, cmd, out_dir, kills[i] if i < len(kills) else None, a.delay, a.stall_s))
        code, did = launches[-1]
        if i < len(kills) and (did is None or did.startswith("hang")):  # it ended on its own, or hung: no resume
            print(f"launch {i}: " + (f"ended before its kill (exit {code})" if did is None else did), flush=True)
            break
    print(f"base {t_base:.0f} s; GRPO launches {time.time() - t1:.0f} s")
    return report(out_dir, a.steps, launches, time.time() - t1)


if __name__ == "__main__":
    sys.exit(main())
