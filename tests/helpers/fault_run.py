"""Runs train_grpo.py with one fault injected from outside (the trainer has no fault hooks of its own):
    python tests/helpers/fault_run.py FAULT [train_grpo.py arguments...]  (under RANK/WORLD_SIZE/... for several ranks)
FAULT is none, or KIND@STEP[:RANK] (the fault fires in GRPO step STEP, on rank RANK, default 0):
    sigterm      SIGTERM to this rank during the step's rollout (mid-step)
    sigkill      kill -9 of this rank in its first forward of the step
    hang         this rank sleeps for an hour in that forward (for the watchdog)
    nan          the loss of micro-batch 1 is NaN in that step;  nan_from: in that step and every later one
    kill_server_gen   kill -9 of the embedded rollout server as the step's rollout sends its 3rd request (the
                      first two in flight: every request of that attempt fails)
    kill_server_sync  kill -9 of the embedded rollout server at the second bucket of the sync after the step
train_step call i is GRPO step i."""
import os
import runpy
import signal
import subprocess
import sys
import threading
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, ROOT)
import parallel  # noqa: E402
import rollout  # noqa: E402
import weight_sync  # noqa: E402

fault, argv = sys.argv[1], sys.argv[2:]
kind, _, where = fault.partition("@")
step, _, rank = where.partition(":")
step, mine = int(step or 0), int(rank or 0) == int(os.environ.get("RANK", 0))
state = {"train_steps": -1, "requests": 0, "buckets": 0}
lock = threading.Lock()  # the client sends a step's requests from several threads
servers = []


class Popen(subprocess.Popen):  # remembers the embedded rollout server the trainer starts
    def __init__(self, cmd, *a, **k):
        super().__init__(cmd, *a, **k)
        if any(str(c).endswith("server.py") for c in cmd):
            servers.append(self)


def kill_server():
    print(f"fault: kill -9 of the rollout server (pid {servers[-1].pid})", flush=True)
    servers[-1].kill()
    servers[-1].wait()


subprocess.Popen = Popen
train_step, stage_forward, generate, http = (parallel.train_step, parallel.stage_forward,
                                             rollout.RolloutClient.generate, rollout.RolloutClient._http)
post = weight_sync.post


def faulty_train_step(model, grid, opt, mbs, loss_fn, *a, **k):
    state["train_steps"] += 1
    now = state["train_steps"] == step or kind == "nan_from" and state["train_steps"] >= step
    if now and mine and kind.startswith("nan"):
        inner, count = loss_fn, [0]

        def loss_fn(*args):
            out, count[0] = inner(*args), count[0] + 1
            return (out[0] * float("nan"), out[1]) if count[0] == 2 else out
    if now and mine and kind in ("sigkill", "hang"):
        def first_forward(*args, **kw):
            print(f"fault: {kind} on rank {os.environ.get('RANK', 0)} in step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL) if kind == "sigkill" else time.sleep(3600)
        parallel.stage_forward = first_forward
    try:
        return train_step(model, grid, opt, mbs, loss_fn, *a, **k)
    finally:
        parallel.stage_forward = stage_forward


def faulty_generate(self, prompts, n, sampling, seed, desc="rollout", **k):
    if kind == "sigterm" and mine and desc == f"step {step} rollout":
        print(f"fault: SIGTERM to rank {os.environ.get('RANK', 0)} in step {step}'s rollout", flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
    state["in_step"] = desc == f"step {step} rollout"
    return generate(self, prompts, n, sampling, seed, desc=desc, **k)


def faulty_http(self, url, method, path, *a, **k):
    if kind == "kill_server_gen" and path == "/generate" and state.get("in_step"):
        with lock:
            state["requests"] += 1
            if state["requests"] == 3 and servers:
                kill_server()
    return http(self, url, method, path, *a, **k)


def faulty_post(client, urls, path, *a):
    if kind == "kill_server_sync" and state["train_steps"] == step and path == "/update_weights_from_distributed":
        state["buckets"] += 1
        if state["buckets"] == 2 and servers:
            kill_server()
    return post(client, urls, path, *a)


parallel.train_step, rollout.RolloutClient.generate, rollout.RolloutClient._http = (faulty_train_step, faulty_generate,
                                                                                    faulty_http)
weight_sync.post = faulty_post
sys.argv = [os.path.join(ROOT, "train_grpo.py"), *argv]
runpy.run_path(sys.argv[0], run_name="__main__")
