"""
Hand-written parallelism on torch.distributed: one rank grid, pipeline parallel (1F1B and the all-forward-all-backward
reference), data-parallel gradient reduction, global grad-norm clipping and activation recompute. Expert parallel's
dispatch/combine live next to MoE in moe.py, the host-memory optimizer in optimizer.py. Tensor parallel is fixed at 1,
as in the seed run (TP-heavy layouts deadlocked in RCCL).

One code path for CPU/gloo and GPU/NCCL (RCCL on ROCm): a group of size 1 skips communication, and world size 1 runs
the same functions without a process group.
"""
import math
import os
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from model_dsv4 import ModelArgs, Transformer
from moe import group_size
from replay import FIELDS as REPLAYED

VERBOSE = os.environ.get("VERBOSE") == "1"  # print an arrow per p2p transfer: the tool for a pipeline hang

# -----------------------------------------------------------------------------
# the rank grid

@dataclass
class Grid:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    pp_size: int
    dp_size: int
    ep_size: int
    pp_rank: int
    dp_rank: int
    ep_rank: int
    edp_rank: int
    world_group: object = None  # None when the world is one process
    pp_group: object = None
    dp_group: object = None
    ep_group: object = None
    edp_group: object = None  # the copies of one expert shard: dp_size / ep_size ranks
    pp_prev: int = None  # global ranks of the neighbouring stages (None at the ends)
    pp_next: int = None

    @property
    def is_first_stage(self):
        return self.pp_rank == 0

    @property
    def is_last_stage(self):
        return self.pp_rank == self.pp_size - 1

    @property
    def first_stage_rank(self):
        """The global rank of this DP replica's first stage (same dp_rank, pp_rank 0): rank - pp_rank * dp."""
        return self.rank - self.pp_rank * self.dp_size

    def __str__(self):
        return (f"rank {self.rank}/{self.world_size} on {self.device}: pp {self.pp_rank}/{self.pp_size} "
                f"dp {self.dp_rank}/{self.dp_size} ep {self.ep_rank}/{self.ep_size} edp {self.edp_rank}")


def init_distributed(pp_size=1, ep_size=1, tp_size=1, timeout_s=600):
    """Pick device and backend, create every process group, return this rank's Grid. Axis order, written once:
        grid = arange(world).view(pp, dp // ep, ep):  rank = pp_rank * dp + dp_rank,  dp_rank = edp_rank * ep + ep_rank.
    Stages are outermost (one node per stage in the seed's 4 x 8 layout, so pipeline p2p crosses nodes), expert
    parallel innermost (all-to-all stays inside a node). Expert parallel is carved out of data parallel: the ranks of an
    EP group hold different experts and see different data."""
    if tp_size != 1:
        raise ValueError(f"tp_size={tp_size}: tensor parallel is not implemented; use pp_size and ep_size")
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if world % pp_size:
        raise ValueError(f"world size {world} must divide by pp_size {pp_size}")
    dp = world // pp_size
    if dp % ep_size:
        raise ValueError(f"dp = world / pp = {dp} must divide by ep_size {ep_size}")
    if torch.cuda.is_available():  # ROCm builds report cuda too, and "nccl" is RCCL there
        device, backend = torch.device("cuda", local_rank), "nccl"
        torch.cuda.set_device(device)
    else:
        device, backend = torch.device("cpu"), "gloo"
    grid = torch.arange(world).view(pp_size, dp // ep_size, ep_size)
    pp_rank, edp_rank, ep_rank = [int(i) for i in (grid == rank).nonzero()[0]]
    g = Grid(rank, world, local_rank, device, pp_size, dp, ep_size, pp_rank, edp_rank * ep_size + ep_rank,
             ep_rank, edp_rank)
    if world == 1:
        return g
    timeout = timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timeout, device_id=device if backend == "nccl" else None)
    g.world_group = dist.group.WORLD
    # Every rank creates every group, in this fixed order (new_group is collective over the world).
    mine = lambda groups: next(grp for ranks, grp in groups if rank in ranks)
    new = lambda ranks_list: [(r, dist.new_group(r, timeout=timeout)) for r in ranks_list]
    g.pp_group = mine(new([grid[:, e, k].tolist() for e in range(dp // ep_size) for k in range(ep_size)]))
    g.dp_group = mine(new([grid[p].flatten().tolist() for p in range(pp_size)]))
    g.ep_group = mine(new([grid[p, e].tolist() for p in range(pp_size) for e in range(dp // ep_size)]))
    g.edp_group = mine(new([grid[p, :, k].tolist() for p in range(pp_size) for k in range(ep_size)]))
    column = grid[:, edp_rank, ep_rank].tolist()
    g.pp_prev = column[pp_rank - 1] if pp_rank > 0 else None
    g.pp_next = column[pp_rank + 1] if pp_rank < pp_size - 1 else None
    return g


@contextmanager
def named(what, group):
    """Re-raise a failed collective (a dead peer, a timeout) naming the operation, the group's ranks and this rank.
    Every collective of the trainer runs inside one, so the survivors of a crash say where they were."""
    try:
        yield
    except RuntimeError as e:
        raise RuntimeError(f"{what} on ranks {dist.get_process_group_ranks(group)} failed on rank "
                           f"{dist.get_rank()}: {e}") from e


def all_reduce(t, group, what, op=dist.ReduceOp.SUM):
    """In-place all_reduce, named (see named); a group of one skips it."""
    if group_size(group) > 1:
        with named(f"all_reduce({what})", group):
            dist.all_reduce(t, op=op, group=group)
    return t


def broadcast_object(obj, src, group, what):
    """src's picklable obj on every rank of group (trainer ranks only: never data from the network)."""
    box = [obj]
    if group_size(group) > 1:
        with named(f"broadcast_object({what})", group):
            dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def all_gather_object(obj, group, what):
    """[every rank's picklable obj] in group-rank order (trainer ranks only); a group of one: [obj]."""
    if group_size(group) == 1:
        return [obj]
    box = [None] * group_size(group)
    with named(f"all_gather_object({what})", group):
        dist.all_gather_object(box, obj, group=group)
    return box


def barrier(group, what):
    if group_size(group) > 1:
        with named(f"barrier({what})", group):
            dist.barrier(group=group)


def init_weight_update_group(master_address, master_port, rank, world_size, group_name, backend="gloo",
                             timeout_s=600):
    """Join the weight-sync process group exactly as SGLang does (init_custom_process_group): a tcp:// rendezvous whose
    store (hosted by rank 0, the trainer) is wrapped in PrefixStore(group_name). A plain init_process_group would not
    meet SGLang, whose store keys carry that prefix. Both sides call this."""
    from torch.distributed import TCPStore
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world
    timeout = timedelta(seconds=timeout_s)
    # The store tcp:// rendezvous makes, built directly: under torchrun, rendezvous() would make rank 0 a client
    # of torchrun's own store (TORCHELASTIC_USE_AGENT_STORE), and wait for a server that never comes.
    store = TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout)
    group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), PrefixStore(group_name, store),
                                         group_name=group_name, timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}  # group rank == rank in the group
    return group

# -----------------------------------------------------------------------------
# pipeline stages: a slice of `layers`, the embedding on the first stage, hc_head/norm/head on the last

def stage_layers(n_layers, pp_size, pp_layers=None):
    """Layer indices of each stage: balanced (earlier stages take the remainder), or an explicit list of counts."""
    counts = pp_layers or [n_layers // pp_size + (i < n_layers % pp_size) for i in range(pp_size)]
    if len(counts) != pp_size or sum(counts) != n_layers:
        raise ValueError(f"pp_layers {counts} must have {pp_size} entries summing to {n_layers} layers")
    return [list(range(sum(counts[:i]), sum(counts[:i + 1]))) for i in range(pp_size)]


def build_stage(args: ModelArgs, grid: Grid, dtype=torch.float32, pp_layers=None, init=True, seed=0):
    """This rank's part of the model, built on the meta device and then materialised: its layers, its expert shard,
    and the ends its stage owns. Names stay the official ones (layers.{i}, experts.{e})."""
    with torch.device("meta"):
        model = Transformer(args, dtype=dtype, ep_group=grid.ep_group)
    keep = set(stage_layers(args.num_hidden_layers, grid.pp_size, pp_layers)[grid.pp_rank])
    for i in [k for k in model.layers if int(k) not in keep]:
        del model.layers[i]
    if not grid.is_first_stage:
        model.embed = None
    if not grid.is_last_stage:
        model.norm = model.head = model.hc_head_fn = model.hc_head_base = model.hc_head_scale = None
        model.mtp = torch.nn.ModuleList()
    model = model.to_empty(device=grid.device)
    if init:
        model.init_weights(seed)
    return model


def stage_forward(model, x, ids, recompute=False, replay=None, stats=None, seg=None):
    """x: [B, T, n, D] from the previous stage, or None on the first -> this stage's streams (the last stage's go on to
    model.head_loss). Every stage gets the token ids: hash-routed layers read them, wherever they sit. The caller enters
    model.numerics() (set_invariant's sums), so that the head and the loss are inside too. replay: the micro-batch's
    replayed ids, this stage's layers (Transformer.replay_kwargs), and stats its routers' counts. seg: its packed
    samples (grpo.make_microbatches' "seg", Attention.forward), or None."""
    model.stack_experts()
    if x is None:
        x = model.embed_streams(ids)
    rerun = lambda: (nullcontext(), model.numerics())  # a recomputed layer rounds as its forward did
    for layer, kw in zip(model.layers.values(), model.replay_kwargs(replay or {}, stats)):
        # recompute: keep only each layer's input, rerun it in backward (same routing; no RNG state: none is drawn)
        kw["seg"] = seg
        x = (checkpoint(layer, x, ids, use_reentrant=False, context_fn=rerun, preserve_rng_state=False, **kw)
             if recompute else layer(x, ids, **kw))
    return x


def replayed(mb):
    """The replay fields a micro-batch carries (grpo.make_microbatches)."""
    return {k: mb[k] for k in REPLAYED if k in mb}


# -----------------------------------------------------------------------------
# point-to-point: four verbs (and the two pairs 1F1B's steady state uses) on batch_isend_irecv, None at the pipeline's
# edges. Shapes travel first (a 4-int header): a wrong shape is an error on the receiver, not a crash in the transport.

def p2p(grid, send=None, send_to=None, recv_shape=None, recv_from=None, dtype=None, what=""):
    """Send one tensor and/or receive one, in a single batch (both directions at once cannot deadlock)."""
    def batch(out, inp):
        ops = ([dist.P2POp(dist.isend, out, send_to)] if out is not None else []) + \
              ([dist.P2POp(dist.irecv, inp, recv_from)] if inp is not None else [])
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    if VERBOSE:
        print(f"rank {grid.rank} {what}: " + (f"-> {send_to} {tuple(send.shape)} " if send is not None else "")
              + (f"<- {recv_from} {tuple(recv_shape)}" if recv_shape is not None else ""), flush=True)
    try:
        long = dict(dtype=torch.int64, device=grid.device)
        head_out = torch.tensor(send.shape, **long) if send is not None else None
        head_in = torch.empty(len(recv_shape), **long) if recv_shape is not None else None
        batch(head_out, head_in)
        if head_in is not None and tuple(head_in.tolist()) != tuple(recv_shape):
            raise ValueError(f"expected shape {tuple(recv_shape)}, peer sent {tuple(head_in.tolist())}")
        buf = torch.empty(recv_shape, dtype=dtype, device=grid.device) if recv_shape is not None else None
        batch(send.contiguous() if send is not None else None, buf)
        return buf
    except (RuntimeError, ValueError) as e:
        raise RuntimeError(f"pipeline {what} (rank {grid.rank}, pp {grid.pp_rank}/{grid.pp_size}, "
                           f"send to {send_to}, recv from {recv_from}) failed: {e}") from e


def recv_fwd(grid, shape, dtype):
    return None if grid.is_first_stage else p2p(grid, recv_shape=shape, recv_from=grid.pp_prev, dtype=dtype,
                                                what="recv_fwd").requires_grad_()


def send_fwd(grid, y):
    if not grid.is_last_stage:
        p2p(grid, send=y.detach(), send_to=grid.pp_next, what="send_fwd")


def recv_bwd(grid, shape, dtype):
    return None if grid.is_last_stage else p2p(grid, recv_shape=shape, recv_from=grid.pp_next, dtype=dtype,
                                               what="recv_bwd")


def send_bwd(grid, g):
    if not grid.is_first_stage:
        p2p(grid, send=g, send_to=grid.pp_prev, what="send_bwd")


def send_fwd_recv_bwd(grid, y, shape):
    return None if grid.is_last_stage else p2p(grid, send=y.detach(), send_to=grid.pp_next, recv_shape=shape,
                                               recv_from=grid.pp_next, dtype=y.dtype, what="send_fwd_recv_bwd")


def send_bwd_recv_fwd(grid, g, shape, dtype):
    return None if grid.is_first_stage else p2p(grid, send=g, send_to=grid.pp_prev, recv_shape=shape,
                                                recv_from=grid.pp_prev, dtype=dtype,
                                                what="send_bwd_recv_fwd").requires_grad_()


# -----------------------------------------------------------------------------
# schedules. Each stage reads the same micro-batches (token ids and whatever the loss needs), so only activations and
# their gradients travel. The loss is a function argument: the last stage computes any token loss from what its
# micro-batch carries (advantages, old logprobs, ...).

def stage_loss(model, x, mb, loss_fn, recompute=False):
    """One micro-batch through this stage and, on the last (with the head), its loss, with no host sync (graphs.py
    captures it) -> (the stage's output or the loss, {metric: tensor}, the routers' replay counts or None)."""
    stats = []
    with model.numerics():
        out = stage_forward(model, x, mb["input_ids"], recompute, replayed(mb), stats, mb.get("seg"))
        routing = torch.stack(stats).sum(0) if stats else None  # replay: (rows the router would send elsewhere, rows)
        if model.head is None:
            return out, {}, routing
        loss = model.head_loss(out, mb, loss_fn)
    loss, extra = loss if isinstance(loss, tuple) else (loss, {})  # (loss, {name: value}) or a loss
    return loss, extra, routing


def add_metrics(metrics, loss, extra, routing):
    """A micro-batch's figures into the step's sums (_max names: the max); the losses in order (loss None: no head)."""
    if routing is not None:
        metrics["routing"] = metrics.get("routing", 0) + routing
    for k, v in extra.items():
        metrics[k] = max(metrics.get(k, 0.0), float(v)) if k.endswith("_max") else metrics.get(k, 0.0) + float(v)
    if loss is not None:
        metrics["loss"] = metrics.get("loss", 0.0) + loss.item()
        metrics.setdefault("mb_losses", []).append(loss.item())


def _forward(model, grid, x, mb, loss_fn, recompute, metrics):  # the eager schedules' forward, metrics read at once
    out, extra, routing = stage_loss(model, x, mb, loss_fn, recompute)
    add_metrics(metrics, out if grid.is_last_stage else None, extra, routing)
    return out


def _backward(x, y, grad_y):
    torch.autograd.backward(y, grad_tensors=grad_y)  # grad_y None on the last stage: y is the loss
    return x.grad if x is not None else None


def one_f_one_b(model, grid, microbatches, loss_fn, recompute=False):
    """1F1B: warm up with (pp - rank - 1) forwards, alternate one forward and one backward, cool down. At most
    pp - rank micro-batches' activations are alive at once."""
    n, metrics, fifo = len(microbatches), {}, []
    shape = lambda i: (*microbatches[i]["input_ids"].shape, model.args.hc_mult, model.args.hidden_size)
    num_warmup = min(grid.pp_size - grid.pp_rank - 1, n)
    # warmup
    for i in range(num_warmup):
        x = recv_fwd(grid, shape(i), model.dtype)
        y = _forward(model, grid, x, microbatches[i], loss_fn, recompute, metrics)
        send_fwd(grid, y)
        fifo.append((x, y))
    # steady state
    x = recv_fwd(grid, shape(num_warmup), model.dtype) if num_warmup < n else None
    for i in range(num_warmup, n):
        y = _forward(model, grid, x, microbatches[i], loss_fn, recompute, metrics)
        grad_y = send_fwd_recv_bwd(grid, y, shape(i - num_warmup))
        fifo.append((x, y))
        x_old, y_old = fifo.pop(0)
        grad_x = _backward(x_old, y_old, grad_y)
        if i == n - 1:
            send_bwd(grid, grad_x)
        else:
            x = send_bwd_recv_fwd(grid, grad_x, shape(i + 1), model.dtype)
    # cooldown
    for i in range(n - num_warmup, n):
        x_old, y_old = fifo.pop(0)
        send_bwd(grid, _backward(x_old, y_old, recv_bwd(grid, shape(i), model.dtype)))
    return metrics


def afab(model, grid, microbatches, loss_fn, recompute=False):
    """All forwards, then all backwards: the simple reference schedule (keeps every micro-batch alive)."""
    metrics, saved = {}, []
    shape = lambda mb: (*mb["input_ids"].shape, model.args.hc_mult, model.args.hidden_size)
    for mb in microbatches:
        x = recv_fwd(grid, shape(mb), model.dtype)
        y = _forward(model, grid, x, mb, loss_fn, recompute, metrics)
        send_fwd(grid, y)
        saved.append((x, y))
    for mb, (x, y) in zip(microbatches, saved):
        send_bwd(grid, _backward(x, y, recv_bwd(grid, shape(mb), model.dtype)))
    return metrics


@torch.no_grad()
def forward_only(model, grid, microbatches, fn):
    """Forward every micro-batch through the pipeline; the last stage returns [fn(logits, mb) for each mb] (old-policy
    or reference logprobs, evaluation), the other stages an empty list."""
    out = []
    for mb in microbatches:
        x = recv_fwd(grid, (*mb["input_ids"].shape, model.args.hc_mult, model.args.hidden_size), model.dtype)
        with model.numerics():
            y = stage_forward(model, x, mb["input_ids"], replay=replayed(mb), seg=mb.get("seg"))
            if grid.is_last_stage:
                out.append(model.head_loss(y, mb, fn))
        send_fwd(grid, y)
    return out


# -----------------------------------------------------------------------------
# gradients, then the optimizer's step (optimizer.AdamW)

def reduce_grads(model, grid):
    """Sum gradients over the ranks that hold copies of the same parameter: dense parameters over dp; routed experts
    over edp (each EP group holds one copy of every expert, whose gradient has every EP-group rank's tokens in it
    through combine's backward). A sum, not a mean: the loss is normalised by global counts, so layouts agree."""
    dense, expert = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            if p.grad is None:  # an expert no token chose this step: still takes part in the reduce
                p.grad = torch.zeros_like(p)
            (expert if ".experts." in name else dense).append(p.grad)
    for grads, group, what in ((dense, grid.dp_group, "dense grads over dp"),
                               (expert, grid.edp_group, "expert grads over edp")):
        if grads and group_size(group) > 1:
            flat = all_reduce(torch.cat([g.flatten().float() for g in grads]), group, what)
            for g, chunk in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(chunk.view_as(g))


def clip_grad_norm(model, grid, max_norm):
    """Global grad norm over every parameter of the model, counted once: experts differ across the EP group, layers
    across the pipeline; dense copies across dp are identical after reduce_grads. Multi-tensor ops (2,836 tensors)."""
    grads = {"dense": [], "expert": []}
    for name, p in model.named_parameters():
        if p.grad is not None:
            grads["expert" if ".experts." in name else "dense"].append(p.grad)
    sq = {k: torch.stack(torch._foreach_norm(g, 2, dtype=torch.float32)).square().sum() if g
          else torch.zeros((), device=grid.device) for k, g in grads.items()}
    total = sq["dense"] + all_reduce(sq["expert"], grid.ep_group, "expert grad norm over ep")
    norm = all_reduce(total, grid.pp_group, "grad norm over pp").sqrt()
    if max_norm and math.isfinite(norm.item()):
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        every = grads["dense"] + grads["expert"]
        for dtype in {g.dtype for g in every}:  # a multi-tensor op takes one dtype
            torch._foreach_mul_([g for g in every if g.dtype == dtype], coef.to(dtype))
    return norm.item()


def train_step(model, grid, opt, microbatches, loss_fn, grad_clip=1.0, schedule="1f1b", recompute=False):
    """One optimizer step over this rank's micro-batches (every DP rank passes the same number): dicts with
    "input_ids" [B, T] plus what loss_fn(logp, entropy, mb) reads (Transformer.head_loss); it returns the
    micro-batch's share of the global loss (normalised by global counts), or (loss, {name: value}). -> those metrics
    summed over micro-batches (last stage), grad_norm, skipped, and nonfinite: this rank's micro-batches with a
    non-finite loss, as (index, loss). A non-finite loss on any rank or a non-finite gradient norm skips the update on
    every rank."""
    opt.zero_grad()
    run = schedule if callable(schedule) else one_f_one_b if schedule == "1f1b" else afab  # or StepGraphs.train
    metrics = run(model, grid, microbatches, loss_fn, recompute)
    metrics["nonfinite"] = [(i, x) for i, x in enumerate(metrics.pop("mb_losses", [])) if not math.isfinite(x)]
    ids = [t for mb in microbatches for t in replayed(mb).values()]
    if ids:  # replay: each stage's routers count their own layers; the memory of the ids, the most on any rank
        if "routed_experts" in microbatches[0]:
            r = all_reduce(metrics.pop("routing"), grid.pp_group, "routing disagreement over pp").tolist()
            metrics.update(routing_differ=r[0], routing_rows=r[1])
        mib = torch.tensor(sum(t.nbytes for t in ids) / 2 ** 20, device=grid.device)
        metrics["replay_ids_mib"] = all_reduce(mib, grid.world_group, "replay ids memory", op=dist.ReduceOp.MAX).item()
    reduce_grads(model, grid)
    metrics["grad_norm"] = clip_grad_norm(model, grid, grad_clip)  # global: the same on every rank
    n_bad = all_reduce(torch.tensor(float(len(metrics["nonfinite"])), device=grid.device), grid.world_group,
                       "non-finite loss count")
    metrics["skipped"] = not math.isfinite(metrics["grad_norm"]) or n_bad.item() > 0
    if not metrics["skipped"]:
        opt.step()
    return metrics
