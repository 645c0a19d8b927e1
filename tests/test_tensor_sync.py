"""The tensor transport (weight_sync.py 'tensor', SGLang's /update_weights_from_tensor): the same weights and logprobs
as disk, tensor by tensor and flattened, FP8 serving, the session rule and hostile pickles refused before anything in
them runs or loads, SGLang's documented CPU client; on a GPU, CUDA IPC into a server on the same GPU. (SGLang's
flattened-bucket form: test_flattened_bucket.py; PP2 x EP2 senders: test_weight_sync.py.)"""
import base64
import copy
import io
import os
import pickle
from multiprocessing.reduction import ForkingPickler

import pytest
import torch

import server
import weight_sync as wsync
from conftest import start_servers, stop
from model_dsv4 import Transformer
from quant import e8m0_to_float, quant_format, quantize_tensor
from rollout import RolloutClient
from test_weight_sync import ARGS, GRID, PROMPTS, ckpt, logprob_diff, spec_dequant, trained  # noqa: F401 (ckpt)

pytestmark = pytest.mark.usefixtures("one_torch_thread")
GREEDY = {"temperature": 0, "max_new_tokens": 6}


@pytest.fixture(scope="module")
def servers(ckpt):
    servers = start_servers(ckpt, n=2)
    yield [u for _, u in servers]
    stop(servers)


@pytest.fixture(scope="module")
def srv():
    """In process: the payload checks need no subprocess."""
    s = server.start(Transformer(copy.deepcopy(ARGS), dtype=torch.float32), port=0, device="cpu", max_len=48)
    yield s.url
    s.close()


def call(url, path, body):
    return RolloutClient(url)._http(url, "POST", path, body)


def served(url, name):
    """A whole tensor as the server holds it (quantized: as sent; e8m0 scales as their values), in float64."""
    return torch.tensor(RolloutClient(url).get_weights_by_name(name, truncate_size=1 << 30)[url], dtype=torch.double)


def as_sent(t):
    return (e8m0_to_float(t) if t.dtype == torch.float8_e8m0fnu else t.float()).double().cpu()


@pytest.mark.slow
def test_tensor_equals_disk(servers, tmp_path):
    """Server A synced through disk, server B through flattened tensor buckets: bit-equal weights and greedy
    logprobs. (Tensor by tensor: test_fp8_serving_via_tensor.)"""
    (a, b), model = servers, trained(step_seed=6)
    wsync.sync(model, GRID, RolloutClient(a), ARGS, tmp_path / "w", mode="disk", version="v")
    stats = wsync.sync(model, GRID, RolloutClient(b), ARGS, tmp_path / "unused", mode="tensor", version="v",
                       bucket_mb=0.25, verify=True)
    sd = model.state_dict()  # every tensor sent, each once, in buckets of at most 256 kB
    assert sorted(stats["names"]) == sorted(sd) and stats["bytes"] == sum(v.nbytes for v in sd.values())
    assert stats["buckets"] > 2 and stats["max_bucket_bytes"] <= 1 << 18
    for name, want in sd.items():
        assert torch.equal(served(a, name), as_sent(want)) and torch.equal(served(b, name), as_sent(want)), name
    for p in PROMPTS:  # one at a time: the same batch shapes on both servers, so the same rounding
        (sa,), = RolloutClient(a).generate([p], 1, GREEDY, 0)
        (sb,), = RolloutClient(b).generate([p], 1, GREEDY, 0)
        assert (sa["output_ids"], sa["logprobs"]) == (sb["output_ids"], sb["logprobs"])
    assert logprob_diff(b, model, "v") <= 1e-5


@pytest.mark.slow
def test_fp8_serving_via_tensor(ckpt, tmp_path):
    """The official FP8 format through tensor buckets sent tensor by tensor (float8 CPU tensors:
    tensor_payload.BytesPickler; flattened fp8 buckets: test_weight_sync.py's quantized serving); a full-precision
    tensor for a quantized weight is refused, not cast."""
    servers, model = start_servers(ckpt, quant="fp8"), trained(step_seed=7)
    url, client = servers[0][1], RolloutClient(servers[0][1])
    try:
        with pytest.raises(wsync.SyncError, match="serves fp8: send quant.py's format"):
            wsync.sync(model, GRID, client, ARGS, tmp_path, mode="tensor", quant="none", flatten=False)
        wsync.sync(model, GRID, client, ARGS, tmp_path, mode="tensor", version="t-q", quant="fp8", bucket_mb=0.25,
                   verify=True, flatten=False)
        ref = copy.deepcopy(model)  # the trainer's weights through the spec's dequantisation
        ref.load_state_dict({n: spec_dequant(*quantize_tensor(n, t, "fp8").values()) if quant_format(n, "fp8") else t
                             for n, t in ref.state_dict().items()})
        assert logprob_diff(url, ref.set_fp8_emulation(True), "t-q") <= 1e-5  # W8A8
        for n, t in model.state_dict().items():  # what the server stores is quant.py's output, whole
            for name, q in quantize_tensor(n, t, "fp8").items() if quant_format(n, "fp8") else ():
                assert torch.equal(served(url, name), as_sent(q)), name
    finally:
        stop(servers)


class Runs:
    """A pickle that calls fn(*args) when unpickled."""
    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def saved(obj):
    torch.save(obj, buf := io.BytesIO())
    return buf.getvalue()


def b64(data):
    return base64.b64encode(data).decode()


def test_session_rule_and_hostile_payloads_refused(srv, tmp_path):
    name, ran = "norm.weight", tmp_path / "ran"
    before = served(srv, name)
    ok = b64(pickle.dumps([(name, torch.ones(ARGS.hidden_size))]))
    status, out = call(srv, "/update_weights_from_tensor", {"serialized_named_tensors": [ok]})
    assert (status, out) == (400, {"success": False, "message": "update_weights_from_tensor must run between "
                                   "begin_weight_update() and end_weight_update()"})
    hostile = {  # what the answer must name -> the pickle
        "refused global posix.system": pickle.dumps([(name, Runs(os.system, f"touch {ran}"))]),
        "refused global builtins.eval": pickle.dumps([(name, Runs(eval, f"open('{ran}', 'w')"))]),
        "refused global torch.serialization.load": pickle.dumps([(name, Runs(torch.load, "/etc/hostname"))]),
        # SGLang's MultiprocessingSerializer on a CPU tensor: a file descriptor, which SGLang's scheduler dies on
        "rebuild_storage_fd": ForkingPickler.dumps([(name, torch.ones(ARGS.hidden_size))]),
        "gave a dict, not a storage": pickle.dumps([(name, Runs(torch._utils._rebuild_tensor_v2, Runs(
            torch.storage._load_from_bytes, saved({"a": 1})), 0, (1,), (1,), False, None))]),
        "list of (name, tensor) pairs": pickle.dumps({name: torch.ones(ARGS.hidden_size)}),
        "truncated": pickle.dumps([(name, torch.ones(ARGS.hidden_size))])[:-20],
    }
    assert call(srv, "/begin_weight_update", {})[0] == 200
    for what, data in hostile.items():
        status, out = call(srv, "/update_weights_from_tensor", {"serialized_named_tensors": [b64(data)]})
        assert status == 400 and out["success"] is False and what in out["message"], (what, out)
    assert call(srv, "/end_weight_update", {})[0] == 200
    assert not ran.exists() and torch.equal(served(srv, name), before)  # nothing ran, nothing loaded
    assert call(srv, "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})[0] == 200


def test_sglang_documented_cpu_client(srv):
    """sglang_api.md §2.1's minimal CPU example, as written there (HF name, bf16, one entry per TP rank)."""
    t_bf16_cpu, tp_size = torch.randn(ARGS.hidden_size).bfloat16(), 2
    payload = base64.b64encode(pickle.dumps([("model.norm.weight", t_bf16_cpu)])).decode()
    for path, body in [("/begin_weight_update", {}), ("/update_weights_from_tensor", {
            "serialized_named_tensors": [payload] * tp_size, "flush_cache": False, "weight_version": "step-1"}),
            ("/end_weight_update", {})]:
        status, out = call(srv, path, body)
        assert status == 200 and out["success"] is True, (path, out)
    assert torch.equal(served(srv, "norm.weight"), t_bf16_cpu.double())
    assert RolloutClient(srv)._http(srv, "GET", "/model_info")[1]["weight_version"] == "step-1"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC: a GPU shared by trainer and server")
@pytest.mark.parametrize("quant,flatten", [("none", True), ("fp8", True), ("none", False)])
def test_cuda_ipc_into_a_server_on_this_gpu(ckpt, quant, flatten, tmp_path):
    servers, model = start_servers(ckpt, quant=quant, device="cuda"), trained(step_seed=8).cuda()
    url = servers[0][1]
    try:
        stats = wsync.sync(model, GRID, RolloutClient(url), ARGS, tmp_path, mode="tensor", version="ipc",
                           quant=quant, bucket_mb=0.25, verify=True, flatten=flatten)
        assert stats["buckets"] > 2
        for n, t in model.state_dict().items():  # bit-equal, whole: copied from our GPU memory, then freed by us
            for name, q in quantize_tensor(n, t, quant).items():
                assert torch.equal(served(url, name), as_sent(q)), name
        (s,), = RolloutClient(url).generate(PROMPTS[:1], 1, GREEDY, 0)
        assert s["weight_version"] == "ipc"
    finally:
        stop(servers)
