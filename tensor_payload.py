"""
The payload of SGLang's /update_weights_from_tensor (../shared/docs/sglang_api.md §2.1): each entry of
serialized_named_tensors is base64 of a pickle of [(name, tensor), ...]. weight_sync.py writes it, server.py reads it.

  CUDA tensors  torch.multiprocessing's ForkingPickler: CUDA IPC handles (rebuild_cuda_tensor). Only a process on this
                machine that sees the sender's GPU under the same index can open them, and only while the sender keeps
                the tensors alive. SGLang's own clients send this.
  CPU tensors   plain pickle: the bytes travel inside (torch.storage._load_from_bytes of a legacy torch.save), so it
                works between any two processes. ForkingPickler would pass a file descriptor instead
                (rebuild_storage_fd), which only the sender's own process tree may open: SGLang's scheduler dies on
                one, the embedded server answers 400.

Reading never runs pickle.loads: Unpickler.find_class resolves only the globals those two forms name, and maps
torch.storage._load_from_bytes (a torch.load with weights_only=False: arbitrary code) to load_storage
(weights_only=True). Any other global is refused by name, before anything in the pickle has run.
"""
import base64
import collections
import io
import pickle
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing.reductions as mp_reductions  # registers ForkingPickler's tensor reducers


def load_storage(data):
    """torch.storage._load_from_bytes with weights_only=True: a storage, or an error."""
    try:
        storage = torch.load(io.BytesIO(data), weights_only=True)
    except AttributeError as e:  # "UntypedStorage has no attribute dtype": a case torch's weights_only reader lacks
        raise pickle.UnpicklingError(f"{e}: plain pickle of a float8 / e8m0 CPU tensor (an untyped storage) cannot "
                                     f"be read with weights_only=True; pickle its storage as uint8 (BytesPickler)")
    if not isinstance(storage, torch.storage.TypedStorage):
        raise pickle.UnpicklingError(f"_load_from_bytes gave a {type(storage).__name__}, not a storage")
    return storage


# CPU tensors (plain pickle; v3 for dtypes without a storage type, float8 say), then CUDA IPC (ForkingPickler)
ALLOWED = {("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
           ("torch._utils", "_rebuild_tensor_v3"): torch._utils._rebuild_tensor_v3,
           ("torch.storage", "_load_from_bytes"): load_storage,
           ("collections", "OrderedDict"): collections.OrderedDict,  # the (empty) backward hooks
           ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"): mp_reductions.rebuild_cuda_tensor,
           ("torch", "Tensor"): torch.Tensor, ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
           ("torch", "Size"): torch.Size, ("torch.storage", "TypedStorage"): torch.storage.TypedStorage,
           ("torch.storage", "UntypedStorage"): torch.storage.UntypedStorage}


class Unpickler(pickle.Unpickler):
    """pickle.Unpickler that resolves only ALLOWED globals and torch dtypes (torch.bfloat16, ...)."""

    def find_class(self, module, name):
        if (module, name) in ALLOWED:
            return ALLOWED[module, name]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == "torch.multiprocessing.reductions":  # the first global of a ForkingPickler'd CPU tensor
            raise pickle.UnpicklingError(
                f"refused global {module}.{name}: torch.multiprocessing's ForkingPickler passes CPU tensors as file "
                f"descriptors (rebuild_storage_fd), which only the sender's own process tree can open; pickle CPU "
                f"tensors with plain pickle.dumps (the bytes travel), or send CUDA tensors")
        raise pickle.UnpicklingError(f"refused global {module}.{name}: the payload may name only the torch "
                                     f"functions and types that pickled tensors need")


def read(entry):
    """One base64 entry -> {name: tensor} (CUDA IPC tensors still the sender's memory). ValueError on anything else."""
    try:
        items = Unpickler(io.BytesIO(base64.b64decode(entry, validate=True))).load()
    except Exception as e:  # a refused global, bad base64, a malformed pickle, a handle that does not open
        raise ValueError(f"cannot read serialized_named_tensors: {type(e).__name__}: {e}") from None
    if not (isinstance(items, list) and all(isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str)
                                            and isinstance(x[1], torch.Tensor) for x in items)):
        raise ValueError("serialized_named_tensors must unpickle to a list of (name, tensor) pairs")
    named = {n: t.detach() for n, t in items}
    if len(named) != len(items):
        raise ValueError("serialized_named_tensors names a tensor twice")
    return named


class BytesPickler(pickle.Pickler):
    """Plain pickle with one change: an untyped storage (float8 and e8m0 tensors have one) pickles as a uint8
    TypedStorage, as torch.load(weights_only=True) cannot read an untyped one. It names the same globals: plain
    pickle, SGLang and load_storage all read it."""

    def reducer_override(self, obj):
        if type(obj) is torch.UntypedStorage:
            return torch.storage.TypedStorage(wrap_storage=obj, dtype=torch.uint8, _internal=True).__reduce__()
        return NotImplemented


def dumps(named):
    """{name: tensor}, all on CUDA or all on the CPU -> one base64 entry. CUDA: the receiver maps this memory, so
    keep the tensors alive (and unchanged) until it has answered."""
    items, cuda = list(named.items()), {t.is_cuda for t in named.values()}
    assert len(cuda) <= 1, "one payload holds CUDA or CPU tensors, not both"
    if cuda == {True}:
        data = ForkingPickler.dumps(items)
    else:
        buf = io.BytesIO()
        BytesPickler(buf).dump(items)
        data = buf.getbuffer()
    return base64.b64encode(data).decode()
