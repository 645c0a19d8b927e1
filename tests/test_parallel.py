"""Every parallel layout against the one-process run, on 4 gloo ranks launched from here.
Each rank is its own process (not torchrun), so a test can watch every rank's exit and message when one fails."""
import glob
import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import replace

import pytest
import torch

import parallel
from helpers import parallel_run
from memory_plan import plan_table
from model_dsv4 import ModelArgs, Transformer

RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers", "parallel_run.py")
PARAM_TOL = 1e-5


def launch(out_dir, pp, ep, variants, env=None, n=4, timeout=240):
    """Start n ranks of parallel_run.py; return (exit codes, outputs, seconds until the last exited)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs, t0 = [], time.time()
    for rank in range(n):
        e = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=str(port), OMP_NUM_THREADS="1", **(env or {}))
        procs.append(subprocess.Popen([sys.executable, RUNNER, str(out_dir), str(pp),
                                       str(ep), variants], env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    try:
        outs = [p.communicate(timeout=max(1, timeout - (time.time() - t0)))[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    return [p.returncode for p in procs], outs, time.time() - t0


@pytest.fixture(scope="module")
def reference():
    """The one-process run: world size 1 goes through the same functions, with no process group. [plain, fp8]"""
    return [parallel_run.run(parallel.init_distributed(), n_micro=1, schedule="1f1b", fp8=fp8) for fp8 in (False, True)]


def merged(out_dir, variant):
    """Stitch the ranks' state dicts into one; copies of a tensor on several ranks must be identical."""
    state, losses = {}, None
    for f in sorted(glob.glob(f"{out_dir}/{variant}.rank*.pt")):
        d = torch.load(f, weights_only=True)
        losses = d["losses"] if d["last_stage"] else losses  # the loss lives on the last stage
        for k, v in d["state"].items():
            assert k not in state or torch.equal(state[k], v), f"{k}: copies differ across ranks ({f})"
            state[k] = v
    return losses, state


LAYOUTS = {  # (pp, ep) on 4 ranks -> the variants run there (fp8: train_quant='fp8', held to its own one process)
    "pp4": (4, 1, "1:1f1b,4:1f1b,4:afab,4:1f1b:recompute:offload,4:1f1b:fp8"),
    "pp2-dp2": (2, 1, "1:1f1b,4:1f1b,4:afab,4:afab:fp8"),
    "dp4-ep4": (1, 4, "1:1f1b,4:1f1b,4:1f1b:recompute,4:1f1b:recompute:fp8"),
    "dp4-ep2": (1, 2, "1:1f1b,4:1f1b,4:1f1b:fp8"),
    "pp2-dp2-ep2": (2, 2, "1:1f1b,4:1f1b,4:afab,4:afab:recompute:offload,4:1f1b:fp8"),
}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """launched(layout) -> (out_dir, exit codes, outputs): each layout's 4 ranks started once a module, with its
    variants and, on the dp4-ep layouts, the EP MoE check after them ("moe"). The layout test and the EP test read
    the same launch: 4 processes importing torch on 2 cores cost seconds a launch, and the EP check's grid (pp 1, ep 2
    or 4) is the layout's own. A failed EP check fails the layout test too (its exit code)."""
    runs = {}

    def get(layout):
        if layout not in runs:
            pp, ep, variants = LAYOUTS[layout]
            out = tmp_path_factory.mktemp(layout)
            codes, outs, _ = launch(out, pp, ep, variants + (",moe" if pp == 1 else ""))
            runs[layout] = out, codes, outs
        return runs[layout]
    return get


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_equals_one_process(layout, reference, launched):
    variants = LAYOUTS[layout][2]
    out, codes, outs = launched(layout)
    assert codes == [0] * 4, "\n".join(outs)
    runs = {v: merged(out, v) for v in variants.split(",")}
    assert reference[0][0] != reference[1][0]  # FP8 training does train otherwise
    for v, (losses, state) in runs.items():
        ref_losses, ref_state = reference["fp8" in v]
        assert set(state) == set(ref_state), f"{v}: tensors missing or extra: {set(ref_state) ^ set(state)}"
        # FP8: the first step as tight; after it, weights that differ in the 7th digit (sums in another order) can
        # round to neighbouring FP8 values, and activations too: a step's grad norm moves by ~2e-4 of itself
        for i, ((loss, gnorm), (ref_loss, ref_gnorm)) in enumerate(zip(losses, ref_losses)):
            rel = 1e-5 if i == 0 or "fp8" not in v else 1e-3
            assert abs(loss - ref_loss) <= 1e-5 and abs(gnorm - ref_gnorm) <= rel * ref_gnorm, (v, losses, ref_losses)
        diffs = torch.cat([(state[k] - ref_state[k]).abs().flatten() for k in ref_state])
        # FP8 on 4 DP ranks (a gradient sum in another order): 7e-4 of the weights, whose step moved with such a
        # flip; a wrong layout moves most of them
        off = (diffs > PARAM_TOL).float().mean().item()
        assert off <= (1e-2 if "fp8" in v else 0), f"{layout} {v}: {off:.1e} of the parameters differ from one " \
            f"process by more than {PARAM_TOL}, up to {diffs.max():.2e}"
    # 1F1B and all-forward-all-backward, recompute and offload: the same numbers within rounding
    base = runs["4:1f1b"][1]
    for v, (_, state) in runs.items():
        if v.startswith("4:") and "fp8" not in v:
            assert max((state[k] - base[k]).abs().max().item() for k in base) <= 1e-6, v


@pytest.mark.slow
@pytest.mark.parametrize("ep", [2, 4])
def test_ep_dispatch_combine_equals_unsharded_moe(ep, launched):
    _, codes, outs = launched(f"dp4-ep{ep}")
    assert codes == [0] * 4 and all("EP MoE equals the per-token reference" in o for o in outs), "\n".join(outs)


@pytest.mark.slow
@pytest.mark.parametrize("fault,expect", [("wrong_shape", "expected shape"), ("die", "failed on rank")])
def test_fault_fails_fast_with_a_named_op(fault, expect, tmp_path):
    """A rank that sends a wrong shape, or dies mid-step: every rank exits non-zero well within the
    timeout (no hang), and the survivors say which group and operation failed."""
    codes, outs, seconds = launch(tmp_path, 2, 2, "1:1f1b", env={"FAULT": fault, "DIST_TIMEOUT": "20"}, timeout=120)
    assert all(c != 0 for c in codes), (codes, outs)
    assert seconds < 60, f"took {seconds:.0f}s"
    text = "\n".join(outs)
    assert expect in text, text
    assert "pipeline" in text or "EP all_to_all_single on ranks" in text or "all_reduce(" in text, text


def test_bad_layout_is_a_clear_error():
    with pytest.raises(ValueError, match="tensor parallel"):
        parallel.init_distributed(tp_size=2)
    with pytest.raises(ValueError, match="pp_layers"):
        parallel.stage_layers(8, 4, [2, 2, 2, 1])
    assert parallel.stage_layers(43, 4) == [list(range(0, 11)), list(range(11, 22)), list(range(22, 33)),
                                            list(range(33, 43))]


def test_memory_plan_shards_the_experts_and_counts_every_parameter_once():
    """memory_plan.plan_table (train_grpo's dry run) on the meta device: a row a stage with its layers; the stages'
    parameters add up to the model's, each routed expert on one of ep ranks; each row's totals add up."""
    args = replace(ModelArgs(), hidden_size=1024, moe_intermediate_size=1024, n_routed_experts=64)  # 1.9B: whole GBs
    with torch.device("meta"):
        named = list(Transformer(args, dtype=torch.bfloat16).named_parameters())
    experts = sum(p.numel() for n, p in named if ".experts." in n)
    dense = sum(p.numel() for _, p in named) - experts
    for ep in (1, 4):
        rows = [line.split("|")[1:-1] for line in plan_table(args, 2, ep, 8, 8, 2048, False, 4).splitlines()
                if re.match(r"\| \d", line)]
        stages = parallel.stage_layers(args.num_hidden_layers, 2)
        assert [r[1].strip() for r in rows] == [f"{s[0]}-{s[-1]}" for s in stages]
        params = sum(float(r[2].strip().rstrip("B")) for r in rows)  # rounded to 0.01B a row
        assert params == pytest.approx((dense + experts / ep) / 1e9, abs=0.01 * len(rows)), (ep, rows)
        for r in rows:  # rounded to 0.1 GB a column
            weights, grads, optim, act, loss, step, total, offloaded = (float(c) for c in r[3:])
            assert (loss > 0) == (r is rows[-1])  # the head and the loss: the last stage's
            # fp32 gradients and AdamW's temporaries for a chunk of 2**28 parameters (optimizer.AdamW.step)
            assert step == pytest.approx(min(optim * 8 / 12, 8 * 2 ** 28 / 1e9), abs=0.1)
            assert total == pytest.approx(weights + optim + grads + act + loss + step, abs=0.3), r
            assert offloaded == pytest.approx(weights + grads + act + loss, abs=0.3), r
