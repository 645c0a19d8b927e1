"""kernel_check.py: kernels='auto' runs each fast path against its reference on the device and keeps those that run and
agree; a path that raises or disagrees falls back to the reference, alone, and the start line says so. 'fast' takes
every path, 'reference' none, and Transformer.set_kernels by name reaches exactly one path's module flags. On the CPU
the check takes the torch paths (attention, experts; mhc and gemm_f32 in bf16); the Triton ones need a GPU, where
the same check runs them (tests/test_fast_paths*.py and friends hold each kernel to its reference)."""
import copy
import json

import pytest
import torch

import kernel_check
import model_dsv4
import moe
from dsv4_kernels import fast
from model_dsv4 import KERNEL_PATHS, Attention, Block, ModelArgs, Transformer
from moe import MoE

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # a few hundred small ops a run: one thread, not two waiting

# every layer kind (window, CSA with its indexer, HCA), hash and learned routing, at the smallest widths
MINI = ModelArgs(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_nextn_predict_layers=0, num_attention_heads=2,
                 head_dim=16, qk_rope_head_dim=8, q_lora_rank=16, o_groups=1, o_lora_rank=16, sliding_window=4,
                 compress_ratios=[0, 4, 8], index_n_heads=2, index_head_dim=16, index_topk=2, n_routed_experts=4,
                 num_experts_per_tok=2, moe_intermediate_size=16, num_hash_layers=1, hc_mult=2, hc_sinkhorn_iters=3)
FLAGS = {"attention": (Attention, "fast"), "decode_attention": (Attention, "fast_decode"), "mhc": (Block, "fast"),
         "experts": (MoE, "fast"), "routing": (MoE, "fast_routing"), "sampling": (Transformer, "fast_sampling")}


def flags(model):
    """{path: the set of its flag's values over the modules that hold it}."""
    return {p: {getattr(m, f) for m in model.modules() if isinstance(m, kind)} for p, (kind, f) in FLAGS.items()}


def broken_attention(calls):
    def f(*a, **kw):
        calls.append("attention")
        raise RuntimeError("HIP error: invalid device function\nmore lines")
    return f


def rows_off_by_one(real, calls):
    """grouped_experts with its output rows one place off (a wrong offset): what a broken grouped GEMM gives."""
    def f(*a, **kw):
        calls.append("experts")
        out = real(*a, **kw)
        return (out[0].roll(1, 0), out[1]) if isinstance(out, tuple) else out.roll(1, 0)
    return f


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_auto_falls_back_for_the_failing_and_the_disagreeing_path_only(dtype, monkeypatch):
    """'auto' on a GPU (here: the check run on the CPU, the GPU's name faked): window attention raises, the grouped
    experts put their rows one place off. Those two are off, with the error's first line and the tensor that
    disagrees in the one start line; every other path is on. The model set from the verdict has exactly those flags
    off and runs the reference there: its forward and backward never call the broken functions."""
    calls = []
    monkeypatch.setattr(model_dsv4, "window_attention", broken_attention(calls))
    monkeypatch.setattr(moe, "grouped_experts", rows_off_by_one(moe.grouped_experts, calls))
    real_check, lines = kernel_check.check, []
    monkeypatch.setattr(kernel_check, "check", lambda args, device, dt: real_check(args, "cpu", dt))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake MI355X")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    on = kernel_check.choose("auto", MINI, "cuda", dtype, lines.append, cache=None)
    assert on == tuple(p for p in KERNEL_PATHS if p not in ("attention", "experts"))
    assert len(lines) == 1
    line = lines[0]
    assert line.startswith("kernels auto: checked on Fake MI355X") and f"on {', '.join(on)};" in line, line
    assert "attention (RuntimeError: HIP error: invalid device function)" in line and "more lines" not in line, line
    assert "experts (" in line and "of its largest value" in line, line
    assert {"attention", "experts"} <= set(calls)
    calls.clear()

    model = kernel_check.randomize_(Transformer(copy.deepcopy(MINI), dtype=dtype)).set_kernels(on)
    got = flags(model)
    assert got["attention"] == {False} and got["experts"] == {False}, got
    assert all(v == {True} for p, v in got.items() if p not in ("attention", "experts")), got
    ids = torch.randint(0, MINI.vocab_size, (2, 19), generator=torch.Generator().manual_seed(1))
    model(ids).sum().backward()
    assert calls == []


def test_a_kernel_that_breaks_the_device_stops_the_check_by_name(monkeypatch):
    """A fault that leaves the device unusable (CUDA's sticky errors) stops the run, naming the path and the way
    past it, rather than carrying on with a device that runs nothing."""
    monkeypatch.setattr(model_dsv4, "window_attention", broken_attention([]))
    monkeypatch.setattr(kernel_check, "alive", lambda device: False)
    with pytest.raises(RuntimeError, match="fast path attention left cpu unusable.*kernels='reference'"):
        kernel_check.check(MINI, "cpu", torch.float32)


def test_fast_reference_named_lists_and_the_cpu(monkeypatch):
    """'fast' takes every path and 'reference' none, unchecked, each saying so; a list takes the paths it names and a
    wrong name is a ValueError that lists the right ones; 'auto' on the CPU is the reference without a check."""
    monkeypatch.setattr(kernel_check, "check", lambda *a: pytest.fail("checked where nothing is to be checked"))
    lines = []
    assert kernel_check.choose("fast", MINI, "cpu", torch.float32, lines.append) == KERNEL_PATHS
    assert kernel_check.choose("reference", MINI, "cpu", torch.float32, lines.append) == ()
    assert kernel_check.choose("attention,mhc", MINI, "cpu", torch.float32, lines.append) == ("attention", "mhc")
    assert kernel_check.choose("auto", MINI, "cpu", torch.float32, lines.append) == ()
    assert lines[0] == f"kernels fast: every fast path, unchecked: {', '.join(KERNEL_PATHS)}"
    assert lines[1] == "kernels reference: the plain reference everywhere"
    assert lines[2] == "kernels attention,mhc: the paths named"
    assert lines[3].startswith("kernels auto: the reference on the CPU")
    for bad in ("attention,mha", "", ","):
        with pytest.raises(ValueError, match="decode_attention"):
            kernel_check.choose(bad, MINI, "cpu", torch.float32)


def test_auto_verdict_is_cached_per_gpu_torch_dtype_and_source(monkeypatch, tmp_path):
    """The check runs once for a GPU model, torch version, dtype, model widths and kernel source; later starts read its
    verdict from the cache file. Another GPU or dtype checks again; so does a file that is not JSON."""
    checks, lines = [], []
    monkeypatch.setattr(kernel_check, "check", lambda args, device, dt: checks.append(dt) or {
        p: ("off for the test" if p == "mhc" else None) for p in KERNEL_PATHS})
    monkeypatch.setattr(kernel_check, "device_name", lambda device: gpu)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    cache, gpu = str(tmp_path / "c" / "kernel_check.json"), "Fake H100"
    want = tuple(p for p in KERNEL_PATHS if p != "mhc")
    for _ in range(3):
        assert kernel_check.choose("auto", MINI, "cuda", torch.bfloat16, lines.append, cache) == want
    assert checks == [torch.bfloat16] and "cached in" in lines[-1] and "cached" not in lines[0], lines
    assert kernel_check.choose("auto", MINI, "cuda", torch.float32, lines.append, cache) == want
    gpu = "Fake MI355X"
    kernel_check.choose("auto", MINI, "cuda", torch.bfloat16, lines.append, cache)
    assert checks == [torch.bfloat16, torch.float32, torch.bfloat16]
    open(cache, "w").write("{not json")
    kernel_check.choose("auto", MINI, "cuda", torch.bfloat16, lines.append, cache)
    assert len(checks) == 4 and len(json.load(open(cache))) == 1


def test_set_kernels_by_name_reaches_one_path():
    """Each name turns on its own flag on every module that holds it and nothing else; True and False are all and
    none and leave the process-wide GEMM switch alone, while names set it; an unknown name is a ValueError."""
    model = Transformer(copy.deepcopy(MINI), dtype=torch.float32)
    for path in KERNEL_PATHS:
        got = flags(model.set_kernels((path,)))
        assert all(v == {p == path} for p, v in got.items()), (path, got)
        assert fast.GEMM_F32 == (path == "gemm_f32")
    assert all(v == {True} for v in flags(model.set_kernels(True)).values()) and not fast.GEMM_F32
    fast.use_gemm_f32(True)
    assert all(v == {False} for v in flags(model.set_kernels(False)).values()) and fast.GEMM_F32
    with pytest.raises(ValueError, match="unknown kernel path.*'routng'"):
        model.set_kernels(["routng"])


def test_disagreement_holds_each_tensor_to_the_fp32_reference():
    """Within tol of the largest value, or within twice the reference's own miss, agrees; more does not, and names
    the tensor; NaN never agrees; picks must be equal; a tensor the reference leaves at zero must stay zero."""
    g = {"x": torch.tensor([10.0, -4.0]), "z": torch.zeros(3)}
    ref = {"x": torch.tensor([10.2, -4.0]), "z": torch.zeros(3), "picks p": torch.tensor([3, 1])}
    ok = {"x": torch.tensor([9.65, -4.0]), "z": torch.zeros(3), "picks p": torch.tensor([3, 1])}
    assert kernel_check.disagreement(ok, ref, g, 0.0) is None  # 0.35 off: within 2 x 0.2
    assert kernel_check.disagreement(ok | {"x": torch.tensor([10.0, -3.55])}, ref, g, 0.01) is None  # 0.4 + 0.1
    miss = kernel_check.disagreement(ok | {"x": torch.tensor([10.0, -3.4])}, ref, g, 0.01)
    assert miss == "x off by 6.0e-02 of its largest value, the reference by 2.0e-02, tolerance 0.01", miss
    assert kernel_check.disagreement(ok | {"x": torch.tensor([float("nan"), -4.0])}, ref, g, 0.1).startswith("x")
    assert kernel_check.disagreement(ok | {"z": torch.tensor([0.0, 1e-20, 0.0])}, ref, g, 0.1).startswith("z")
    assert kernel_check.disagreement(ok | {"picks p": torch.tensor([1, 3])}, ref, g, 0.1) == "p differ"
