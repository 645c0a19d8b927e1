"""SGLang's /update_weights_from_tensor on the embedded server: the session rule, hostile pickles refused before
anything in them runs, SGLang's documented CPU client."""
import base64
import copy
import io
import os
import pickle
from multiprocessing.reduction import ForkingPickler

import pytest
import torch

import server
from model_dsv4 import Transformer
from rollout import RolloutClient
from test_weight_sync import ARGS

pytestmark = pytest.mark.usefixtures("one_torch_thread")


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
    status, out = call(srv, "/update_weights_from_tensor", {"serialized_named_tensors": [ok],
                                                             "load_format": "flattened_bucket"})
    assert status == 400 and "flattened_bucket" in out["error"]["message"]
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
