"""
Failure made loud, bounded and recoverable: the guards train_grpo.py sets up once, and a post-mortem helper. The
checkpoints a run resumes from are checkpoint.py's.

    watchdog = Watchdog(seconds, rank)      # a step over `seconds`: every thread's stack on stderr, exit 124
    preempt = Preemption()                  # SIGTERM / SIGINT: finish the step, checkpoint, exit 128 + signal
    skips = Skips(max_in_a_row)             # skipped steps (non-finite, rollouts failed): stop after N in a row
    report_nonfinite(step, metrics, ...)    # which micro-batch of which rank, saved for a post-mortem

What each bounds. A collective with a dead peer fails after dist_timeout (parallel.named says which group, op
and rank); a collective that never fails (an NCCL kernel spinning on a peer that is alive but stuck) is what the
watchdog is for. It runs in a thread of its own, so it fires while the main thread sits inside C code, and
faulthandler prints the Python stacks of every thread of this rank. `kill -USR1 <pid>` prints them on demand.
"""
import faulthandler
import math
import os
import signal
import sys
import threading
import time

import torch

import parallel

class Watchdog:
    """arm(what) at the start of a step, disarm() at its end; off when seconds is 0."""

    def __init__(self, seconds, rank):
        self.seconds, self.rank, self.what, self.deadline = seconds, rank, "", None
        faulthandler.enable()  # a segfault prints the stacks too
        if hasattr(signal, "SIGUSR1"):
            faulthandler.register(signal.SIGUSR1, all_threads=True)
        if seconds > 0:
            threading.Thread(target=self._watch, daemon=True, name="watchdog").start()

    def arm(self, what):
        self.what, self.deadline = what, time.monotonic() + self.seconds

    def disarm(self):
        self.deadline = None

    def _watch(self):
        while True:
            time.sleep(min(1.0, self.seconds / 4))
            deadline = self.deadline
            if deadline is not None and time.monotonic() > deadline:
                print(f"rank {self.rank}: watchdog: {self.what} has run for over {self.seconds} s; the stacks of "
                      f"rank {self.rank}'s threads follow, then it exits", file=sys.stderr, flush=True)
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                sys.stderr.flush()
                os._exit(124)  # the exit code of timeout(1); atexit does not run (it could hang too)


class Preemption:
    """SIGTERM and SIGINT set `signum`. Before the loop (defer False) they exit at once: there is nothing to save. In
    the loop the trainer finishes the step, agrees with the other ranks (one of them may be the only one signalled),
    writes a checkpoint and exits 128 + signum. A second signal exits at once: the newest complete checkpoint stays."""

    def __init__(self):
        self.signum, self.defer = 0, False
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, self._handle)

    def _handle(self, signum, frame):
        if not self.defer or self.signum:
            sys.exit(128 + signum)  # SystemExit: atexit runs (it stops the embedded server)
        self.signum = signum
        print(f"got {signal.Signals(signum).name}: stopping after this step, with a checkpoint", file=sys.stderr,
              flush=True)

    def safe_point(self, grid, step, save):
        """The end of a step, on every rank: when a signal reached any rank, every rank saves (save(); None when the
        step has saved already) and exits 128 + signum."""
        sig = int(parallel.all_reduce(torch.tensor(float(self.signum), device=grid.device), grid.world_group,
                                      "preemption flag", op=torch.distributed.ReduceOp.MAX))
        if sig:
            if save is not None:
                save()
            if grid.rank == 0:
                print(f"stopped by {signal.Signals(sig).name} after step {step}, checkpoint written; continue with "
                      f"--resume=True", flush=True)
            raise SystemExit(128 + sig)


class Skips:
    """Consecutive skipped steps. Each one is logged; max_in_a_row of them stop the run (0: never)."""

    def __init__(self, max_in_a_row):
        self.max, self.in_a_row = max_in_a_row, 0

    def update(self, step, reason):
        """reason: why step `step` was skipped, or None when it trained. Raises SystemExit after too many."""
        self.in_a_row = self.in_a_row + 1 if reason else 0
        if reason and self.max and self.in_a_row >= self.max:
            raise SystemExit(f"error: {self.in_a_row} steps in a row skipped (the last, step {step}: {reason}); "
                             f"stopping (max_consecutive_skips={self.max})")


def report_nonfinite(step, m, mbs, model, rank, out_dir, say_grads):
    """A skipped update (parallel.train_step's m): this rank's micro-batches with a non-finite loss, each saved to
    out_dir for a post-mortem; or, when every loss was finite, the parameters whose gradients were not. -> why."""
    for i, loss in m["nonfinite"]:
        path = os.path.join(out_dir, f"step{step:06d}_rank{rank:05d}_mb{i}.pt")
        os.makedirs(out_dir, exist_ok=True)
        torch.save({k: v for k, v in mbs[i].items() if torch.is_tensor(v)}, path)
        print(f"rank {rank}: step {step}: loss {loss} in micro-batch {i} of {len(mbs)} (input_ids "
              f"{list(mbs[i]['input_ids'].shape)}): update skipped; micro-batch saved to {path}", flush=True)
    if say_grads and not m["nonfinite"]:
        bad = [n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
        print(f"rank {rank}: step {step}: gradient norm {m['grad_norm']} with finite losses: update skipped; "
              f"non-finite gradients in {len(bad)} tensors here, e.g. {bad[:4]}", flush=True)
    return (f"non-finite loss in micro-batch {[i for i, _ in m['nonfinite']]}" if m["nonfinite"]
            else "non-finite gradient norm" if not math.isfinite(m["grad_norm"]) else "non-finite loss on another rank")
