"""
DeepSeek-V4 (Flash) in plain PyTorch: one nn.Module per paper concept, training-first.

Parameter names equal the official checkpoint names (`layers.3.attn.wq_a.weight`, `layers.0.ffn.gate.tid2eid`,
`hc_head_fn`, ...), so one name space serves loading, saving (checkpoint.py) and weight sync to SGLang. Precision is
explicit: parameters and the residual stream are in the model dtype (bf16 by default, fp32 for parity tests); mHC,
router, compressor pooling, norms and logits are computed in fp32 as in the reference. Every mechanism is in the
full-sequence (training) form; kv_cache.py holds the decode form of the same modules. The MoE layer and its
expert-parallel dispatch live in moe.py, mHC's functions in mhc.py.

Fast paths (dsv4_kernels/) replace some calls when `Transformer.set_kernels(True)`; the plain reference sits beside
each call and is what the tests hold the fast paths to.

Shape legend: B batch, T tokens, D hidden, n hc streams, H heads, d head dim, rd rope dims,
S compressed entries (T // ratio), E routed experts, K experts per token, N = B*T tokens.
"""
import contextlib
import json
import math
import zlib
from dataclasses import dataclass, field, fields, asdict
from functools import cached_property, lru_cache

import torch
import torch.nn as nn
import torch.nn.functional as F
from chunked_head import token_stats
from dsv4_kernels import has_triton
from dsv4_kernels.decode import q_norm_rope_triton
from dsv4_kernels.fp8 import use_fp8_gemm
from dsv4_kernels.fast import fuse_projections, linear_f32, matmul_f32, stack_experts, use_gemm_f32, window_attention
from dsv4_kernels.invariant import PathInvariant
from dsv4_kernels.mhc_triton import HC_PRE_TOKENS, hc_post_triton, hc_pre_triton
from mhc import hc_head, hc_mixes, hc_split_sinkhorn
from moe import MoE
from quant import FP8Linear, index_quant_sim, kv_quant_sim, weight_round_sim

# -----------------------------------------------------------------------------
# config

@dataclass
class ModelArgs:
    """Field names are the official config.json keys. Defaults are the tiny CPU model (spec §7.1)."""
    vocab_size: int = 4096
    hidden_size: int = 256
    num_hidden_layers: int = 8
    num_nextn_predict_layers: int = 1  # MTP depth (mtp.0.*)
    max_position_embeddings: int = 256  # = YaRN factor x original length, as transformers expects
    # attention (shared-KV MQA: one kv head, K == V)
    num_attention_heads: int = 4
    num_key_value_heads: int = 1
    head_dim: int = 128
    qk_rope_head_dim: int = 64  # RoPE on the *last* rd dims of every head
    q_lora_rank: int = 128
    o_groups: int = 2
    o_lora_rank: int = 128
    sliding_window: int = 32
    # per layer, trunk then MTP: 0 = window only, 4 = CSA (overlap compressor + indexer), other = HCA
    compress_ratios: list = field(default_factory=lambda: [0, 0, 4, 16, 4, 16, 4, 0, 0])
    rope_theta: float = 10000.0  # ratio-0 layers, plain RoPE
    compress_rope_theta: float = 160000.0  # compressed layers, with YaRN
    rope_scaling: dict = field(default_factory=lambda: {"type": "yarn", "factor": 4,
                                                        "original_max_position_embeddings": 64,
                                                        "beta_fast": 32, "beta_slow": 1})
    index_n_heads: int = 4
    index_head_dim: int = 128
    index_topk: int = 8
    # moe
    n_routed_experts: int = 16
    n_shared_experts: int = 1
    num_experts_per_tok: int = 4
    moe_intermediate_size: int = 128
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    # hash routing: the first num_hash_layers layers pick experts by tid2eid[token_id]
    num_hash_layers: int = 3
    # hc (manifold-constrained hyper-connections)
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    # tokens
    bos_token_id: int = 0
    eos_token_id: int = 1
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02

    # keys we read elsewhere or that carry no architecture: accepted and dropped
    IGNORED = {"architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "quantization_config",
               "expert_dtype", "hidden_act", "attention_bias", "attention_dropout", "use_cache", "pad_token_id",
               "topk_method", "mlp_bias", "output_router_logits", "router_aux_loss_coef", "router_jitter_noise",
               "auto_map", "scale_fmt", "_name_or_path", "n_group", "topk_group", "partial_rotary_factor",
               "layer_types", "mlp_layer_types", "compress_rates", "rope_parameters",
               # transformers' generic PreTrainedConfig fields
               "chunk_size_feed_forward", "id2label", "label2id", "is_encoder_decoder", "output_attentions",
               "output_hidden_states", "problem_type", "return_dict", "tokenizer_class", "generation_config"}

    @classmethod
    def from_json(cls, path_or_dict) -> "ModelArgs":
        """Official DeepSeek-V4 keys or transformers-normalised keys; unknown or inconsistent -> ValueError."""
        cfg = dict(path_or_dict) if isinstance(path_or_dict, dict) else json.load(open(path_or_dict))
        known = {f.name for f in fields(cls)}
        unknown = sorted(k for k in cfg if k not in known and k not in cls.IGNORED)
        if unknown:
            raise ValueError(f"config: unknown field(s) {unknown}")
        args = cls(**{k: v for k, v in cfg.items() if k in known})
        n = args.num_hidden_layers
        # transformers' normalised form: layer_types + compress_rates, mlp_layer_types, rope_parameters
        if "layer_types" in cfg:
            rates = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
            rates.update(cfg.get("compress_rates") or {})
            bad = [t for t in cfg["layer_types"] if t not in rates]
            if bad or len(cfg["layer_types"]) != n:
                raise ValueError(f"config: layer_types must list {n} of {sorted(rates)}, got {cfg['layer_types']}")
            ratios = [rates[t] for t in cfg["layer_types"]]
            if "compress_ratios" in cfg and list(cfg["compress_ratios"][:n]) != ratios:
                raise ValueError(f"config: compress_ratios {cfg['compress_ratios']} disagree with layer_types {ratios}")
            args.compress_ratios = list(cfg.get("compress_ratios", ratios + [0] * args.num_nextn_predict_layers))
        if "mlp_layer_types" in cfg:
            hashes = [t == "hash_moe" for t in cfg["mlp_layer_types"]]
            n_hash = sum(hashes)
            if hashes != [True] * n_hash + [False] * (len(hashes) - n_hash):
                raise ValueError(f"config: hash_moe layers must come first, got {cfg['mlp_layer_types']}")
            if "num_hash_layers" in cfg and cfg["num_hash_layers"] != n_hash:
                raise ValueError(f"config: num_hash_layers {cfg['num_hash_layers']} disagrees with mlp_layer_types")
            args.num_hash_layers = n_hash
        rp = cfg.get("rope_parameters")
        if isinstance(rp, dict) and isinstance(rp.get("main"), dict):
            args.rope_theta = rp["main"].get("rope_theta", args.rope_theta)
            comp = dict(rp["compress"])
            args.compress_rope_theta = comp.pop("rope_theta", args.compress_rope_theta)
            if comp.get("rope_type", comp.get("type")) == "yarn":
                keys = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow")
                args.rope_scaling = {"type": "yarn", **{k: comp[k] for k in keys if k in comp}}
            else:
                args.rope_scaling = None
        if "partial_rotary_factor" in cfg and "qk_rope_head_dim" not in cfg:
            args.qk_rope_head_dim = int(args.head_dim * cfg["partial_rotary_factor"])
        args.check()
        return args

    def check(self):
        """Configs that would build a different model than they describe are a ValueError naming the field."""
        n, r = self.num_hidden_layers, self.compress_ratios
        if len(r) == n:  # MTP layers are window-only when the list stops at the trunk
            self.compress_ratios = r = list(r) + [0] * self.num_nextn_predict_layers
        problems = {
            "compress_ratios": len(r) != n + self.num_nextn_predict_layers or any(x < 0 for x in r),
            "num_key_value_heads": self.num_key_value_heads != 1,
            "n_shared_experts": self.n_shared_experts != 1,
            "scoring_func": self.scoring_func not in ("sqrtsoftplus", "sigmoid", "softmax"),
            "qk_rope_head_dim": self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > self.head_dim,
            "o_groups": self.num_attention_heads % self.o_groups != 0,
            "num_experts_per_tok": self.num_experts_per_tok > self.n_routed_experts,
            "num_hash_layers": self.num_hash_layers > n,
            "tie_word_embeddings": self.tie_word_embeddings,
            "rope_scaling": self.rope_scaling is not None and self.rope_scaling.get("type",
                                self.rope_scaling.get("rope_type")) not in ("yarn", "default"),
        }
        bad = [k for k, v in problems.items() if v]
        if bad:
            raise ValueError(f"config: unsupported or inconsistent field(s) {bad}: "
                             + ", ".join(f"{k}={getattr(self, k)!r}" for k in bad))

    def to_json(self) -> dict:
        """Official keys plus transformers' normalised keys, so both loaders read the same file."""
        d = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", **asdict(self)}
        n = self.num_hidden_layers
        trunk = self.compress_ratios[:n]
        hca = sorted({x for x in trunk if x not in (0, 4)})
        assert len(hca) <= 1, f"transformers keeps one HCA rate, this config has {hca}"
        names = {0: "sliding_attention", 4: "compressed_sparse_attention"}
        d["layer_types"] = [names.get(x, "heavily_compressed_attention") for x in trunk]
        d["compress_rates"] = {"compressed_sparse_attention": 4, "heavily_compressed_attention": hca[0] if hca else 128}
        d["mlp_layer_types"] = ["hash_moe"] * self.num_hash_layers + ["moe"] * (n - self.num_hash_layers)
        d["hidden_act"], d["torch_dtype"] = "silu", "bfloat16"
        return d



def pack_multiple(args):
    """Where a packed sample may start: a multiple of every compress ratio (the indexer's 4 among them), so that no
    compressor's window straddles two samples. 1 without compressed layers."""
    return math.lcm(1, *[r for r in args.compress_ratios[:args.num_hidden_layers] if r])


def length_multiple(args):
    """Compiled layers specialise on a length's remainder by each compress ratio (the pooling) and by the window (the
    fast attention's query blocks); a length padded to a multiple of all of them runs the same graph of each kind of
    layer (compile='layers': the trainer's micro-batches, the engine's prefill). 128 for V4."""
    return math.lcm(args.sliding_window, *[r for r in args.compress_ratios if r])

# -----------------------------------------------------------------------------
# building blocks

class RMSNorm(nn.Module):
    """y = x / rms(x) * weight, computed in fp32 with an fp32 weight, rounded once to the input dtype."""
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps) * self.weight.float()).to(x.dtype)


@lru_cache(maxsize=64)
def rope_inv_freq(rd, theta, scaling_items=None, device="cpu"):
    """Per-pair inverse frequencies theta_i = base^(-2i/rd); YaRN blends in theta_i/factor (no mscale, spec §2.4)."""
    inv = 1.0 / (theta ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd))
    s = dict(scaling_items or ())
    if s.get("type", s.get("rope_type")) == "yarn":
        factor, orig = s["factor"], s["original_max_position_embeddings"]
        corr = lambda rot: rd * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(theta))
        low = max(math.floor(corr(s.get("beta_fast", 32))), 0)
        high = min(math.ceil(corr(s.get("beta_slow", 1))), rd - 1)
        ramp = ((torch.arange(rd // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
        inv = inv / factor * ramp + inv * (1 - ramp)
    return inv.to(device)  # cached per device: no host-to-device copy per call (CUDA graphs forbid one)


def rope_cos_sin(args, ratio, pos):
    """cos/sin [len(pos), rd/2] for a layer: plain base for ratio 0, compress base + YaRN otherwise."""
    # compiled code traces the frequencies into its graph (constants there); the cache is for eager calls, and dynamo
    # warns about a cached function it traces through
    inv_freq = rope_inv_freq.__wrapped__ if torch.compiler.is_compiling() else rope_inv_freq
    if ratio == 0:
        inv = inv_freq(args.qk_rope_head_dim, float(args.rope_theta), None, pos.device)
    else:
        items = tuple(sorted((args.rope_scaling or {}).items()))
        inv = inv_freq(args.qk_rope_head_dim, float(args.compress_rope_theta), items, pos.device)
    # decode's [B, 1] positions: a few numbers, which torch.compile folds into the kernels that rotate by them (and
    # packed samples' [B, T])
    return angles(pos, inv) if pos.dim() > 1 else rope_angles(pos, inv)


def angles(pos, inv):
    ang = pos.float()[..., None] * inv  # [T] or [B, T] -> [..., rd/2]
    return ang.cos(), ang.sin()


@torch.library.custom_op("nano_dsv4::rope_angles", mutates_args=())
def rope_angles(pos: torch.Tensor, inv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of pos[:, None] * inv, fp32. An op of its own, opaque to torch.compile, which otherwise computes
    cos again for every element of each tensor it rotates."""
    return angles(pos, inv)


PathInvariant.DECOMPOSE[torch.ops.nano_dsv4.rope_angles.default] = angles  # its cos and sin in fp64 there too


@rope_angles.register_fake
def _(pos, inv):
    shape = torch.broadcast_shapes((pos.shape[0], 1, *pos.shape[1:]), (1, inv.shape[0]))
    return pos.new_empty(shape, dtype=torch.float32), pos.new_empty(shape, dtype=torch.float32)


def sample_positions(seg):
    """seg [B, T]: the sample each token of a packed row belongs to (grpo.make_microbatches' "seg"; -1: padding) ->
    each token's position within its sample [B, T]: RoPE and the compressors count from a sample's first token."""
    t = torch.arange(seg.shape[1], device=seg.device)
    opens = torch.ones_like(seg, dtype=torch.bool)
    opens[:, 1:] = seg[:, 1:] != seg[:, :-1]
    return t - torch.where(opens, t, 0).cummax(-1).values


def apply_rope(x, cos, sin):
    """Interleaved-pair RoPE (x[2i], x[2i+1]) on the last 2*cos.shape[-1] dims of x, in fp32.
    x: [..., T, (H,) d]; cos/sin broadcast against x's rope slice without its last dim halved.
    Pass -sin for the inverse rotation."""
    rd = 2 * cos.shape[-1]
    nope, rope = x[..., :-rd], x[..., -rd:].float()
    x0, x1 = rope[..., 0::2], rope[..., 1::2]
    out = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2)
    return torch.cat([nope, out.to(x.dtype)], dim=-1)


# -----------------------------------------------------------------------------
# attention: sliding window + compressed KV (CSA / HCA), sink, grouped output projection

class Compressor(nn.Module):
    """Pools every `ratio` tokens into one KV entry with a per-channel softmax gate (spec §2.3 steps 6-9).
    ratio 4 overlaps: entry w pools window w-1 (first-half channels) and window w (second half)."""
    fp8_emu = False  # set by Transformer.set_fp8_emulation; rotate: the indexer's (Hadamard + FP4 sim, not FP8)
    def __init__(self, args, ratio, head_dim, rotate=False):
        super().__init__()
        self.ratio, self.head_dim, self.overlap, self.rotate = ratio, head_dim, ratio == 4, rotate
        coff = 2 if self.overlap else 1
        self.wkv = nn.Linear(args.hidden_size, coff * head_dim, bias=False)
        self.wgate = nn.Linear(args.hidden_size, coff * head_dim, bias=False)
        self.ape = nn.Parameter(torch.zeros(ratio, coff * head_dim, dtype=torch.float32))
        self.norm = RMSNorm(head_dim, args.rms_norm_eps)

    def project(self, x):
        """Per-token kv and gate scores in fp32: [B, T, coff*d] each (the reference computes them in fp32)."""
        return linear_f32(x, self.wkv.weight), linear_f32(x, self.wgate.weight)

    def pool(self, kv, score, prev_kv=None, prev_score=None, opens=None):
        """kv, score: [B, W, ratio, coff*d] for W complete windows (ape not yet added).
        prev_*: [B, ratio, d] first-half channels of the window before the first one (overlap only). opens: bool
        [B, W], the windows that open a packed sample, which have no window before them either.
        Returns the pooled, fp32 entries [B, W, d]."""
        d, m = self.head_dim, self.ratio
        score = score + self.ape
        if self.overlap:
            B, W = kv.shape[:2]
            if prev_kv is None:  # no window before position 0: zero kv with -inf score, softmax weight 0
                prev_kv = kv.new_zeros(B, m, d)
                prev_score = score.new_full((B, m, d), float("-inf"))
            prev_kv = torch.cat([prev_kv[:, None], kv[:, :-1, :, :d]], dim=1)
            prev_score = torch.cat([prev_score[:, None], score[:, :-1, :, :d]], dim=1)
            if opens is not None:  # a packed sample's first window: nothing before it, as at position 0
                prev_kv = prev_kv.masked_fill(opens[..., None, None], 0.0)
                prev_score = prev_score.masked_fill(opens[..., None, None], float("-inf"))
            kv = torch.cat([prev_kv, kv[..., d:]], dim=2)  # [B, W, 2m, d]
            score = torch.cat([prev_score, score[..., d:]], dim=2)
        return (kv * score.softmax(dim=2)).sum(dim=2)  # softmax over slots, independently per channel

    def finish(self, entries, args, pos):
        """Norm in the model dtype, then RoPE at the window's first token position pos (w*ratio; [B, W] packed)."""
        entries = self.norm(entries.to(self.wkv.weight.dtype))
        cos, sin = rope_cos_sin(args, self.ratio, pos)
        entries = apply_rope(entries, cos, sin)
        if self.fp8_emu:  # spec §2.3 step 10
            entries = index_quant_sim(entries) if self.rotate else kv_quant_sim(entries, args.qk_rope_head_dim)
        return entries

    def forward(self, x, args, pos=None):
        # x: [B, T, D] -> [B, T // ratio, d]; a trailing partial window emits nothing. pos: [B, T] positions within
        # packed samples (sample_positions), each sample starting at a multiple of the ratio, or None (one a row)
        B, T, _ = x.shape
        W = T // self.ratio
        if W == 0:
            return x.new_zeros(B, 0, self.head_dim)
        kv, score = self.project(x[:, :W * self.ratio])
        view = lambda t: t.view(B, W, self.ratio, t.shape[-1])
        if pos is None:
            starts, opens = torch.arange(W, device=x.device) * self.ratio, None
        else:
            starts = pos[:, :W * self.ratio:self.ratio]  # [B, W]
            opens = starts == 0
        return self.finish(self.pool(view(kv), view(score), opens=opens), args, starts)


class Indexer(nn.Module):
    """Lightning indexer (CSA layers): score[t,s] = sum_h w[t,h] relu(q[t,h] . k[s]); keeps the top-k
    visible entries. Selection is discrete, so these weights get no gradient from the LM loss
    (V4 trains them with a separate distillation loss, which this project does not use)."""
    def __init__(self, args):
        super().__init__()
        self.n_heads, self.head_dim, self.topk = args.index_n_heads, args.index_head_dim, args.index_topk
        self.wq_b = FP8Linear(args.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.weights_proj = nn.Linear(args.hidden_size, self.n_heads, bias=False)
        self.compressor = Compressor(args, 4, self.head_dim, rotate=True)

    def scores(self, x, qr, k, cos, sin, w=None):
        # x: [B, T, D], qr: [B, T, q_lora], k: [B, S, hd] -> [B, T, S] fp32; w: weights_proj(x) if computed already
        B, T, _ = x.shape
        q = apply_rope(self.wq_b(qr).view(B, T, self.n_heads, self.head_dim), cos.unsqueeze(-2), sin.unsqueeze(-2))
        q = index_quant_sim(q) if self.wq_b.fp8_emu else q  # k was rotated and rounded by the compressor
        w = F.linear(x, self.weights_proj.weight) if w is None else w
        w = w.float() * (self.head_dim ** -0.5 * self.n_heads ** -0.5)
        s = matmul_f32(q.flatten(1, 2), k.transpose(1, 2)).view(B, T, self.n_heads, -1).relu()
        if torch.compiler.is_compiling():  # inductor fuses the ReLU, product and sum into one pass over s
            return (s * w[..., None]).sum(2)
        return torch.einsum("bths,bth->bts", s, w)  # eager: a batched GEMV

    def forward(self, x, qr, args, visible, replay=None, pos=None):
        # visible: [T, S] (or [B, T, S] packed) causal visibility of compressed entries -> bool [B, T, S] selected
        # entries. replay [B, T, index_topk] (replay.py): the entries the engine's indexer picked (-1: none), taken
        # instead of these scores' picks, which are then not computed (they give the LM loss no gradient either way).
        # pos: positions within packed samples (Attention.forward), or None
        if replay is not None:
            return picks_mask(replay, visible.shape[-1]) & visible  # a replayed pick never reaches the future
        B, T, _ = x.shape
        k = self.compressor(x, args, pos)
        cos, sin = rope_cos_sin(args, 4, torch.arange(T, device=x.device) if pos is None else pos)
        score = self.scores(x, qr, k, cos, sin).masked_fill(~visible, float("-inf"))
        return top_k_mask(score, self.topk) & visible  # picks that landed on invisible entries mean "no entry"


def top_k_mask(score, k):
    """bool [..., S]: each row's k largest scores, ties (several entries at score 0 after the indexer's ReLU) going to
    the earliest entry, whatever the row's length, so padding or decoding never changes the pick: the first k of a
    stable descending sort, without the sort: the k-th largest value by topk, then a running count of the ties."""
    if k >= score.shape[-1]:
        return torch.ones_like(score, dtype=torch.bool)
    kth = score.topk(k, dim=-1, sorted=False).values.amin(-1, keepdim=True)
    above, tie = score > kth, score == kth
    return above | (tie & (tie.cumsum(-1) <= k - above.sum(-1, keepdim=True)))


def mask_picks(mask, k):
    """bool [..., S], at most k set a row -> int32 [..., k]: the set entries in ascending order, then -1 (the rows of
    SGLang's indexer_topk). A row's k smallest of (entry if set, else S), with k more S appended for short rows."""
    S = mask.shape[-1]
    key = torch.where(mask, torch.arange(S, device=mask.device), S)
    key = torch.cat([key, key.new_full((*key.shape[:-1], k), S)], dim=-1)
    first = key.topk(k, dim=-1, largest=False).values  # ascending
    return torch.where(first == S, -1, first).int()


def picks_mask(picks, S):
    """mask_picks' inverse: int [..., k] (-1: none) -> bool [..., S]."""
    hit = torch.zeros(*picks.shape[:-1], S + 1, dtype=torch.bool, device=picks.device)
    return hit.scatter_(-1, torch.where(picks < 0, S, picks).long(), True)[..., :S]


def sink_attention(q, kv, mask, sink, scale):
    """Softmax attention where a per-head sink logit enlarges the denominator only.
    q: [B, T, H, d], kv: [B, L, d] (K == V), mask: bool [B or 1, T, L], sink: [H] -> [B, T, H, d]"""
    logits = torch.einsum("bthd,bld->bhtl", q.float(), kv.float()) * scale
    logits = logits.masked_fill(~mask[:, None], float("-inf"))
    sinks = sink.float().view(1, -1, 1, 1).expand(*logits.shape[:3], 1)
    probs = torch.cat([logits, sinks], dim=-1).softmax(dim=-1)[..., :-1]
    return torch.einsum("bhtl,bld->bthd", probs.to(kv.dtype), kv)


class Attention(nn.Module):
    """Shared-KV MQA with a low-rank query, sliding window + optional compressed keys, and an attention sink."""
    fast = False  # set by Transformer.set_kernels ('attention'): the window attention by blocks (training, prefill)
    fast_decode = False  # ('decode_attention'): the engine's decode step: fused projections, Triton kernels
    fused = None  # decode's input projections in one tensor, the weights views of it: Transformer.fuse_projections
    FP32 = ("compressor.wkv", "compressor.wgate", "indexer.compressor.wkv", "indexer.compressor.wgate")  # fp32 out
    def __init__(self, layer_id, args):
        super().__init__()
        self.args, self.layer_id = args, layer_id
        self.ratio = args.compress_ratios[layer_id]
        H, d = args.num_attention_heads, args.head_dim
        self.n_heads, self.head_dim, self.softmax_scale = H, d, d ** -0.5
        self.wq_a = FP8Linear(args.hidden_size, args.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(args.q_lora_rank, args.rms_norm_eps)
        self.wq_b = FP8Linear(args.q_lora_rank, H * d, bias=False)
        self.wkv = FP8Linear(args.hidden_size, d, bias=False)
        self.kv_norm = RMSNorm(d, args.rms_norm_eps)
        self.wo_a = nn.Linear(H * d // args.o_groups, args.o_groups * args.o_lora_rank, bias=False)
        self.wo_b = FP8Linear(args.o_groups * args.o_lora_rank, args.hidden_size, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(H, dtype=torch.float32))
        self.compressor = Compressor(args, self.ratio, d) if self.ratio else None
        self.indexer = Indexer(args) if self.ratio == 4 else None

    def fused_names(self):
        """The projections of the attention's input in the fused tensor's order
        (dsv4_kernels.fast.fused_projections)."""
        comp = ["compressor.wkv", "compressor.wgate"] if self.compressor is not None else []
        index = ["indexer.compressor.wkv", "indexer.compressor.wgate", "indexer.weights_proj"] if self.indexer else []
        return ["wq_a", "wkv"] + comp + index

    @cached_property
    def fused_linears(self):
        """The modules of fused_names(), looked up once (the module tree is fixed; Transformer.fuse_projections checks
        them before every decode step)."""
        return [self.get_submodule(n) for n in self.fused_names()]

    def query(self, x, cos, sin, qa=None):
        # x: [B, T, D] -> q [B, T, H, d] (unweighted per-head RMSNorm, RoPE on the last rd dims), qr [B, T, q_lora];
        # qa: wq_a(x) if computed already (dsv4_kernels.fast.fused_projections), as kv in window_kv
        B, T, _ = x.shape
        qr = self.q_norm(self.wq_a(x) if qa is None else qa)
        q = self.wq_b(qr).view(B, T, self.n_heads, self.head_dim)
        if self.fast_decode and T == 1 and has_triton(q) and not torch.is_grad_enabled():  # decode: a Triton kernel
            return q_norm_rope_triton(q, cos, sin, self.args.rms_norm_eps), qr
        q = q * torch.rsqrt(q.float().square().mean(-1, keepdim=True) + self.args.rms_norm_eps).to(q.dtype)
        return apply_rope(q, cos.unsqueeze(-2), sin.unsqueeze(-2)), qr

    def window_kv(self, x, cos, sin, kv=None):
        # x: [B, T, D] -> [B, T, d], one head shared by all query heads, used as both key and value
        kv = apply_rope(self.kv_norm(self.wkv(x) if kv is None else kv), cos, sin)
        return kv_quant_sim(kv, self.args.qk_rope_head_dim) if self.wkv.fp8_emu else kv  # spec §2.3 step 5

    def output(self, o, cos, sin, rotated=True):
        # o: [B, T, H, d]; undo RoPE on the value's rope slice at the query position (rotated=False: done already),
        # then grouped wo_a, wo_b
        B, T = o.shape[:2]
        o = apply_rope(o, cos.unsqueeze(-2), -sin.unsqueeze(-2)) if rotated else o
        g = self.args.o_groups
        wo_a = weight_round_sim(self.wo_a.weight) if self.wo_b.fp8_train else self.wo_a.weight  # FP8 stored, bf16 used
        wo_a = wo_a.view(g, self.args.o_lora_rank, -1)  # [g, o_rank, H*d/g]
        u = torch.einsum("btgi,goi->btgo", o.reshape(B, T, g, -1), wo_a)
        return self.wo_b(u.flatten(2))

    def forward(self, x, index=None, picked=False, seg=None):
        # x: [B, T, D] -> [B, T, D]; index: the indexer's replayed picks (Indexer.forward's replay). picked: also return
        # the compressed entries each query read, bool [B or 1, T, S] (None if none): the engine records a CSA layer's.
        # seg [B, T]: packed samples (grpo.make_microbatches), each starting at a multiple of every compress ratio; a
        # token sees only its own sample's keys and entries, at positions counted from the sample's start
        B, T, _ = x.shape
        idx = torch.arange(T, device=x.device)
        pos = idx if seg is None else sample_positions(seg)  # [T] or [B, T]
        cos, sin = rope_cos_sin(self.args, self.ratio, pos)
        q, qr = self.query(x, cos, sin)
        kv, ckv, cmask = self.window_kv(x, cos, sin), None, None
        if self.ratio:
            ckv = self.compressor(x, self.args, None if seg is None else pos)  # [B, S, d]
            S = ckv.shape[1]
            # entry s covers tokens up to s*ratio + ratio - 1, so query t sees s < (t + 1) // ratio
            visible = torch.arange(S, device=x.device)[None, :] < ((idx + 1) // self.ratio)[:, None]  # [T, S]
            if seg is not None:  # and only its own sample's entries: [B, T, S]
                visible = visible & (seg[:, :, None] == seg[:, None, :S * self.ratio:self.ratio])
            cmask = (self.indexer(x, qr, self.args, visible, index, None if seg is None else pos)
                     if self.indexer is not None else visible if seg is not None else visible[None])
        if self.fast:  # dsv4_kernels/fast.py: the same softmax by blocks of `sliding_window` queries
            o = window_attention(q, kv, ckv, cmask, self.attn_sink, self.softmax_scale, self.args.sliding_window, seg)
        else:  # window: key j visible from query t iff t - window < j <= t (and in t's own sample)
            mask = ((idx[None, :] <= idx[:, None]) & (idx[None, :] > idx[:, None] - self.args.sliding_window))[None]
            if seg is not None:
                mask = mask & (seg[:, :, None] == seg[:, None, :])
            if self.ratio:
                kv = torch.cat([kv, ckv], dim=1)
                mask = torch.cat([mask.expand(cmask.shape[0], -1, -1), cmask], dim=-1)
            o = sink_attention(q, kv, mask, self.attn_sink, self.softmax_scale)
        o = self.output(o, cos, sin)
        return (o, cmask) if picked else o


# -----------------------------------------------------------------------------
# mHC: n residual streams, mixed by a doubly-stochastic matrix (the functions: mhc.py)

class Block(nn.Module):
    """One layer: attention and MoE sublayers, each wrapped by hc_pre (n streams -> 1) and hc_post (1 -> n)."""
    fast = False  # set by Transformer.set_kernels: hc_pre's mixes on tensor cores, its Sinkhorn and hc_post in Triton
    def __init__(self, layer_id, args, ep_group=None):
        super().__init__()
        self.args, self.layer_id = args, layer_id
        n, D = args.hc_mult, args.hidden_size
        self.attn_norm = RMSNorm(D, args.rms_norm_eps)
        self.attn = Attention(layer_id, args)
        self.ffn_norm = RMSNorm(D, args.rms_norm_eps)
        self.ffn = MoE(layer_id, args, ep_group)
        for sub in ("attn", "ffn"):  # fp32, as in the checkpoint
            self.register_parameter(f"hc_{sub}_fn", nn.Parameter(torch.empty((2 + n) * n, n * D, dtype=torch.float32)))
            self.register_parameter(f"hc_{sub}_base", nn.Parameter(torch.zeros((2 + n) * n, dtype=torch.float32)))
            self.register_parameter(f"hc_{sub}_scale", nn.Parameter(torch.ones(3, dtype=torch.float32)))

    def hc_pre(self, x, fn, scale, base, norm=None):
        # x: [B, T, n, D] -> input [B, T, D] (through norm, the sublayer's RMSNorm, if given), post [B, T, n],
        # comb [B, T, n, n]
        a = self.args
        # a decode step's few tokens only (T == 1): a compiled prefill that branched on its size would compile again
        if (self.fast and has_triton(x) and not torch.is_grad_enabled() and x.shape[1] == 1
                and x.shape[0] <= HC_PRE_TOKENS):
            return hc_pre_triton(x, fn, scale, base, a.hc_sinkhorn_iters, a.hc_eps, a.rms_norm_eps,  # the norm in
                                 *((norm.weight, norm.eps) if norm is not None else ()))  # the kernel
        xf = x.float()  # before the mixes' GEMM, as in dsv4_kernels.fast._HcMixes.forward
        pre, post, comb = hc_split_sinkhorn(hc_mixes(x, fn, a.rms_norm_eps, self.fast), scale, base, a.hc_mult,
                                            a.hc_sinkhorn_iters, a.hc_eps, self.fast)
        h = (pre.unsqueeze(-1) * xf).sum(dim=2).to(x.dtype)
        return h if norm is None else norm(h), post, comb

    def hc_post(self, f, x, post, comb):
        # stream k <- post_k * f + sum_j comb[j, k] * x_j: the residual mix uses comb *transposed*
        if self.fast and has_triton(x) and torch.is_grad_enabled():  # training on a GPU: Triton, for the
            return hc_post_triton(f, x, post, comb)  # backward's sums over D in one pass
        y = post.unsqueeze(-1) * f.float().unsqueeze(-2)
        if torch.compiler.is_compiling():  # a sum over the n input streams, which compile fuses into one kernel;
            for j in range(x.shape[-2]):   # eager runs the batched matmul faster
                y = y + comb[..., j, :].unsqueeze(-1) * x[..., j, None, :].float()
            return y.to(x.dtype)
        return (y + torch.matmul(comb.transpose(-1, -2), x.float())).to(x.dtype)

    def forward(self, x, ids, experts=None, index=None, stats=None, seg=None):
        # x: [B, T, n, D], ids: [B, T] (hash routing reads the input token ids) -> [B, T, n, D]. The rollout engine's
        # picks to replay (Transformer.replay_kwargs): experts [B, T, K] for the router (and stats: Gate.forward's),
        # index [B, T, index_topk] for a CSA layer's indexer. seg: packed samples (Attention.forward)
        h, post, comb = self.hc_pre(x, self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base, self.attn_norm)
        x = self.hc_post(self.attn(h, index, seg=seg), x, post, comb)
        h, post, comb = self.hc_pre(x, self.hc_ffn_fn, self.hc_ffn_scale, self.hc_ffn_base, self.ffn_norm)
        return self.hc_post(self.ffn(h, ids, experts, stats), x, post, comb)


class MTPBlock(Block):
    """Multi-token prediction (mtp.0): from the trunk's streams at t and the embedding of token t+1,
    predict token t+2. Shares embed and head with the trunk; has its own hc_head."""
    def __init__(self, layer_id, args, ep_group=None):
        super().__init__(layer_id, args, ep_group)
        n, D = args.hc_mult, args.hidden_size
        self.e_proj = FP8Linear(D, D, bias=False)
        self.h_proj = FP8Linear(D, D, bias=False)
        self.enorm, self.hnorm, self.norm = (RMSNorm(D, args.rms_norm_eps) for _ in range(3))
        self.hc_head_fn = nn.Parameter(torch.empty(n, n * D, dtype=torch.float32))
        self.hc_head_base = nn.Parameter(torch.zeros(n, dtype=torch.float32))
        self.hc_head_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))

    def forward(self, x, e, ids):
        # x: [B, T, n, D] trunk streams, e: [B, T, D] embeddings of the next tokens, ids: those tokens
        x = self.e_proj(self.enorm(e)).unsqueeze(2) + self.h_proj(self.hnorm(x))
        x = super().forward(x, ids)
        return self.norm(hc_head(x, self.hc_head_fn, self.hc_head_scale, self.hc_head_base, self.args, self.fast))


# -----------------------------------------------------------------------------
# the model

FP32_NAMES = ("hc_", "attn_sink", "ape", "norm.weight", "gate.bias")  # tensors kept in fp32 whatever the dtype


# set_kernels' names, one a fast path (kernel_check.py); gemm_f32 and fp8_gemm are the whole process's switches
# (dsv4_kernels.fast.GEMM_F32, dsv4_kernels.fp8.FP8_GEMM)
KERNEL_PATHS = ("gemm_f32", "attention", "decode_attention", "mhc", "experts", "routing", "sampling", "fp8_gemm")


class Transformer(nn.Module):
    """The whole model, or (built by parallel.py) one pipeline stage of it: `layers` is a dict keyed by the
    global layer index, so a stage keeps the official names; a stage's missing ends are None."""
    invariant = False  # path-invariant numerics: set_invariant
    fast = False  # the head's mHC mixes on tensor cores, as the blocks' (set_kernels)
    fast_sampling = False  # the engine samples in Triton (set_kernels: 'sampling')
    loss_chunk = 1024  # head_loss: tokens whose logits exist at once (V4's 129k vocabulary: 0.53 GB of fp32 logits)
    temperature = 1.0  # head_loss: logprobs of softmax(logits / temperature), the rollouts' sampling temperature

    def __init__(self, args: ModelArgs, dtype=torch.bfloat16, ep_group=None):
        super().__init__()
        self.args = args
        n, D = args.hc_mult, args.hidden_size
        self.embed = nn.Embedding(args.vocab_size, D)
        self.layers = nn.ModuleDict({str(i): Block(i, args, ep_group) for i in range(args.num_hidden_layers)})
        self.norm = RMSNorm(D, args.rms_norm_eps)
        self.head = nn.Linear(D, args.vocab_size, bias=False)
        self.hc_head_fn = nn.Parameter(torch.empty(n, n * D, dtype=torch.float32))
        self.hc_head_base = nn.Parameter(torch.zeros(n, dtype=torch.float32))
        self.hc_head_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))
        self.mtp = nn.ModuleList(MTPBlock(args.num_hidden_layers + i, args, ep_group)
                                 for i in range(args.num_nextn_predict_layers))
        if self.embed.weight.device.type != "meta":
            self.init_weights()
        self.set_dtype(dtype)

    @torch.no_grad()
    def init_weights(self, seed=0, draw_on="cpu"):
        """From-scratch init of every tensor: normal(0, initializer_range) matrices, unit norms and mHC scales,
        zero biases, sinks and ape, a hash table with distinct experts per row. Each tensor draws from a
        generator seeded by its name, so a pipeline stage or an expert shard gets exactly the values the
        whole model would. draw_on: the device whose generator draws (the CPU's give every machine the same
        values; a GPU's draw tens of GB in seconds, other values: bench.py)."""
        for name, t in list(self.named_parameters()) + list(self.named_buffers()):
            g = torch.Generator(draw_on).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            if name.endswith("tid2eid"):
                E, K = self.args.n_routed_experts, self.args.num_experts_per_tok
                t.copy_(torch.rand(t.shape[0], E, generator=g, device=draw_on).argsort(dim=-1)[:, :K])
            elif t.dim() == 2 and not name.endswith("ape"):
                t.copy_(torch.randn(t.shape, generator=g, device=draw_on) * self.args.initializer_range)
            elif name.endswith("norm.weight") or name.endswith("_scale"):
                t.fill_(1.0)
            else:  # mHC bases, sinks, ape, router bias
                t.zero_()

    def set_dtype(self, dtype):
        """Cast to the compute dtype, keeping the reference's fp32 tensors (mHC, sinks, ape, norms, gate bias)."""
        for name, t in list(self.named_parameters()) + list(self.named_buffers()):
            if t.is_floating_point() and not any(k in name for k in FP32_NAMES):
                t.data = t.data.to(dtype)
        self.dtype = dtype
        return self

    def set_fp8_emulation(self, on=True):
        """The reference's FP8 numerics (spec §2.7, quant.py *_sim), straight-through grads: FP8 activations into
        the FP8/FP4 linears, KV FP8 round trip, indexer Hadamard + FP4. Off (default) is bit-identical."""
        for m in (m for m in self.modules() if hasattr(m, "fp8_emu")):
            m.fp8_emu = on
        return self

    def set_fp8_training(self, on=True):
        """train_quant='fp8': the FP8 engine's forward (set_fp8_emulation), with every FP8-stored weight rounded as
        weight_sync sends it, on the fly from the full-precision one, and FP8 dgrads (quant.py's FP8 training)."""
        self.set_fp8_emulation(on)
        for m in (m for m in self.modules() if isinstance(m, FP8Linear)):
            m.fp8_train = on
        return self

    def set_kernels(self, fast=True):
        """The fast paths of dsv4_kernels/ or the plain reference beside each call: True all, False none (both leave
        the process-wide gemm_f32 and fp8_gemm as they are), or a collection of KERNEL_PATHS names, those on and the
        others off, gemm_f32 and fp8_gemm included. kernel_check.py says what each takes, and chooses for 'auto'."""
        on = set(KERNEL_PATHS) if fast is True else set() if fast is False else set(fast)
        if on - set(KERNEL_PATHS):
            raise ValueError(f"unknown kernel path(s) {sorted(on - set(KERNEL_PATHS))}: the paths are "
                             f"{', '.join(KERNEL_PATHS)}")
        flags = {"attention": (Attention, "fast"), "decode_attention": (Attention, "fast_decode"),
                 "mhc": ((Block, Transformer), "fast"), "experts": (MoE, "fast"), "routing": (MoE, "fast_routing"),
                 "sampling": (Transformer, "fast_sampling")}
        for m in self.modules():
            for path, (kinds, flag) in flags.items():
                if isinstance(m, kinds):
                    setattr(m, flag, path in on)
        if not isinstance(fast, bool):
            use_gemm_f32("gemm_f32" in on)
            use_fp8_gemm("fp8_gemm" in on)
        return self

    def stack_experts(self):
        """With the kernels on, each MoE's local experts in two stacked tensors that the grouped GEMM reads in place,
        the experts' parameters views of them (dsv4_kernels.fast.stack_experts). Every forward calls this first:
        it re-stacks what a cast or a load replaced. Returns whether it stacked anything."""
        return stack_experts([block.ffn for block in (*self.layers.values(), *self.mtp)])

    def fuse_projections(self):
        """The engine's decode, kernels on: each layer's attention projections of one input in one tensor, run as one
        GEMM (dsv4_kernels.fast.fuse_projections). Returns whether it fused anything."""
        return fuse_projections([block.attn for block in self.layers.values()])

    def set_invariant(self, on=True):
        """Path-invariant numerics (compare_logprobs --invariant, server.py --invariant): a token's logprob
        no longer depends on how it was computed (one full forward, or prefill + KV-cache decode in a batch of any
        size). Every sum and transcendental function in fp64 (dsv4_kernels.invariant.PathInvariant, entered by
        numerics()), with the reference paths (grouped_mm has no fp64). Weights and activations keep their dtype."""
        self.invariant = on
        return self.set_kernels(False) if on else self

    def numerics(self):
        """The context each forward and engine step runs in: PathInvariant once set_invariant (unless one is active
        already: a caller scoring with the mode on, whose forward would enter it again), else none."""
        active = isinstance(torch.utils._python_dispatch._get_current_dispatch_mode(), PathInvariant)
        return PathInvariant() if self.invariant and not active else contextlib.nullcontext()

    def embed_streams(self, input_ids):
        # [B, T] -> [B, T, n, D]: n plain copies of the embedding
        h = self.embed(input_ids)
        return h.unsqueeze(2).expand(-1, -1, self.args.hc_mult, -1).contiguous()

    def head_input(self, x):
        # [B, T, n, D] -> [B, T, D]: the streams collapsed, then the final norm
        return self.norm(hc_head(x, self.hc_head_fn, self.hc_head_scale, self.hc_head_base, self.args, self.fast))

    def logits(self, x):
        # [B, T, n, D] -> fp32 [B, T, vocab]
        return linear_f32(self.head_input(x), self.head.weight)

    def head_loss(self, x, mb, fn):
        """The last pipeline stage's tail: fn(logprob of each target mb["tgt"], entropy, mb), both fp32 [B, T], of
        softmax(logits / self.temperature), from the streams x. The head's logits exist loss_chunk tokens at a time
        (chunked_head.py), so the loss's memory does not grow with the micro-batch's length; compiled as one graph
        (compile_policy.compile_model)."""
        logp, entropy = token_stats(self.head_input(x), self.head.weight, mb["tgt"], self.loss_chunk,
                                    self.temperature)
        return fn(logp, entropy, mb)

    def replay_kwargs(self, replay, stats=None):
        """Block.forward's replayed picks, a dict for each of this model's (or pipeline stage's) layers in order, from
        replay["routed_experts"] [B, T, layers, K] and replay["indexer_topk"] [B, T, CSA layers, index_topk] of these
        layers (replay.py; either may be absent). stats: a list, to which each replaying router's counts are added."""
        out, experts, index, c = [], replay.get("routed_experts"), replay.get("indexer_topk"), 0
        for j, layer in enumerate(self.layers.values()):
            out.append({})
            if experts is not None:
                out[-1]["experts"] = experts[:, :, j]
                if stats is not None:
                    stats.append(out[-1].setdefault("stats", torch.zeros(2, device=experts.device)))
            if index is not None and layer.attn.indexer is not None:
                out[-1]["index"], c = index[:, :, c], c + 1
        return out

    def forward(self, input_ids, mtp=False, replay=None, stats=None, seg=None):
        """input_ids [B, T] -> fp32 logits [B, T, vocab]. With mtp=True also the MTP logits
        [B, T-1, vocab], where position t predicts token t+2. replay, stats: replay_kwargs' (the MTP layer routes
        itself: the engine reports the trunk's layers only). seg [B, T]: several samples packed in a row
        (Attention.forward), each as if alone."""
        self.stack_experts()
        with self.numerics():
            x = self.embed_streams(input_ids)
            for layer, kw in zip(self.layers.values(), self.replay_kwargs(replay or {}, stats)):
                x = layer(x, input_ids, seg=seg, **kw)
            logits = self.logits(x)
            if not mtp:
                return logits
            assert len(self.mtp) > 0, "this model has no MTP layer (num_nextn_predict_layers = 0)"
            nxt = input_ids[:, 1:]
            h = self.mtp[0](x[:, :-1], self.embed(nxt), nxt)
            return logits, linear_f32(h, self.head.weight)


# -----------------------------------------------------------------------------

def self_check():
    """`python model_dsv4.py`: on CPU in seconds, shapes, causality, a state-dict round trip through safetensors, and a
    few steps of overfitting (checkpoint.py's own self-check covers the official checkpoint layout)."""
    import tempfile, time
    from safetensors.torch import load_file, save_file
    t0 = time.time()
    torch.manual_seed(0)
    args = ModelArgs()
    model = Transformer(args, dtype=torch.float32)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"tiny DeepSeek-V4: {n_params / 1e6:.1f}M parameters, layer ratios {args.compress_ratios}")
    ids = torch.randint(2, args.vocab_size, (2, 96))
    logits, mtp_logits = model(ids, mtp=True)
    assert logits.shape == (2, 96, args.vocab_size) and mtp_logits.shape == (2, 95, args.vocab_size)
    print(f"forward: logits {tuple(logits.shape)}, MTP logits {tuple(mtp_logits.shape)}")
    ids2 = ids.clone()
    ids2[:, 60:] = torch.randint(2, args.vocab_size, (2, 36))
    # the prefix's logits stay put, but for rounding: the later tokens' routing changes the shapes of the experts'
    # GEMMs, in which the CPU's BLAS may sum a row in another order
    moved = (model(ids2)[:, :60] - logits[:, :60]).abs().max().item()
    print(f"causality: logits before the changed tokens moved by {moved:.1e}")
    assert moved <= 1e-5 * logits.abs().max().item(), "causality broken"
    with tempfile.TemporaryDirectory() as d:
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, f"{d}/model.safetensors")
        reloaded = Transformer(args, dtype=torch.float32)
        reloaded.init_weights(seed=1)  # other values, so a load that misses a tensor shows
        reloaded.load_state_dict(load_file(f"{d}/model.safetensors"))
    diff = (reloaded(ids) - logits).abs().max().item()
    print(f"save/load round trip: max |diff| = {diff:.2e}")
    assert diff == 0, "the reloaded model computes other logits"
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batch = torch.randint(2, 64, (4, 64))
    losses = []
    for step in range(8):
        loss = F.cross_entropy(model(batch)[:, :-1].flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    print(f"overfit: loss {losses[0]:.3f} -> {losses[-1]:.3f} in 8 steps")
    assert losses[-1] < 0.7 * losses[0], "8 steps of AdamW did not fit a fixed batch"
    print(f"self-check passed in {time.time() - t0:.1f}s")


if __name__ == "__main__":
    self_check()
