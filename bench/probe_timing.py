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


def captured(fn, reps=1):
    """A CUDA graph of reps calls of fn, after one call on a side stream (what a capture needs first)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    return graph


def graph_us(fn, reps=50):
    """Microseconds a call of fn on the device: reps calls captured in one CUDA graph, replayed (not the launches)."""
    graph = captured(fn, reps)
    graph.replay()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) * 1e3 / (5 * reps)
