"""
The payload of SGLang's /update_weights_from_tensor, written by weight_sync.py,
read by server_weights.py: each entry of serialized_named_tensors is base64 of a pickle of [(name, tensor), ...].

  CUDA tensors  torch.multiprocessing's ForkingPickler: CUDA IPC handles (rebuild_cuda_tensor), which only a process
                on this machine that sees the sender's GPU under the same index can open, while the sender keeps the
                tensors alive. SGLang's own clients send this.
  CPU tensors   plain pickle: the bytes travel inside (torch.storage._load_from_bytes of a legacy torch.save), between
                any two processes. ForkingPickler would pass a file descriptor (rebuild_storage_fd), which only the
                sender's own process tree may open: SGLang's scheduler dies on one, the embedded server answers 400.

load_format "flattened_bucket" (SGLang's weight_sync/tensor_bucket.py; the form its RL clients send): a dict of one
uint8 tensor holding every tensor's bytes back to back and a list of SGLang's FlattenedTensorMetadata (name, shape,
dtype, start_idx, end_idx, numel; the last three in bytes), which cut it up again:
flat[start_idx:end_idx].view(dtype).reshape(shape). One CUDA IPC handle per bucket instead of one per tensor.
flatten() puts larger elements first, as a view's start must be a multiple of its element size; the distributed
transport lays its flattened buckets out the same way (layout()).

Reading never runs pickle.loads: Unpickler.find_class resolves only the globals these forms name, and maps
torch.storage._load_from_bytes (a torch.load with weights_only=False: arbitrary code) to load_storage
(weights_only=True). Any other global is refused by name, before anything in the pickle has run.
"""
import base64
import collections
import copyreg
import dataclasses
import io
import math
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


SGLANG_ENTRY = ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata")


@dataclasses.dataclass
class BucketEntry:
    """SGLang's FlattenedTensorMetadata: where one tensor's bytes sit in a flattened bucket. Pickled under SGLang's
    class name (dumps_flat), so SGLang reads it as its own; our reader maps that name back to this class."""
    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int

    def __reduce__(self):  # (not dataclasses.astuple: it deep-copies each field)
        return BucketEntry, (self.name, self.shape, self.dtype, self.start_idx, self.end_idx, self.numel)


def layout(metas):
    """[(name, shape, dtype)] in bucket order -> [BucketEntry], back to back from byte 0."""
    out, at = [], 0
    for name, shape, dtype in metas:
        n = math.prod(shape) * dtype.itemsize
        out.append(BucketEntry(name, torch.Size(shape), dtype, at, at + n, n))
        at += n
    return out


def flatten(named, buf=None):
    """{name: contiguous tensor} -> (one uint8 tensor of all their bytes, [BucketEntry]). Larger elements first
    (fp32, then bf16, then fp8 and e8m0): every start is then a multiple of its element size. buf: a uint8 tensor
    to fill from its start, if big enough (a fresh one costs page faults: on the CPU several times the copy itself)."""
    order = sorted(named, key=lambda k: -named[k].element_size())  # stable: the caller's order within a size
    entries = layout([(k, named[k].shape, named[k].dtype) for k in order])
    if not entries:
        return torch.empty(0, dtype=torch.uint8), []
    n = entries[-1].end_idx
    out = buf[:n] if buf is not None and len(buf) >= n else None
    return torch.cat([named[k].reshape(-1).view(torch.uint8) for k in order], out=out), entries


def unflatten(flat, entries):
    """The bucket's tensors as views of flat (on CUDA IPC: the sender's memory). ValueError naming the first entry
    that does not fit: outside the bucket, a size that is not its shape's, a start not aligned for its dtype."""
    if not (isinstance(flat, torch.Tensor) and flat.dtype == torch.uint8 and flat.dim() == 1):
        raise ValueError(f"flattened_tensor must be a 1-D uint8 tensor, got {getattr(flat, 'dtype', type(flat))}")
    named = {}
    for e in entries:
        if not (isinstance(e, BucketEntry) and isinstance(e.name, str) and isinstance(e.dtype, torch.dtype)
                and isinstance(e.shape, (tuple, list)) and all(type(x) is int and x >= 0 for x in e.shape)
                and all(type(x) is int for x in (e.start_idx, e.end_idx, e.numel))):
            raise ValueError(f"metadata entries must be FlattenedTensorMetadata(name: str, shape, dtype, start_idx, "
                             f"end_idx, numel: int), got {e!r:.200}")
        n = math.prod(e.shape) * e.dtype.itemsize
        if not (0 <= e.start_idx and e.end_idx - e.start_idx == e.numel == n and e.end_idx <= len(flat)):
            raise ValueError(f"{e.name}: bytes [{e.start_idx}, {e.end_idx}) (numel {e.numel}) is not {n} bytes "
                             f"of {tuple(e.shape)} {e.dtype} inside the bucket's {len(flat)}")
        if e.start_idx % e.dtype.itemsize:
            raise ValueError(f"{e.name}: starts at byte {e.start_idx}, not a multiple of {e.dtype}'s "
                             f"{e.dtype.itemsize} bytes (put larger elements first)")
        if e.name in named:
            raise ValueError(f"the bucket names {e.name} twice")
        named[e.name] = flat[e.start_idx:e.end_idx].view(e.dtype).reshape(e.shape)
    return named


# CPU tensors (plain pickle; v3 for dtypes without a storage type, float8 say), then CUDA IPC (ForkingPickler)
ALLOWED = {("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
           ("torch._utils", "_rebuild_tensor_v3"): torch._utils._rebuild_tensor_v3,
           ("torch.storage", "_load_from_bytes"): load_storage,
           ("collections", "OrderedDict"): collections.OrderedDict,  # the (empty) backward hooks
           ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"): mp_reductions.rebuild_cuda_tensor,
           ("torch", "Tensor"): torch.Tensor, ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
           ("torch", "Size"): torch.Size, ("torch.storage", "TypedStorage"): torch.storage.TypedStorage,
           ("torch.storage", "UntypedStorage"): torch.storage.UntypedStorage,
           SGLANG_ENTRY: BucketEntry}


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


def read(entry, flattened=False):
    """One base64 entry -> {name: tensor} (CUDA IPC tensors still the sender's memory). ValueError on anything else.
    flattened: load_format "flattened_bucket", a dict {"flattened_tensor", "metadata"}."""
    try:
        items = Unpickler(io.BytesIO(base64.b64decode(entry, validate=True))).load()
    except Exception as e:  # a refused global, bad base64, a malformed pickle, a handle that does not open
        raise ValueError(f"cannot read serialized_named_tensors: {type(e).__name__}: {e}") from None
    if flattened:
        if not (isinstance(items, dict) and set(items) == {"flattened_tensor", "metadata"}
                and isinstance(items["metadata"], list)):
            raise ValueError("a flattened_bucket payload must unpickle to {'flattened_tensor': uint8 tensor, "
                             "'metadata': [FlattenedTensorMetadata]}")
        return unflatten(items["flattened_tensor"], items["metadata"])
    if not (isinstance(items, list) and all(isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str)
                                            and isinstance(x[1], torch.Tensor) for x in items)):
        raise ValueError("serialized_named_tensors must unpickle to a list of (name, tensor) pairs")
    named = {n: t.detach() for n, t in items}
    if len(named) != len(items):
        raise ValueError("serialized_named_tensors names a tensor twice")
    return named


class BytesPickler(pickle.Pickler):
    """Plain pickle (the C pickler) with one change: an untyped storage (float8 and e8m0 tensors have one) pickles as
    a uint8 TypedStorage, as torch.load(weights_only=True) cannot read an untyped one. It names the same globals:
    plain pickle, SGLang and load_storage all read it. cuda: CUDA tensors as ForkingPickler reduces them."""

    def __init__(self, file, protocol=None, cuda=False):
        super().__init__(file, protocol)
        self.dispatch_table = {**copyreg.dispatch_table, **(ForkingPickler._extra_reducers if cuda else {})}

    def reducer_override(self, obj):
        if type(obj) is torch.UntypedStorage:
            return torch.storage.TypedStorage(wrap_storage=obj, dtype=torch.uint8, _internal=True).__reduce__()
        return NotImplemented


# A flattened bucket's pickle names BucketEntry, which dumps_flat renames to SGLang's class in protocol 3's GLOBAL
# opcode (plain text): the C pickler would import sglang to name SGLang's class, and sglang need not be installed
# here. (The pure-Python pickler, which could name it, is 12x slower: enough to dominate the trainer's side.)
OUR_ENTRY = f"c{BucketEntry.__module__}\n{BucketEntry.__qualname__}\n".encode()
SGLANG_GLOBAL = ("c%s\n%s\n" % SGLANG_ENTRY).encode()


def dumps_flat(flat, entries):
    """A flattened bucket (flatten()'s two parts) -> one base64 entry, for load_format "flattened_bucket". CUDA:
    the receiver maps flat's memory, so keep flat alive (and unchanged) until it has answered. The metadata is
    pickled first, so the first GLOBAL of BucketEntry comes before any tensor byte and is the one to rename."""
    BytesPickler(buf := io.BytesIO(), 3, flat.is_cuda).dump({"metadata": entries, "flattened_tensor": flat})
    return base64.b64encode(buf.getvalue().replace(OUR_ENTRY, SGLANG_GLOBAL, 1)).decode()


def dumps(named):
    """{name: tensor}, all on CUDA or all on the CPU -> one base64 entry. CUDA: the receiver maps this memory, so
    keep the tensors alive (and unchanged) until it has answered."""
    cuda = {t.is_cuda for t in named.values()}
    assert len(cuda) <= 1, "one payload holds CUDA or CPU tensors, not both"
    BytesPickler(buf := io.BytesIO(), cuda=cuda == {True}).dump(list(named.items()))
    return base64.b64encode(buf.getbuffer()).decode()
