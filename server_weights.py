"""
The embedded server's weight updates (server.py routes these endpoints here): update sessions, updates from disk,
from a process group (/update_weights_from_distributed) and from colocated tensors (/update_weights_from_tensor),
and the state of quantized serving. The protocol is SGLang 0.5.23's; the trainer's
side is weight_sync.py. The request checks (BadRequest, check, fail, is_int) live here too: server.py uses them.

Every update names its tensors by the checkpoint's official names and is checked whole, names and shapes, before
anything is copied: a failed update leaves the old weights in place. Weights and version change together while the
engine is paused.

Quantized serving (--quant fp8 | fp8_fp4, quant.py's table): the server holds the official quantized tensors
(e4m3 128x128 blocks or packed e2m1 per-32, with e8m0 `.scale`s) exactly as they arrive, and computes with
weights dequantised from them: the derived state, rebuilt by /end_weight_update (at once after a disk update).
Senders must quantize (a full-precision tensor sent for a quantized weight is refused, not cast); a
full-precision checkpoint is quantized once at startup (server.start), as SGLang's online --quantization fp8 does.

/update_weights_from_tensor (colocated senders): entry 0 of serialized_named_tensors (we are TP rank 0 of 1; SGLang's
clients repeat one payload per TP rank), load_format null, "direct" or "flattened_bucket"; CUDA IPC handles or, for
CPU tensors, plain pickle, read by tensor_payload.py's allow-list unpickler, never pickle.loads.
/update_weights_from_distributed: load_format null (one broadcast per tensor) or "flattened_bucket" (one broadcast of
the bucket's bytes, laid out in the order of `names`, tensor_payload.layout).
"""
import time

import torch
import torch.distributed as dist

from checkpoint import canonical_name, checkpoint_index, load_state_dict
from parallel import init_weight_update_group
from quant import as_bytes, dequantize, e8m0_to_float, quant_format, quantized_meta, scale_name
from tensor_payload import layout, read as read_payload, unflatten


class BadRequest(Exception):
    """An error answer: HTTP `status` with SGLang's body, {"error": {"message": ...}} unless given one."""
    def __init__(self, message, status=400, payload=None):
        super().__init__(message)
        self.status, self.payload = status, payload


def check(ok, message):
    if not ok:
        raise BadRequest(message)


def fail(message):  # the weight-update endpoints answer failures as {"success": false, "message": ...}
    raise BadRequest(message, payload={"success": False, "message": message})


def group_name(body):
    name = body.get("group_name", "weight_update_group")
    check(isinstance(name, str), f"group_name must be a string, got {name!r}")
    return name


def is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


class Weights:
    """The served weights and how they change: what an update may name, the quantized state as sent, the update
    session and the weight-update process groups. One method per weight endpoint: (JSON body, handler) ->
    JSON-able answer. `admin` is the server's lock for pauses and updates (one at a time)."""

    def __init__(self, model, engine, admin, quant="none"):
        self.model, self.engine, self.admin = model, engine, admin
        # quantized serving: {name: (shape, dtype)} of every quantized weight and scale; qstate holds them as
        # sent; `dirty` names arrived since the compute weights were last rebuilt from them
        self.quant, self.qstate, self.dirty = quant, {}, set()
        self.qformats = {n: (s, d) for k, v in model.state_dict().items() if quant_format(k, quant)
                         for n, s, d in quantized_meta(k, tuple(v.shape), v.dtype, quant)}
        # what an update may name: (shape, dtype or None for any), kept: state_dict() walks every module, too slow
        # to redo for each bucket of a sync
        self.expected = {k: (tuple(v.shape), None) for k, v in model.state_dict().items() if k not in self.qformats}
        self.expected.update(self.qformats)  # quantized: the exact format (a full-precision tensor there is refused)
        self.session, self.groups = False, {}

    # ------------------------------------------------------------------ sessions, checks and the swap
    def begin_weight_update(self, body, handler):
        with self.admin:
            if self.session:
                fail("a weight update session is already open: call end_weight_update() first")
            self.session = True
        return {"success": True, "message": "weight update session opened"}

    def end_weight_update(self, body, handler):
        with self.admin:
            if not self.session:
                fail("no weight update session is open: call begin_weight_update() first")
            self.session = False
            n = self.rebuild()
        return {"success": True, "message": f"weight update session closed; {n} quantized weights rebuilt"}

    def rebuild(self):
        """The derived state of quantized serving: compute weights = dequantize(weight, scale) for every pair
        that changed. Both halves of a pair must have arrived: a new weight with an old scale is a wrong model."""
        weights = {k if k.endswith(".weight") else k[:-len("scale")] + "weight" for k in self.dirty}
        torn = sorted(w for w in weights if not {w, scale_name(w)} <= self.dirty)
        self.dirty = set()
        if torn:
            fail(f"quantized weights updated without their scale, or scales without their weight: {torn[:8]}")
        self.engine.load_weights({w: dequantize(self.qstate[w], self.qstate[scale_name(w)]) for w in weights})
        return len(weights)

    def checked(self, named, every):
        """named by official name, checked whole before anything is copied (a failed update leaves the old weights).
        `every`: a whole checkpoint must cover the model."""
        expected, named = self.expected, {canonical_name(k): v for k, v in named.items()}
        unknown = sorted(k for k in named if k not in expected)
        missing = sorted(set(expected) - set(named)) if every else []
        shapes = [f"{k}: {tuple(v.shape)} {str(v.dtype)[6:]} vs served {expected[k][0]} "
                  f"{str(expected[k][1])[6:] if expected[k][1] else 'any dtype'}" for k, v in named.items()
                  if k in expected and (tuple(v.shape) != expected[k][0] or expected[k][1] not in (None, v.dtype))]
        if unknown or missing or shapes:
            hint = f"this server serves {self.quant}: send quant.py's format; " if self.quant != "none" else ""
            raise ValueError(hint + f"unknown names {unknown[:8]}, missing {missing[:8]}, mis-shaped {shapes[:8]}")
        return named

    def load(self, named, version, flush, rebuild=False):
        """Swap weights and version together: the loop is held (paused) so no request finishes in between
        with new weights under the old version. engine.load_weights casts to the model's dtypes. Quantized
        tensors are kept as sent; their compute weights follow at rebuild (now, or at end_weight_update)."""
        check(version is None or isinstance(version, str), "weight_version must be a string")
        with self.admin:
            was_paused = self.engine.paused
            self.engine.pause()
            try:
                self.engine.load_weights({k: v for k, v in named.items() if k not in self.qformats})
                # copies of our own: a tensor sent by CUDA IPC is the sender's memory
                self.qstate.update({k: v.to(self.engine.device, copy=True) for k, v in named.items()
                                    if k in self.qformats})
                self.dirty.update(k for k in named if k in self.qformats)
                if rebuild:
                    self.rebuild()
                if version is not None:
                    self.engine.weight_version = version
            finally:
                if not was_paused:
                    self.engine.resume()
        if flush and not self.engine.flush():  # as SGLang: the update went in, the call still fails
            fail("Weights were updated, but the cache was not flushed: requests are running or queued "
                 "(pause first, or pass flush_cache=false)")

    def update_weights_from_disk(self, body, handler):
        path = body.get("model_path")
        check(isinstance(path, str) and path, "model_path (a checkpoint directory) is required")
        try:
            named = read_checkpoint(path, self.qformats)
        except Exception as e:  # no such directory, an unreadable file
            fail(f"failed to load {path}: {type(e).__name__}: {e}; the old weights are still in place")
        self.update_from(f"failed to load {path}", named, body, every=True, rebuild=True)  # no session: rebuild now
        return {"success": True, "message": f"loaded {len(named)} tensors from {path}", "num_paused_requests": 0}

    def update_weight_version(self, body, handler):
        version = body.get("new_version")
        check(isinstance(version, str) and version, "new_version (a string) is required")
        if body.get("abort_all_requests", True):  # SGLang's default
            self.engine.abort_all()
        self.load({}, version, flush=False)
        return {"success": True, "message": f"weight version is now {version}", "new_version": version}

    def get_weights_by_name(self, body, handler):
        name, n = body.get("name"), body.get("truncate_size", 100)
        check(isinstance(name, str) and is_int(n) and n >= 0, "name (a string) and truncate_size (an int >= 0)")
        name = canonical_name(name)
        t = self.qstate[name] if name in self.qstate else self.model.state_dict().get(name)  # quantized: as stored
        check(t is not None, f"no parameter named {name!r}")
        # as SGLang's tolist()[:n]: n elements of a 1-D tensor, n rows of a 2-D one
        return (e8m0_to_float(t[:n]) if t.dtype == torch.float8_e8m0fnu else t[:n].float()).tolist()

    # ------------------------------------------------------------------ distributed weight sync (§2.2)
    def init_weights_update_group(self, body, handler):
        name, backend = group_name(body), body.get("backend", "nccl")
        addr, port, offset, world = map(body.get, ("master_address", "master_port", "rank_offset", "world_size"))
        check(isinstance(addr, str) and all(map(is_int, (port, offset, world))) and 0 < offset < world,
              "master_address, master_port, rank_offset (>= 1: the trainer is rank 0) and world_size are required")
        check(backend in ("gloo", "nccl"), f"backend must be gloo or nccl, got {backend!r}")
        check(backend == "gloo" or self.engine.device.type == "cuda", "backend nccl needs the model on CUDA: use gloo")
        with self.admin:
            check(name not in self.groups, f"group {name!r} exists: destroy it first")
            self.groups[name] = None  # reserved while we wait for the trainer
        try:  # blocks until every rank has joined
            self.groups[name] = (init_weight_update_group(addr, port, offset, world, name, backend), backend)
        except Exception as e:
            self.groups.pop(name, None)
            fail(f"init_weights_update_group failed: {type(e).__name__}: {e}")
        return {"success": True, "message": f"joined group {name!r} as rank {offset} of {world}"}

    def need_session(self, what):  # as SGLang 0.5.23: tensor and distributed updates only inside a session
        if not self.session:
            fail(f"{what} must run between begin_weight_update() and end_weight_update()")

    def update_from(self, what, named, body, every=False, rebuild=False):
        """The end of an update: names checked (on a failure the old weights stay), abort if asked, load."""
        try:
            named = self.checked(named, every)
        except ValueError as e:  # a checkpoint of another shape, an unknown name, a full-precision quantized weight
            fail(f"{what}: {e}; the old weights are still in place")
        if body.get("abort_all_requests", False):
            self.engine.abort_all()
        self.load(named, body.get("weight_version"), body.get("flush_cache", True), rebuild)
        return {"success": True, "message": f"updated {len(named)} tensors"}

    def update_weights_from_distributed(self, body, handler):
        self.need_session("update_weights_from_distributed")
        name = group_name(body)
        check(self.groups.get(name) is not None, f"no weight update group {name!r}: call init_weights_update_group")
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        check(all(isinstance(x, list) for x in (names, dtypes, shapes)) and len(names) == len(dtypes) == len(shapes),
              "names, dtypes and shapes must be lists of the same length")
        fmt = body.get("load_format")
        check(fmt in (None, "flattened_bucket"), f"load_format must be null or 'flattened_bucket', got {fmt!r}")
        dtypes = [getattr(torch, d, None) if isinstance(d, str) else None for d in dtypes]
        check(all(isinstance(d, torch.dtype) for d in dtypes), "dtypes must be torch dtype names such as 'bfloat16'")
        check(all(isinstance(s, list) and all(is_int(x) and x >= 0 for x in s) for s in shapes),
              "shapes must be lists of non-negative ints")
        group, backend = self.groups[name]
        device = "cpu" if backend == "gloo" else self.engine.device
        entries = layout(list(zip(names, shapes, dtypes))) if fmt else None
        try:  # the trainer broadcasts in this same order: each tensor, or the bucket's bytes in one
            if fmt is None:
                bufs = [torch.empty(shape, dtype=dt, device=device) for shape, dt in zip(shapes, dtypes)]
            else:
                bufs = [torch.empty(entries[-1].end_idx if entries else 0, dtype=torch.uint8, device=device)]
            for buf in bufs:
                dist.broadcast(as_bytes(buf), src=0, group=group)  # float8 travels as bytes (gloo has none)
        except Exception as e:  # a peer died or timed out: the group is unusable; the trainer makes a new one
            with self.admin:
                self.groups.pop(name, None)
            fail(f"broadcast in group {name!r} failed: {type(e).__name__}: {e}")
        try:
            received = unflatten(bufs[0], entries) if fmt else dict(zip(names, bufs))
        except ValueError as e:
            fail(f"update_weights_from_distributed: {e}; the old weights are still in place")
        # checked only now: the broadcasts had to be received either way, or the trainer would hang
        return self.update_from("update_weights_from_distributed", received, body)

    # ------------------------------------------------------------------ colocated weight sync (§2.1)
    def update_weights_from_tensor(self, body, handler):
        """CUDA IPC tensors are the sender's memory, which it reuses once we answer: load copies them into our
        parameters (and qstate), and we wait for those copies before answering."""
        self.need_session("update_weights_from_tensor")
        entries, fmt = body.get("serialized_named_tensors"), body.get("load_format")
        check(isinstance(entries, list) and entries and all(isinstance(e, str) for e in entries),
              "serialized_named_tensors must be a non-empty list of base64 strings (one per TP rank)")
        check(fmt in (None, "direct", "flattened_bucket"), f"load_format must be null, 'direct' or 'flattened_bucket', "
              f"got {fmt!r}: custom loaders are not implemented")
        t0 = time.perf_counter()
        try:
            named = read_payload(entries[0], flattened=fmt == "flattened_bucket")  # TP rank 0's: the only rank we have
        except ValueError as e:
            fail(f"update_weights_from_tensor: {e}")
        t_read = time.perf_counter() - t0
        try:
            out = self.update_from("update_weights_from_tensor", named, body)
        finally:
            if self.engine.device.type == "cuda":
                torch.cuda.synchronize(self.engine.device)
        out["message"] += f" (payload opened in {t_read * 1e3:.1f} ms, loaded in " \
                          f"{(time.perf_counter() - t0 - t_read) * 1e3:.1f} ms)"
        return out

    def destroy_weights_update_group(self, body, handler):
        name = group_name(body)
        with self.admin:
            entry = self.groups.get(name)
            check(entry is not None, f"no weight update group {name!r}")
            del self.groups[name]
        dist.destroy_process_group(entry[0])
        return {"success": True, "message": f"destroyed group {name!r}"}


def read_raw(path, names):
    """The tensors of a checkpoint named in `names`, as stored (no dequantisation)."""
    from safetensors import safe_open
    index, out = checkpoint_index(path), {}
    for file in {index[k][0] for k in names if k in index}:
        with safe_open(file, framework="pt") as f:
            out.update({k: f.get_tensor(index[k][1]) for k in names if index.get(k, ("",))[0] == file})
    return out


def read_checkpoint(path, qformats):
    """A checkpoint's tensors by official name: those served quantized as stored (weight and .scale), the rest
    as checkpoint.load_state_dict gives them (FP8 / FP4 dequantised: this server does not serve them so)."""
    index = checkpoint_index(path)
    plain = [k for k in index if k not in qformats and not (k.endswith(".scale") and k[:-5] + "weight" in index)]
    return {**load_state_dict(path, plain), **read_raw(path, qformats)}
