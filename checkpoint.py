"""
Checkpoints in the official layout: config.json, safetensors shards and their index, tensors under the official names
that model_dsv4.py's parameters carry (so the name table is the identity). Reading also takes what transformers'
save_pretrained writes (its `model.` prefix and renames undone) and dequantises the official FP8 (e4m3 + .scale) and
packed FP4 tensors to fp32. train_grpo.py's own checkpoints (optimizer, RNG, cursor) add their files beside these.
"""
import functools
import glob
import json
import os
import re

import torch

from model_dsv4 import FP32_NAMES, ModelArgs, Transformer
from quant import dequantize, scale_name


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
        json.dump({"metadata": {"total_size": sum(v.nbytes for v in sd.values())}, "weight_map": weight_map}, f, indent=1)
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
    unexpected = sorted(k for k in checkpoint_index(path) if k not in expected and not k.endswith(".scale")) if strict else []
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


def from_pretrained(path, device=None, dtype=None) -> Transformer:
    """Build from config.json and load the weights (see load_weights for the errors). A checkpoint without mtp.* tensors
    (transformers writes none) loads without the MTP layer."""
    args = ModelArgs.from_json(os.path.join(path, "config.json"))
    if args.num_nextn_predict_layers and not any(k.startswith("mtp.") for k in checkpoint_index(path)):
        print(f"{path}: no mtp.* tensors, loading without the MTP layer")
        args.num_nextn_predict_layers = 0
        args.compress_ratios = args.compress_ratios[:args.num_hidden_layers]
    with torch.device("meta"):
        model = Transformer(args, dtype=dtype or torch.bfloat16)
    return load_weights(model, path, device=device or "cpu")


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
