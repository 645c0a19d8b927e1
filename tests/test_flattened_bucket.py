"""SGLang's flattened-bucket form of /update_weights_from_tensor (load_format "flattened_bucket", sglang_api.md
§2.1) both ways: our pickle read with SGLang's class as SGLang reads it, a bucket built as SGLang builds it loaded
by the embedded server, and malformed buckets refused with the weights as they were. The rest of the tensor
transport: test_tensor_sync.py."""
import base64
import dataclasses
import io
import pickle
import sys
import types

import pytest
import torch

import tensor_payload
from test_tensor_sync import ARGS, b64, call, served, srv  # noqa: F401 (srv, a fixture)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@dataclasses.dataclass
class FlattenedTensorMetadata:
    """SGLang's class (python/sglang/srt/weight_sync/tensor_bucket.py, sglang_api.md §2.1), its fields as there."""
    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


@pytest.fixture
def sglang_module(monkeypatch):
    """The class above as sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata, so pickle names it as SGLang's
    own clients' pickles do."""
    path = "sglang.srt.weight_sync.tensor_bucket".split(".")
    for i in range(len(path)):
        monkeypatch.setitem(sys.modules, ".".join(path[:i + 1]), types.ModuleType(".".join(path[:i + 1])))
    monkeypatch.setattr(FlattenedTensorMetadata, "__module__", ".".join(path))
    sys.modules[".".join(path)].FlattenedTensorMetadata = FlattenedTensorMetadata
    return FlattenedTensorMetadata


def test_flattened_bucket_as_sglang_reads_and_writes_it(srv, sglang_module):
    """Ours -> SGLang: tensor_payload's pickle, read as SGLang reads it (its class for the metadata, then
    flat[start_idx:end_idx].view(dtype).reshape(shape)), gives every tensor back. SGLang -> ours: a bucket built as
    SGLang's FlattenedTensorBucket builds it (each tensor's bytes in the caller's order), pickled with its class,
    loads into the embedded server."""
    named = {"norm.weight": torch.randn(ARGS.hidden_size), "embed.weight": torch.randn(4, 3).bfloat16(),
             "w.fp8": torch.randn(5).to(torch.float8_e4m3fn), "w.scale": torch.ones(3).to(torch.float8_e8m0fnu)}

    class SGLangReader(pickle.Unpickler):  # names SGLang's class: only the flattened form's pickle does that
        def find_class(self, module, name):
            return sglang_module if (module, name) == tensor_payload.SGLANG_ENTRY else super().find_class(module, name)
    got = SGLangReader(io.BytesIO(base64.b64decode(tensor_payload.dumps_flat(*tensor_payload.flatten(named))))).load()
    assert set(got) == {"flattened_tensor", "metadata"} and got["flattened_tensor"].dtype == torch.uint8
    assert all(type(m) is sglang_module for m in got["metadata"])
    for m in got["metadata"]:
        t = got["flattened_tensor"][m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape)
        assert m.numel == t.nbytes and torch.equal(t.view(torch.uint8), named[m.name].view(torch.uint8)), m.name

    sent, metas, at = {"norm.weight": torch.randn(ARGS.hidden_size), "embed.weight": torch.randn(
        ARGS.vocab_size, ARGS.hidden_size)}, [], 0
    for name, t in sent.items():
        metas.append(sglang_module(name, t.shape, t.dtype, at, at + t.nbytes, t.nbytes))
        at += t.nbytes
    flat = torch.cat([t.flatten().view(torch.uint8) for t in sent.values()])
    entry = b64(pickle.dumps({"flattened_tensor": flat, "metadata": metas}))
    for path, body in [("/begin_weight_update", {}), ("/update_weights_from_tensor", {
            "serialized_named_tensors": [entry], "load_format": "flattened_bucket", "weight_version": "flat"}),
            ("/end_weight_update", {})]:
        status, out = call(srv, path, body)
        assert status == 200 and out["success"] is True, (path, out)
    for name, t in sent.items():
        assert torch.equal(served(srv, name), t.double()), name


def test_malformed_flattened_buckets_refused(srv):
    """Each answer names what is wrong, and the weights stay as they were."""
    name, E = "norm.weight", tensor_payload.BucketEntry
    before, n = served(srv, name), ARGS.hidden_size * 4
    flat, f32 = torch.zeros(n + 8, dtype=torch.uint8), torch.float32

    def bucket(*entries, t=flat):
        return tensor_payload.dumps_flat(t, list(entries))
    bad = {  # what the answer must name -> the payload
        f"is not {n} bytes": bucket(E(name, torch.Size([ARGS.hidden_size]), f32, 0, 64, 64)),
        "inside the bucket's": bucket(E(name, torch.Size([ARGS.hidden_size]), f32, 16, 16 + n, n)),
        "not a multiple of": bucket(E(name, torch.Size([ARGS.hidden_size]), f32, 2, 2 + n, n)),
        "names norm.weight twice": bucket(*[E(name, torch.Size([ARGS.hidden_size]), f32, 0, n, n)] * 2),
        "1-D uint8 tensor": bucket(E(name, torch.Size([ARGS.hidden_size]), f32, 0, n, n), t=flat.float()),
        "FlattenedTensorMetadata(name": bucket((name, (ARGS.hidden_size,), f32, 0, n, n)),
        "must unpickle to {'flattened_tensor'": b64(pickle.dumps([(name, torch.ones(ARGS.hidden_size))])),
    }
    assert call(srv, "/begin_weight_update", {})[0] == 200
    for what, entry in bad.items():
        status, out = call(srv, "/update_weights_from_tensor", {"serialized_named_tensors": [entry],
                                                                 "load_format": "flattened_bucket"})
        assert status == 400 and out["success"] is False and what in out["message"], (what, out)
    assert call(srv, "/end_weight_update", {})[0] == 200
    assert torch.equal(served(srv, name), before)
