"""The probes' timer (bench/probe_*.py, each run as `python bench/probe_NAME.py`, which puts this folder on the path)."""
import time

import torch


def timed(fn, reps=20):
    """Milliseconds a call of fn, the mean of reps calls after 3 to warm up, the device synchronised around them."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(3):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - t0) / reps * 1e3
