"""bench/trace_summary.by_region: a profiled training step's time split by the model's part, forward and backward."""
import os
import sys
from dataclasses import replace

import torch
from torch.profiler import ProfilerActivity, profile

from conftest import TINY
from model_dsv4 import Transformer

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import trace_summary  # noqa: E402


def test_a_steps_ops_count_for_the_parts_that_ran_them(capsys):
    torch.manual_seed(0)
    args = replace(TINY, num_hidden_layers=3, compress_ratios=[0, 4, 16, 0], num_hash_layers=1)  # each kind once
    model = Transformer(args, dtype=torch.float32)
    model.init_weights()
    ids = torch.randint(0, args.vocab_size, (1, 64))
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        model(ids).float().logsumexp(-1).mean().backward()
    table = trace_summary.by_region(prof.events())
    out = capsys.readouterr().out
    for part in ("mHC", "experts (routed + shared)", "attention projections, RoPE", "compressor", "norms"):
        assert table[part]["fwd"] > 0 and table[part]["bwd"] > 0, (part, out)  # backward found its forward's part
        assert part in out
    assert table["indexer"]["fwd"] > 0 and table["head + loss"]["fwd"] > 0, out
    assert table["experts (routed + shared)"]["dense GEMM"] > 0, out  # the experts' linears, as GEMMs
    total = sum(t["fwd"] + t["bwd"] for t in table.values())
    ops = sum(e.self_cpu_time_total for e in prof.events() if e.name.startswith("aten::"))
    assert abs(total - ops) <= 1e-6 * ops  # every op counted once
    assert table["other"]["fwd"] + table["other"]["bwd"] < 0.25 * total, out  # nearly all placed


def test_frame_names_carry_the_class():
    path = os.path.abspath(sys.modules[Transformer.__module__].__file__)
    line = Transformer.head_loss.__code__.co_firstlineno + 1
    assert trace_summary.frame_name(f"{path}({line}): head_loss") == "model_dsv4.Transformer.head_loss"
    assert trace_summary.region([f"{path}({line}): head_loss"]) == "head + loss"
