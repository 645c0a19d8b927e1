"""
Weight sync from the trainer to the rollout servers, SGLang or the embedded one (the same HTTP protocol,
SGLang 0.5.23's update sessions). The disk transport writes checkpoint.save_weights's shards.

Names: trainer parameter names *are* the official checkpoint names (model_dsv4.py): the name table is the identity.
quant.py's table adds which tensors travel quantized for rollout_quant = fp8 | fp8_fp4 (the official e4m3 / e2m1
weight plus its e8m0 `.scale`, made on the sending rank). Buffers (tid2eid, the router bias) always travel.

Transports (config key weight_sync):
  disk         each tensor's one writer saves it (dense: DP rank 0 of its stage; routed experts: the first EP
               group), then POST /update_weights_from_disk on every server.
  distributed  one weight-update group per PP stage, its sender (the stage's DP rank 0) is rank 0 and server i
               holds the ranks after servers 0..i-1 (1 + their tp sizes). On every server: pause (retract) ->
               flush -> begin -> per bucket POST /update_weights_from_distributed + broadcast -> end (quantized
               servers rebuild their compute weights) -> continue. Stages send one after the other; a stage's EP
               ranks hand their experts to its sender a bucket at a time (at most bucket_mb more on any rank).
  tensor       for servers on the trainer's machine (on CUDA: its GPU). The session of `distributed`, but each bucket
               is one POST /update_weights_from_tensor (tensor_payload.py): CUDA IPC handles of the sender's tensors,
               which stay alive until every server has answered (it has copied them by then), or on the CPU the
               bytes. The same senders, stage order and EP hand-over as `distributed`; no group.

Flattened buckets (flatten=True, the default; SGLang's load_format "flattened_bucket"): a bucket travels as one uint8
tensor of its tensors' bytes, larger elements first (tensor_payload.flatten), with their names, dtypes and shapes:
one broadcast, or one CUDA IPC handle, per bucket instead of one per tensor, for a copy of the bucket on the sender.
flatten=False sends tensor by tensor (load_format null), for servers that lack the flattened form.

Failure: a server that dies or times out raises SyncError on every trainer rank, naming it. The trainer's weights
are only read. The servers a sync did not complete on, and those that were down, go into client.stale (no rollouts)
until a later sync reaches them in full; every sync goes to every server that is up.
"""
import functools
import ipaddress
import os
import socket
import time
import uuid
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

import tensor_payload
from checkpoint import save_weights
from parallel import init_weight_update_group, named
from quant import as_bytes, e8m0_to_float, quantize_tensor, quantized_meta
from rollout import background

GROUP = {}  # this rank's live weight-update groups: "urls", "names" (one per stage), "pg" (stage senders only)


class SyncError(RuntimeError):
    """A sync that did not complete; .urls: the servers it failed on."""
    def __init__(self, message, urls):
        super().__init__(message)
        self.urls = urls


# -----------------------------------------------------------------------------
# helpers: calls to a set of servers (client.each), agreement across the trainer's ranks

def post(client, urls, path, body, timeout):
    """POST on every url at once (body: one dict, or {url: dict}) -> client.each's {url: Future of (answer, error)}.
    Every POST of a sync goes through here (tests/fault_run.py kills a server from here, mid-sync)."""
    if all(u in body for u in urls):
        return client.each(path, urls=urls, timeout=timeout, bodies=body)
    return client.each(path, body, urls=urls, timeout=timeout)


def errors(calls, wait=None):
    """{url: Future of (answer, error)} -> {url: error} of the calls that failed, or did not answer within `wait`
    seconds."""
    deadline, out = time.time() + (wait or 0), {}
    for url, fut in calls.items():
        try:
            out[url] = fut.result(None if wait is None else max(0.0, deadline - time.time()))[1]
        except TimeoutError:
            out[url] = f"no answer {wait} s after the failure (blocked on the broken group)"
    return {u: e for u, e in out.items() if e}


def failed(errs, what):
    """{url: error} -> the error that agree() passes around, (message, urls), or None."""
    if not errs:
        return None
    return what + "".join(f"\n  {u}: {e}" for u, e in errs.items()), [u for u in errs if "://" in u]


def agree(grid, err, src=None):
    """Every rank's error (None if fine) -> the first one, on every rank; or rank src's value to all. All ranks
    go on or stop together: none waits in a collective that the others left."""
    if grid.world_size == 1:
        return err
    with named("weight sync: agree", dist.group.WORLD):
        if src is not None:
            box = [err]
            dist.broadcast_object_list(box, src=src)
            return box[0]
        box = [None] * grid.world_size
        dist.all_gather_object(box, err)
    return next((e for e in box if e), None)


def tp_sizes(grid, client, urls):
    """Ranks per server, SGLang's tp_size from /server_info (1 where it does not say), as rank 0 asked them."""
    tps = None
    if grid.rank == 0:
        answers = [fut.result() for fut in client.each("/server_info", method="GET", urls=urls, timeout=30).values()]
        tps = [out.get("tp_size", 1) if err is None and isinstance(out, dict) else 1 for out, err in answers]
    return agree(grid, tps, src=0)


# -----------------------------------------------------------------------------
# the distributed transport (its session and stage senders serve the tensor transport too)

def make_groups(grid, client, urls, token, timeout):
    """One group per PP stage, made stage after stage: a server (SGLang's scheduler) joins one group at a time,
    so servers taking the stages' groups in different orders would wait on each other for ever."""
    teardown(grid, client, GROUP.get("urls", ()))
    tps, names = tp_sizes(grid, client, urls), [f"nano-pp{p}-{token}" for p in range(grid.pp_size)]
    for p, name in enumerate(names):
        err = None
        if grid.pp_rank == p and grid.dp_rank == 0:  # the sender of stage p
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # our address, as the servers reach us
                s.connect((urlsplit(urls[0]).hostname, 80))
                addr = s.getsockname()[0]
            with socket.socket() as s:
                s.bind(("", 0))
                port = s.getsockname()[1]
            backend = "nccl" if grid.device.type == "cuda" else "gloo"
            bodies = {u: {"master_address": addr, "master_port": port, "rank_offset": 1 + sum(tps[:i]),
                          "world_size": 1 + sum(tps), "group_name": name, "backend": backend}
                      for i, u in enumerate(urls)}
            joined = post(client, urls, "/init_weights_update_group", bodies, timeout)
            pg = background(init_weight_update_group, addr, port, 0, 1 + sum(tps), name, backend, timeout)
            err = failed(errors(joined), f"init_weights_update_group {name} failed on:")
            GROUP["pg"] = pg.result() if err is None else None  # else left to time out in its thread
        err = agree(grid, err)
        if err:
            raise SyncError(*err)
    GROUP.update(urls=tuple(urls), names=names)


def teardown(grid, client, urls=None, timeout=30):
    """Forget the groups: ours at once; rank 0 asks the servers in urls (by default the groups' own) to drop theirs
    (best effort)."""
    urls = GROUP.get("urls", ()) if urls is None else urls
    if GROUP.get("pg") is not None:
        dist.destroy_process_group(GROUP["pg"])
    if grid.rank == 0:
        for name in GROUP.get("names", []):
            errors(post(client, urls, "/destroy_weights_update_group", {"group_name": name}, timeout))
    GROUP.clear()


def stage_buckets(sd, grid, quant, limit):
    """This stage's tensors (its state_dict sd) in send order, as (name, owner EP rank, shape, dtype): the sender's
    own (dense and its experts), then each other EP rank's experts; cut into buckets of at most `limit` bytes on the
    wire (quantized), a bigger tensor alone. Every rank of the stage's first EP group gets the same buckets."""
    mine = [(k, grid.ep_rank, tuple(v.shape), v.dtype) for k, v in sd.items()
            if grid.ep_rank == 0 or ".experts." in k]
    lists = [mine] if grid.ep_size == 1 else [None] * grid.ep_size
    if grid.ep_size > 1:
        with named("all_gather_object(expert names)", grid.ep_group):
            dist.all_gather_object(lists, mine, group=grid.ep_group)
    out, size = [[]], 0
    for e in [e for entries in lists for e in entries]:
        n = sum(torch.Size(s).numel() * d.itemsize for _, s, d in quantized_meta(e[0], e[2], e[3], quant))
        if out[-1] and size + n > limit:
            out, size = out + [[]], 0
        out[-1].append(e)
        size += n
    return out


def send_stage(model, grid, quant, limit, push, stats, samples):
    """The stage's buckets: the EP ranks hand their experts to the sender, which quantizes them and pushes each
    bucket to the servers (push(tensors, what) -> error or None: the transport). After an error the sender still
    takes part in the gathers (the other EP ranks are mid-loop) but sends nothing more. -> error or None."""
    sd, err, is_sender = model.state_dict(), None, grid.ep_rank == 0
    ep_ranks = dist.get_process_group_ranks(grid.ep_group) if grid.ep_size > 1 else [grid.rank]
    buckets = stage_buckets(sd, grid, quant, limit)  # one state_dict() a sync: it walks every module
    for i, bucket in enumerate(buckets):
        tensors, what = {}, f"bucket {i + 1}/{len(buckets)} of stage {grid.pp_rank} failed on:"
        for k, owner, shape, dtype in bucket:
            if owner == grid.ep_rank and not is_sender:
                with named(f"weight sync: send {k} to the stage's sender", grid.ep_group):
                    dist.send(sd[k].detach().contiguous(), dst=ep_ranks[0])
            elif is_sender:
                tensors[k] = sd[k].detach() if owner == 0 else torch.empty(shape, dtype=dtype, device=grid.device)
                if owner != 0:
                    with named(f"weight sync: recv {k} from EP rank {owner}", grid.ep_group):
                        dist.recv(tensors[k], src=ep_ranks[owner])
        if not is_sender or err:
            continue
        sent = {n: q.contiguous() for k, t in tensors.items() for n, q in quantize_tensor(k, t, quant).items()}
        del tensors
        err = push(sent, what)
        if err:
            continue
        nbytes = sum(v.nbytes for v in sent.values())
        stats.update(names=stats["names"] + list(sent), bytes=stats["bytes"] + nbytes, buckets=stats["buckets"] + 1,
                     max_bucket_bytes=max(stats["max_bucket_bytes"], nbytes))
        if samples is not None:  # for verify: the first rows, as sent (a copy per tensor: only when asked)
            samples.update({n: v[:2].clone() for n, v in sent.items()})
    return err


def packer():
    """tensor_payload.flatten into one buffer kept from bucket to bucket (each bucket is sent and answered before
    the next is packed), so that a sync allocates it once."""
    held = []
    def pack(sent):
        n = sum(v.nbytes for v in sent.values())
        if sent and (not held or len(held[0]) < n):
            held[:] = [torch.empty(n, dtype=torch.uint8, device=next(iter(sent.values())).device)]
        return tensor_payload.flatten(sent, held[0] if held else None)
    return pack


def broadcast(client, urls, name, version, timeout, flat):
    """The distributed transport's push: the bucket's names, dtypes and shapes POSTed to every server, then the
    tensors broadcast in that order, or (flat) the bucket's bytes in one broadcast."""
    pack = packer()

    def push(sent, what):
        names = list(sent)  # the order the tensors go in
        tensors = [sent[k] for k in names]
        if flat:  # one tensor of the bucket's bytes, larger elements first
            buf, entries = pack(sent)
            names = [e.name for e in entries]
            tensors = [buf]
        path = "/update_weights_from_distributed"
        answers = post(client, urls, path, {
            "names": names, "dtypes": [str(sent[k].dtype)[6:] for k in names], "group_name": name,
            "shapes": [list(sent[k].shape) for k in names], "load_format": "flattened_bucket" if flat else None,
            "flush_cache": False, "weight_version": version}, timeout)
        try:
            for v in tensors:
                dist.broadcast(as_bytes(v), src=0, group=GROUP["pg"])  # float8 travels as bytes (gloo has none)
        except Exception as e:  # a dead peer: the servers still up wait on us for ever; do not wait for them
            return failed({**errors(answers, wait=2), "broadcast": f"{type(e).__name__}: {e}"}, f"{path} {what}")
        return failed(errors(answers), f"{path} {what}")
    return push


def session(grid, client, urls, timeout, send):
    """The session of the module docstring: pause, flush, begin; send() -> error or None on each stage's sender,
    stage after stage (every server receives in the same order); then end and continue wherever still up, whatever
    happened. Collective. -> the first error, on every rank."""
    err = None
    for path, body in [("/pause_generation", {"mode": "retract"}), ("/flush_cache", {}), ("/begin_weight_update", {})]:
        if grid.rank == 0 and err is None:
            err = failed(errors(post(client, urls, path, body, timeout)), f"{path} failed on:")
    err = agree(grid, err)
    for p in range(grid.pp_size):
        if err is None and grid.pp_rank == p and grid.edp_rank == 0:
            err = send()
        err = agree(grid, err)
    if grid.rank == 0:  # close the session (quantized servers rebuild here) and resume
        ended = failed(errors(post(client, urls, "/end_weight_update", {}, timeout)), "/end_weight_update failed on:")
        errors(post(client, urls, "/continue_generation", {}, timeout))
        err = err or ended
    return agree(grid, err)


# -----------------------------------------------------------------------------
# the tensor transport

def on_this_machine(url):
    """Whether url's host is this machine: a loopback address, or one of this host's own."""
    try:
        addr = socket.gethostbyname(urlsplit(url).hostname)
        return ipaddress.ip_address(addr).is_loopback or addr in socket.gethostbyname_ex(socket.gethostname())[2]
    except (OSError, ValueError):
        return False


def colocated(grid, client, urls, version, timeout, flat):
    """The tensor transport's push. Collective. CUDA IPC handles open only on this machine: a far server is a config
    error (SGLang's scheduler would die on the handles)."""
    if grid.device.type == "cuda":
        far = agree(grid, [u for u in urls if not on_this_machine(u)] if grid.dp_rank == 0 else None)
        if far:
            raise ValueError(f"weight_sync='tensor' sends CUDA IPC handles, which only a server on the sender's "
                             f"machine can open: {far} are not on it (use weight_sync='distributed')")
    tps, pack = tp_sizes(grid, client, urls), packer()

    def push(sent, what):  # one payload for every TP rank of a server, as SGLang's client sends it
        buf = pack(sent) if flat else None  # buf[0], the memory a CUDA handle maps, lives on
        entry = tensor_payload.dumps_flat(*buf) if flat else tensor_payload.dumps(sent)  # until every server answered
        bodies = {u: {"serialized_named_tensors": [entry] * tp, "load_format": "flattened_bucket" if flat else None,
                      "flush_cache": False, "weight_version": version} for u, tp in zip(urls, tps)}
        path = "/update_weights_from_tensor"
        return failed(errors(post(client, urls, path, bodies, timeout)), f"{path} {what}")
    return push


def check_samples(client, urls, samples, timeout):
    """/get_weights_by_name on every server against the first rows we sent: equal, or equal after the bf16 cast
    of a server that serves bf16. -> {url: error} naming the first tensor that differs."""
    bad = {}
    for name, want in samples.items():
        want = (e8m0_to_float(want) if want.dtype == torch.float8_e8m0fnu else want.float()).cpu()
        body = {"name": name, "truncate_size": 2}
        asked = [u for u in urls if u not in bad]  # a server's first difference is enough
        for url, fut in client.each("/get_weights_by_name", body, urls=asked, timeout=timeout).items():
            got, err = fut.result()
            if err is not None:
                bad[url] = f"verify: {name}: {err}"
                continue
            got = torch.tensor(got)
            if not (torch.equal(got, want) or torch.equal(got, want.bfloat16().float())):
                bad[url] = f"verify: {name} differs from what the trainer sent"
    return bad


# -----------------------------------------------------------------------------

def sync(model, grid, client, args, path, mode="disk", version="1", quant="none", bucket_mb=512, verify=False,
         timeout=600, flatten=True):
    """Push the trainer's weights to every rollout server that is up; they stamp `version` on what they generate.
    Collective over the trainer's world. -> this rank's stats (names and bytes it sent, buckets, seconds). Raises
    SyncError on every rank, naming the servers that failed (they join client.stale; see the module docstring)."""
    if mode not in ("disk", "distributed", "tensor"):
        raise ValueError(f"weight_sync '{mode}' is not available (have: disk, distributed, tensor)")
    t0 = time.time()
    samples = None  # verify: the first rows of every tensor sent
    if verify:
        samples = {}
    stats = {"mode": mode, "flatten": flatten, "names": [], "bytes": 0, "buckets": 0, "max_bucket_bytes": 0}
    up = None
    if grid.rank == 0:
        up = [u for u, ok in client.health().items() if ok]
    up, token = agree(grid, (up, uuid.uuid4().hex[:8]), src=0)  # rank 0's
    client.stale.update(u for u in client.urls if u not in up)
    try:
        if not up:
            raise SyncError(f"no rollout server is up: {client.urls}", list(client.urls))
        err, limit = None, int(bucket_mb * (1 << 20))
        if mode == "disk":
            samples, stats["bytes"] = save_weights(model, grid, path, args, quant)
            stats["names"] = list(samples)
            if grid.rank == 0:
                body = {"model_path": os.path.abspath(path), "weight_version": version}
                err = failed(errors(post(client, up, "/update_weights_from_disk", body, timeout)),
                             "update_weights_from_disk failed on:")
        else:
            if mode == "distributed" and GROUP.get("urls") != tuple(up):  # the first sync, or other servers
                make_groups(grid, client, up, token, timeout)
            if mode == "distributed":  # into this stage's group
                push = broadcast(client, up, GROUP["names"][grid.pp_rank], version, timeout, flatten)
            else:
                push = colocated(grid, client, up, version, timeout, flatten)  # collective: before the session
            send = functools.partial(send_stage, model, grid, quant, limit, push, stats, samples)
            err = session(grid, client, up, timeout, send)
            if err and mode == "distributed":  # the groups may be broken: drop them (the next sync makes new ones)
                teardown(grid, client, up, min(timeout, 30))
        err = agree(grid, err)  # every server has the weights now (or the sync failed), so verify may look
        if verify and not err:
            err = agree(grid, failed(check_samples(client, up, samples, timeout), "verify failed on:"))
        if err:
            raise SyncError(*err)
    except SyncError as e:
        client.stale.update(up)  # none of them holds a complete new model: no rollouts until a sync completes there
        down = [u for u, ok in client.health(timeout=5).items() if not ok]
        raise SyncError(f"weight sync ({mode}, version {version}) failed: {e}\n  down now: {down}",
                        e.urls or list(up)) from None
    client.stale.difference_update(up)
    stats["seconds"] = time.time() - t0
    return stats
