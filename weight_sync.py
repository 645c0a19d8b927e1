"""
Weight sync from the trainer to the rollout servers, and the shared writer of official-name safetensors shards
(checkpoints use it too).

Names: the trainer's parameter names *are* the official checkpoint names (model_dsv4.py), so the name table is
the identity. Each tensor has exactly one writer: dense tensors come from DP rank 0 of their pipeline stage,
routed experts from the ranks of the first EP group (edp rank 0), which together hold every expert once.
Buffers (the hash table tid2eid, the router bias) travel with the parameters: a table synced as zeros is a
different model.

Transports (config key weight_sync_mode):
  disk         every writer saves its shard, then POST /update_weights_from_disk on every server.
"""
import json
import os

import torch.distributed as dist


def my_tensors(model, grid):
    """{official name: tensor} this rank writes (see the module docstring for who writes what)."""
    return {k: v for k, v in model.state_dict().items()
            if (grid.edp_rank == 0 if ".experts." in k else grid.dp_rank == 0)}


def save_weights(model, grid, path, args):
    """Every writer saves model-rank{r}-of{w}.safetensors into path; rank 0 adds config.json and the index
    (so transformers' from_pretrained reads it too). Collective over the world."""
    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    mine = {k: v.detach().contiguous().cpu() for k, v in my_tensors(model, grid).items()}
    fname = f"model-rank{grid.rank:05d}-of-{grid.world_size:05d}.safetensors"
    if mine:
        save_file(mine, os.path.join(path, fname), metadata={"format": "pt"})
    names = [(list(mine), fname, sum(v.nbytes for v in mine.values()))]
    if grid.world_size > 1:
        names = [None] * grid.world_size
        dist.all_gather_object(names, (list(mine), fname, sum(v.nbytes for v in mine.values())))
    if grid.rank == 0:
        index = {k: f for keys, f, _ in names for k in keys}
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": sum(n for *_, n in names)}, "weight_map": index}, f)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(args.to_json(), f, indent=1)
    if grid.world_size > 1:
        dist.barrier()


def sync(model, grid, client, args, path, mode="disk", version="1"):
    """Push the current weights to every server in client; the servers stamp `version` on what they generate."""
    if mode != "disk":
        raise ValueError(f"weight_sync_mode '{mode}' is not available yet (have: disk)")
    save_weights(model, grid, path, args)
    if grid.rank == 0:
        client.update_weights_from_disk(os.path.abspath(path), weight_version=version)
    if grid.world_size > 1:
        dist.barrier()
