"""config.json parsing, the official (quantized) checkpoint layout, and loader errors."""
import copy
import json
import re

import pytest
import torch
from safetensors.torch import save_file

from conftest import TINY, randomize_
from checkpoint import from_pretrained, load_state_dict, save_pretrained
from model_dsv4 import ModelArgs, Transformer
from quant import fp4_dequantize, fp4_quantize, fp8_block_dequantize, fp8_block_quantize

FP8 = r"\.(wq_a|wq_b|wkv|wo_a|wo_b|e_proj|h_proj)\.weight$|shared_experts\.w[123]\.weight$"  # spec §4.5
FP4 = r"\.experts\.\d+\.w[123]\.weight$"
FLASH = "config/models/flash.json"


@pytest.mark.slow
def test_flash_config_and_size():
    args = ModelArgs.from_json(FLASH)
    assert args.compress_ratios == [0, 0] + [4, 128] * 20 + [4, 0] and args.num_hash_layers == 3
    assert args.rope_scaling["factor"] == 16 and args.compress_rope_theta == 160000
    with torch.device("meta"):
        model = Transformer(args)
    trunk = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("mtp."))
    assert round(trunk / 1e9, 1) == 284.3  # the published 284B (spec §0)
    for name in ("config/models/tiny.json", "config/models/bench_2b.json"):
        ModelArgs.from_json(name)


def test_official_and_transformers_keys_agree():
    transformers = pytest.importorskip("transformers")
    official = json.load(open(FLASH))
    normalised = transformers.DeepseekV4Config(**official).to_dict()  # layer_types, rope_parameters, ...
    for k in ("compress_ratios", "num_hash_layers", "qk_rope_head_dim", "rope_scaling"):
        normalised.pop(k, None)
    a, b = ModelArgs.from_json(FLASH), ModelArgs.from_json(normalised)
    assert a.compress_ratios == b.compress_ratios and a.num_hash_layers == b.num_hash_layers
    assert (a.rope_theta, a.compress_rope_theta, a.qk_rope_head_dim) == (b.rope_theta, b.compress_rope_theta,
                                                                         b.qk_rope_head_dim)
    assert all(a.rope_scaling[k] == b.rope_scaling[k] for k in ("factor", "original_max_position_embeddings"))


@pytest.mark.parametrize("change,field", [
    ({"n_experts_typo": 3}, "n_experts_typo"),
    ({"num_key_value_heads": 8}, "num_key_value_heads"),
    ({"compress_ratios": [0, 4]}, "compress_ratios"),
    ({"layer_types": ["sliding_attention"] * 43}, "compress_ratios"),  # disagrees with compress_ratios
    ({"scoring_func": "relu"}, "scoring_func"),
])
def test_bad_config_names_the_field(change, field):
    cfg = {**json.load(open(FLASH)), **change}
    with pytest.raises(ValueError, match=field):
        ModelArgs.from_json(cfg)


def write_official(model, path):
    """Write a model the way DeepSeek ships V4: FP8 e4m3 + e8m0 128x128 block scales for the dense linears
    (one with fp32 scales, as older repacks do), FP4 e2m1 + e8m0 per-32 scales for routed experts,
    bf16 norms, fp32 mHC / sinks / ape. Returns the weights the loader must produce."""
    tensors, expect = {}, {}
    for i, (name, t) in enumerate(model.state_dict().items()):
        if re.search(FP8, name):
            q, s = fp8_block_quantize(t.float(), scale_fmt="fp32" if name == "layers.0.attn.wq_a.weight" else "ue8m0")
            tensors[name], tensors[name[:-len("weight")] + "scale"] = q, s
            expect[name] = fp8_block_dequantize(q, s)
        elif re.search(FP4, name):
            q, s = fp4_quantize(t.float())
            tensors[name], tensors[name[:-len("weight")] + "scale"] = q, s
            expect[name] = fp4_dequantize(q, s)
        else:
            tensors[name] = t.to(torch.bfloat16) if name.endswith("norm.weight") else t
            expect[name] = tensors[name]
    path.mkdir(exist_ok=True)
    half = len(tensors) // 2  # two shards, a weight and its scale may sit in different files
    items = list(tensors.items())
    save_file(dict(items[:half]), path / "model-00001-of-00002.safetensors")
    save_file(dict(items[half:]), path / "model-00002-of-00002.safetensors")
    (path / "config.json").write_text(json.dumps(model.args.to_json()))
    return expect


@pytest.mark.slow
def test_official_quantized_layout_loads(tmp_path):
    model = randomize_(Transformer(copy.deepcopy(TINY), dtype=torch.float32), 16, 4)
    expect = write_official(model, tmp_path)
    assert load_state_dict(tmp_path)["layers.0.ffn.experts.0.w1.weight"].shape == (128, 256)  # unpacked
    loaded = from_pretrained(tmp_path, dtype=torch.float32).state_dict()
    assert set(loaded) == set(expect)
    for name, want in expect.items():
        assert torch.equal(loaded[name], want.to(loaded[name].dtype)), name
    # and the quantization really happened: FP4 experts are coarse, FP8 weights close
    w = model.state_dict()
    assert (loaded["layers.4.ffn.experts.3.w2.weight"] - w["layers.4.ffn.experts.3.w2.weight"]).abs().max() > 1e-3
    name = "layers.2.attn.wq_b.weight"
    torch.testing.assert_close(loaded[name], w[name], rtol=0.07, atol=1e-3)


def test_save_load_round_trip_sharded(tmp_path):
    model = randomize_(Transformer(copy.deepcopy(TINY), dtype=torch.float32), 16, 4)
    save_pretrained(model, tmp_path, shard_bytes=20 << 20)
    index = json.load(open(tmp_path / "model.safetensors.index.json"))
    assert len(set(index["weight_map"].values())) > 1 and set(index["weight_map"]) == set(model.state_dict())
    ids = torch.randint(0, TINY.vocab_size, (1, 80))
    with torch.no_grad():
        assert torch.equal(from_pretrained(tmp_path, dtype=torch.float32)(ids), model(ids))
    save_pretrained(model, tmp_path / "bf16", dtype=torch.bfloat16)
    sd = load_state_dict(tmp_path / "bf16")
    assert sd["embed.weight"].dtype == torch.bfloat16 and sd["layers.0.hc_attn_fn"].dtype == torch.float32


def test_loader_errors_list_the_names(tmp_path):
    model = Transformer(copy.deepcopy(TINY), dtype=torch.float32)
    sd = model.state_dict()
    sd.pop("layers.2.attn.indexer.wq_b.weight")
    sd["layers.1.attn.wkv.weight"] = torch.zeros(3, 3)
    sd["layers.1.attn.extra.weight"] = torch.zeros(1)
    tmp_path.mkdir(exist_ok=True)
    save_file({k: v.contiguous() for k, v in sd.items()}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(model.args.to_json()))
    with pytest.raises(ValueError) as e:
        from_pretrained(tmp_path)
    msg = str(e.value)
    assert "layers.2.attn.indexer.wq_b.weight" in msg and "layers.1.attn.extra.weight" in msg
    assert "layers.1.attn.wkv.weight: checkpoint (3, 3) vs model (128, 256)" in msg
    with pytest.raises(FileNotFoundError):
        load_state_dict(tmp_path / "nowhere")
