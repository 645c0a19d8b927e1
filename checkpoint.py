"""
Checkpoints in the official layout: config.json, safetensors shards and their index, tensors under the official names
that model_dsv4.py's parameters carry (so the name table is the identity). Reading also takes what transformers'
save_pretrained writes (its `model.` prefix and renames undone) and dequantises the official FP8 (e4m3 + .scale) and
packed FP4 tensors to fp32. The trainers write the same layout sharded by rank (save_weights), and train_grpo.py's
checkpoints add each rank's optimizer, RNG and data cursor beside it (save_checkpoint, load_state, checkpoints).
"""
import functools
import glob
import json
import os
import random
import re
import shutil
import time

import torch
import torch.distributed as dist

import parallel
from model_dsv4 import FP32_NAMES, ModelArgs, Transformer
from quant import dequantize, quantize_tensor, scale_name


def save_pretrained(model, path, dtype=None, shard_bytes=4 << 30):
    """config.json + model-0000k-of-0000n.safetensors + model.safetensors.index.json, official names."""
    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    sd = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if dtype is not None:
        sd = {k: v.to(dtype) if v.is_floating_point() and not any(s in k for s in FP32_NAMES) else v
              for k, v in sd.items()}
    shards, cur, size = [], {}, 0
    for k, v in sd.items():
        if cur and size + v.nbytes > shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[k], size = v.cpu(), size + v.nbytes
    shards.append(cur)
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(path, fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        total = sum(v.nbytes for v in sd.values())
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(model.args.to_json(), f, indent=1)


# transformers' save_pretrained writes a few names its reverse key mapping cannot restore
HF_SAVED_NAMES = [(r"^embed_tokens\.weight$", "embed.weight"), (r"^lm_head\.weight$", "head.weight"),
                  (r"^hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
                  (r"^(layers\.\d+\.attn)\.norm\.weight$", r"\1.kv_norm.weight")]  # attn.kv_norm -> attn.norm


@functools.lru_cache(maxsize=1 << 16)  # a sync asks for every name again: four regexes each
def canonical_name(name):
    """Official name for a checkpoint key: drop transformers' `model.` prefix and undo its renames."""
    name = name.removeprefix("model.")
    for pattern, repl in HF_SAVED_NAMES:
        name = re.sub(pattern, repl, name)
    return name


def checkpoint_index(path):
    """{official name: (file, key in file)} for every tensor of a checkpoint directory; reads headers only."""
    from safetensors import safe_open
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    index = {}
    for fn in files:
        with safe_open(fn, framework="pt") as f:
            index.update({canonical_name(k): (fn, k) for k in f.keys()})
    return index


def load_state_dict(path, names=None):
    """Tensors of a checkpoint directory by official name (all, or just `names`; the caller reports missing ones), with
    FP8 weights (.scale) and packed FP4 routed experts dequantised to fp32. Only the requested tensors are read."""
    from safetensors import safe_open
    index = checkpoint_index(path)
    names = [k for k in index if not (k.endswith(".scale") and k[:-5] + "weight" in index)] if names is None else names
    handles, sd = {}, {}
    read = lambda k: handles.setdefault(index[k][0], safe_open(index[k][0], framework="pt")).get_tensor(index[k][1])
    for k in [k for k in names if k in index]:
        sd[k] = read(k)
        if k.endswith(".weight") and scale_name(k) in index:
            try:
                sd[k] = dequantize(sd[k], read(scale_name(k)))
            except ValueError as e:
                raise ValueError(f"{k}: {e}")
    return sd


def load_weights(model, path, strict=True, device="cpu"):
    """Fill a (meta or real) model, whole or one stage / expert shard, from a checkpoint directory, onto `device`.
    Missing or mis-shaped tensors are an error that lists them; with strict, so are tensors the model has no use for."""
    expected = model.state_dict()
    sd = load_state_dict(path, list(expected))
    missing = sorted(set(expected) - set(sd))
    unexpected = []
    if strict:
        unexpected = sorted(k for k in checkpoint_index(path) if k not in expected and not k.endswith(".scale"))
    shapes = sorted(f"{k}: checkpoint {tuple(sd[k].shape)} vs model {tuple(v.shape)}"
                    for k, v in expected.items() if k in sd and sd[k].shape != v.shape)
    if missing or unexpected or shapes:
        raise ValueError(f"checkpoint {path} does not fit its config:\n  missing: {missing}\n"
                         f"  unexpected: {unexpected}\n  mis-shaped: {shapes}")
    # copy=True: fresh, aligned storage (tensors straight from safetensors may be unaligned, and BLAS then
    # takes another code path with other rounding)
    model.load_state_dict({k: sd[k].to(device=device, dtype=v.dtype, copy=True) for k, v in expected.items()},
                          assign=True)
    return model


def from_pretrained(path, device=None, dtype=None, weights=True) -> Transformer:
    """Build from config.json and load the weights (see load_weights for the errors). A checkpoint without mtp.* tensors
    (transformers writes none) loads without the MTP layer. weights=False: from config.json alone, random weights drawn
    on the device (SGLang's --load-format dummy: a server whose first weights arrive as an update)."""
    args = ModelArgs.from_json(os.path.join(path, "config.json"))
    if not weights:
        with torch.device("meta"):
            model = Transformer(args, dtype=dtype or torch.bfloat16)
        model.to_empty(device=device or "cpu").init_weights(draw_on=device or "cpu")
        return model
    if args.num_nextn_predict_layers and not any(k.startswith("mtp.") for k in checkpoint_index(path)):
        print(f"{path}: no mtp.* tensors, loading without the MTP layer")
        args.num_nextn_predict_layers = 0
        args.compress_ratios = args.compress_ratios[:args.num_hidden_layers]
    with torch.device("meta"):
        model = Transformer(args, dtype=dtype or torch.bfloat16)
    return load_weights(model, path, device=device or "cpu")


# -----------------------------------------------------------------------------
# the trainers' writes: sharded official-name weights (train_sft.py's base, train_grpo.py's syncs from disk and
# checkpoints), and train_grpo.py's checkpoints (those weights + each rank's optimizer / RNG / cursor, for resume)

RANK_FILE = "trainer_rank{:05d}-of-{:05d}.pt"  # a rank's optimizer / RNG / cursor file in a checkpoint (rank, world)


def save_weights(model, grid, path, args, quant="none", weights=True):
    """Every writer saves model-rank{r}-of{w}.safetensors into path, quantized for rollout_quant; rank 0 adds
    config.json and the index (transformers' from_pretrained reads it too). Collective. -> (the first rows of
    what this rank wrote, for verify; its bytes). weights=False: config.json alone (and an empty index), for a
    server started with --load-format dummy."""
    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    mine = {n: q.contiguous().cpu() for k, v in model.state_dict().items() if weights
            and (grid.edp_rank == 0 if ".experts." in k else grid.dp_rank == 0)  # what this rank writes (docstring)
            for n, q in quantize_tensor(k, v.detach(), quant).items()}
    fname = f"model-rank{grid.rank:05d}-of-{grid.world_size:05d}.safetensors"
    nbytes = sum(v.nbytes for v in mine.values())
    if mine:
        save_file(mine, os.path.join(path, fname), metadata={"format": "pt"})
    names = [(list(mine), fname, nbytes)] * grid.world_size  # every writer's (keys, file, bytes), for the index
    if grid.world_size > 1:
        with parallel.named("all_gather_object(shard names)", dist.group.WORLD):
            dist.all_gather_object(names, names[0])
    if grid.rank == 0:
        index = {k: f for keys, f, _ in names for k in keys}
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": sum(n for *_, n in names)}, "weight_map": index}, f)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(args.to_json(), f, indent=1)
    parallel.barrier(dist.group.WORLD, "shards written")
    return {k: v[:2].clone() for k, v in mine.items()}, nbytes



def save_checkpoint(out_dir, step, model, grid, args, state, config, keep):
    """out_dir/ckpt_{step}: the weights (save_weights, every rank), each rank's trainer state (optimizer, RNG, data
    cursor: trainer_state) and meta.json, written into ckpt_{step}.tmp and renamed once all are in; then all but the
    newest `keep` complete checkpoints and any unfinished .tmp are removed. Collective."""
    final, t0 = os.path.join(out_dir, f"ckpt_{step:06d}"), time.time()
    tmp = final + ".tmp"
    save_weights(model, grid, tmp, args)
    torch.save(state, os.path.join(tmp, RANK_FILE.format(grid.rank, grid.world_size)))
    parallel.barrier(grid.world_group, f"checkpoint {step} written")
    if grid.rank == 0:
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump({"step": step, "world_size": grid.world_size, "config": config}, f, indent=1)
        os.replace(tmp, final)
        size, dt = sum(os.path.getsize(os.path.join(final, f)) for f in os.listdir(final)) / 1e9, time.time() - t0
        print(f"checkpoint {final}: {size:.2f} GB in {dt:.1f} s ({size / dt:.2f} GB/s)", flush=True)
        old = checkpoints(out_dir)[0][:-keep] + [d for d in os.listdir(out_dir) if d.endswith(".tmp")]  # crashes' too
        for d in old:
            shutil.rmtree(os.path.join(out_dir, d), ignore_errors=True)
    parallel.barrier(grid.world_group, f"checkpoint {step} renamed")


def checkpoints(out_dir):
    """(complete checkpoints, incomplete ones) in out_dir, sorted. save_checkpoint writes ckpt_N.tmp and renames it
    once every rank's file and meta.json (the last file) are in: a .tmp or a directory without meta.json is a
    write that did not finish (a crash, a kill -9), never a resume point."""
    names = sorted(d for d in os.listdir(out_dir) if d.startswith("ckpt_")) if os.path.isdir(out_dir) else []
    done = [d for d in names if re.fullmatch(r"ckpt_\d+", d) and os.path.exists(os.path.join(out_dir, d, "meta.json"))]
    return done, [d for d in names if d not in done]


def trainer_state(step, opt, **extra):
    """What a rank saves beside the weights: the optimizer, the RNGs, the step, and the caller's extras."""
    return {"opt": opt.state_dict(), "torch_rng": torch.get_rng_state(), "py_rng": list(random.getstate()[1]),
            "step": step, **extra}


def load_state(ckpt, grid):
    """This rank's trainer state of a checkpoint (trainer_state's dict), its RNGs restored; a SystemExit naming the
    layout when the checkpoint has no file for this rank (the optimizer state is per rank)."""
    path = os.path.join(ckpt, RANK_FILE.format(grid.rank, grid.world_size))
    if not os.path.exists(path):
        written = json.load(open(os.path.join(ckpt, "meta.json"))).get("world_size")
        raise SystemExit(f"error: {ckpt} was written by {written} ranks, this run has {grid.world_size}: resume with "
                         f"the same layout (the optimizer state is per rank)")
    st = torch.load(path, weights_only=True)
    torch.set_rng_state(st["torch_rng"])
    random.setstate((3, tuple(st["py_rng"]), None))
    return st


if __name__ == "__main__":
    # Self-check on CPU in seconds: a tiny model through the official layout and back computes the same logits.
    import tempfile
    torch.manual_seed(0)
    args = ModelArgs(num_hidden_layers=4, compress_ratios=[0, 4, 16, 0, 0], num_hash_layers=1)
    model = Transformer(args, dtype=torch.float32)
    ids = torch.randint(2, args.vocab_size, (2, 40))
    with tempfile.TemporaryDirectory() as d, torch.no_grad():
        save_pretrained(model, d, shard_bytes=16 << 20)  # several shards and their index
        n_files = len(glob.glob(os.path.join(d, "*.safetensors")))
        reloaded = from_pretrained(d, dtype=torch.float32)
        diff = (reloaded(ids, mtp=True)[1] - model(ids, mtp=True)[1]).abs().max().item()
    print(f"save_pretrained -> from_pretrained through {n_files} shards: MTP logits max |diff| {diff:.2e}")
    assert n_files > 1 and diff == 0, "the reloaded model computes other logits"
    print("self-check passed")
