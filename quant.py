"""FP8 / FP4 block quantization as used by DeepSeek-V4 (spec sections 2.7 and 4.3-4.5). Uses:
  * checkpoint formats: FP8 e4m3 weights with one e8m0 scale per 128x128 block, and FP4 e2m1 routed experts packed
    two per byte with one e8m0 scale per 32 inputs of a row;
  * quantized serving (rollout_quant): which tensors are quantized, and what travels for them (weight_sync.py sends
    it, server.py serves from it);
  * QAT simulations in the forward pass: quantize then dequantize activations along the last dim (the FP8 engine's
    numerics: set_fp8_emulation, and server.py's W8A8 under --quant);
  * FP8 training (train_quant='fp8'): the FP8 linears' forward and dgrad in FP8 from the full-precision weights, as
    FP8 GEMMs on a Hopper GPU (dsv4_kernels/fp8.py), else the same numbers through this file's reference.

Scales are powers of two stored as e8m0 (byte b means 2^(b-127), b=255 is NaN). We compute the exponent ourselves:
torch's float -> float8_e8m0fnu cast rounds to the nearest power of two (1.25 -> 1), but the reference wants
2^ceil(log2(amax/qmax)), so that amax/scale never exceeds qmax.
"""
import re

import torch
import torch.nn.functional as F

import dsv4_kernels.fp8 as fp8_kernels

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP4_MAX = 6.0    # largest e2m1 value
FP8_AMAX_MIN = 1e-4            # reference act_quant clamp: all-zero blocks must not give scale 0
FP4_AMAX_MIN = 6.0 * 2.0**-126  # keeps the FP4 scale >= 2^-126, the smallest normal float32

# e2m1 code -> value. Codes 0-7 are the magnitudes, bit 3 is the sign.
E2M1_VALUES = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def e8m0_to_float(scale):
    """e8m0 scales (float8_e8m0fnu or raw uint8 bytes) -> float32. Float scales pass through."""
    if scale.dtype == torch.float8_e8m0fnu:
        scale = scale.view(torch.uint8)
    if scale.dtype != torch.uint8:
        return scale.float()
    b = scale.to(torch.int32)
    # The float32 bit pattern, built directly so the result is exact: exponent field b gives 2^(b-127). b=0 is 2^-127,
    # a float32 subnormal (mantissa bit 22 set). b=255 is NaN.
    bits = torch.where(b == 0, torch.full_like(b, 1 << 22), b << 23)
    bits = torch.where(b == 255, torch.full_like(b, 0x7FC00000), bits)
    return bits.view(torch.float32)


def _pow2_ceil_byte(x):
    """e8m0 byte of 2^ceil(log2(x)) for x > 0, exactly from the float32 exponent: frexp gives x = m * 2^e with m in
    [0.5, 1); ceil(log2 x) is e-1 when m == 0.5 (x is an exact power of two) and e otherwise (log2() could be off by one
    near powers of two). Non-finite x gives byte 255 (NaN scale), so NaN/inf inputs stay visible after dequant."""
    m, e = torch.frexp(x.float())
    byte = (torch.where(m == 0.5, e - 1, e) + 127).clamp(0, 254)
    return torch.where(torch.isfinite(x), byte, 255).to(torch.uint8)


def _pad_to(x, dim, mult):
    """Zero-pad x along dim up to a multiple of mult. Zeros never change a block's amax."""
    pad = -x.shape[dim] % mult
    return F.pad(x, [0, 0] * (x.dim() - 1 - dim % x.dim()) + [0, pad]) if pad else x


def fp8_block_quantize(w, block=128, scale_fmt="ue8m0"):
    """w [..., out, in] -> (float8_e4m3fn [..., out, in], scale [..., ceil(out/block), ceil(in/block)]): each matrix
    of a stack (the experts') by its own blocks. scale_fmt "ue8m0": the scale is 2^ceil(log2(amax/448)) as
    float8_e8m0fnu (checkpoint format); "fp32": amax/448 as float32."""
    assert w.dim() >= 2, f"expected a weight of 2 or more dims, got shape {tuple(w.shape)}"
    assert scale_fmt in ("ue8m0", "fp32"), scale_fmt
    *lead, out_f, in_f = w.shape
    wf = _pad_to(_pad_to(w.float(), -2, block), -1, block)
    R, C = wf.shape[-2] // block, wf.shape[-1] // block
    blocks = wf.view(*lead, R, block, C, block)
    amax = blocks.abs().amax(dim=(-3, -1)).clamp(min=FP8_AMAX_MIN)  # [..., R, C]
    if scale_fmt == "ue8m0":
        byte = _pow2_ceil_byte(amax / FP8_MAX)
        s, scale = e8m0_to_float(byte), byte.view(torch.float8_e8m0fnu)
    else:
        s = scale = amax / FP8_MAX
    q = (blocks / s[..., None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)  # to nearest, ties to even
    return q.view(*lead, R * block, C * block)[..., :out_f, :in_f].contiguous(), scale


def fp8_block_dequantize(w_e4m3, scale, dtype=torch.float32, block=128):
    """Inverse of fp8_block_quantize: W[..., o, i] = fp8[..., o, i] * scale[..., o // block, i // block]."""
    out_f, in_f = w_e4m3.shape[-2:]
    s = e8m0_to_float(scale)
    assert s.shape[-2:] == (-(-out_f // block), -(-in_f // block)), \
        f"scale shape {tuple(s.shape)} does not match weight {out_f}x{in_f} with block {block}"
    s = s.repeat_interleave(block, -2).repeat_interleave(block, -1)[..., :out_f, :in_f]
    return (w_e4m3.float() * s).to(dtype)


def _e2m1_round(v):
    """Round float32 v (already clamped to [-6, 6]) to the nearest e2m1 value.

    The e2m1 grid 0, 0.5, 1, 1.5, 2, 3, 4, 6 has step 0.5 below 2, step 1 in [2, 4) and step 2 in [4, 6]. Dividing by
    the local step turns each segment into integers, and on every segment the even integers are exactly the grid points
    whose mantissa bit is 0. So torch.round (round half to even) gives IEEE-style ties-to-even-mantissa: 0.25 -> 0,
    0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4. The sign is kept, so small negatives round to -0."""
    a = v.abs()
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))
    return torch.copysign(torch.round(a / step) * step, v)


def fp4_quantize(w, group=32):
    """w [out, in] -> (int8 [out, in/2] with two e2m1 codes per byte, e8m0 scale [out, in/group]). Byte j of a row
    holds element 2j in the low nibble and element 2j+1 in the high nibble."""
    assert w.dim() == 2, f"expected a 2-D weight, got shape {tuple(w.shape)}"
    out_f, in_f = w.shape
    assert in_f % group == 0, f"in={in_f} must be divisible by group={group}"
    assert group % 2 == 0, f"group={group} must be even to pack two codes per byte"
    g = w.float().view(out_f, in_f // group, group)
    amax = g.abs().amax(dim=-1).clamp(min=FP4_AMAX_MIN)
    byte = _pow2_ceil_byte(amax / FP4_MAX)
    v = _e2m1_round((g / e8m0_to_float(byte)[..., None]).clamp(-FP4_MAX, FP4_MAX))
    # value -> code: magnitude index on the e2m1 grid (exact match, so bucketize finds it), plus 8 for the sign bit
    mag = torch.bucketize(v.abs(), E2M1_VALUES[:8].to(v.device))
    code = (mag + 8 * torch.signbit(v).long()).view(out_f, in_f)
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8)
    return packed.view(torch.int8), byte.view(torch.float8_e8m0fnu)


def fp4_dequantize(packed_int8, scale_e8m0, dtype=torch.float32):
    """Inverse of fp4_quantize: W[o, i] = table[nibble(o, i)] * scale[o, i // group]."""
    out_f, half = packed_int8.shape
    s = e8m0_to_float(scale_e8m0)
    assert s.shape[0] == out_f and (2 * half) % s.shape[1] == 0, \
        f"scale shape {tuple(s.shape)} does not fit packed weight {out_f}x{half}"
    b = packed_int8.view(torch.uint8).long()
    code = torch.stack([b & 0xF, b >> 4], dim=-1).view(out_f, 2 * half)
    group = 2 * half // s.shape[1]
    w = E2M1_VALUES.to(packed_int8.device)[code] * s.repeat_interleave(group, 1)
    return w.to(dtype)


def _scaled_blocks(x, block, qmax, amax_min):
    """x [..., K] in float32, zero-padded to whole blocks, as [..., K/block, block], and each block's power-of-two
    scale [..., K/block, 1]: 2^ceil(log2(amax / qmax)), so that no |x| / scale exceeds qmax."""
    xf = _pad_to(x.float(), -1, block)
    xb = xf.view(*xf.shape[:-1], xf.shape[-1] // block, block)
    amax = xb.abs().amax(dim=-1, keepdim=True).clamp(min=amax_min)
    return xb, e8m0_to_float(_pow2_ceil_byte(amax / qmax))


def _fake_quant(x, block, qmax, amax_min, round_):
    """Quantize-dequantize x with one power-of-two scale per `block` elements of the last dim (zero-padded to a
    multiple of it), rounding with round_. Same dtype out as in; the math runs in float32."""
    xb, s = _scaled_blocks(x, block, qmax, amax_min)
    return (round_((xb / s).clamp(-qmax, qmax)) * s).flatten(-2)[..., :x.shape[-1]].to(x.dtype)


def act_quant(x, block=128):
    """FP8 activations as an FP8 GEMM takes them: x [..., K] -> (e4m3 [..., K], float32 scales [..., ceil(K/block)]),
    one power-of-two scale per row per `block` inputs (spec §2.7: UE8M0, as V4's reference and the checkpoint's
    scale_fmt). q * scale is fake_quant_fp8(x)."""
    xb, s = _scaled_blocks(x, block, FP8_MAX, FP8_AMAX_MIN)
    return (xb / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).flatten(-2)[..., :x.shape[-1]], s[..., 0]


def act_dequant(q, scale, dtype, block=128):
    """Inverse of act_quant, in dtype (exact in bf16 and fp32: a 4-bit significand times a power of two)."""
    return (q.float() * scale.repeat_interleave(block, -1)[..., :q.shape[-1]]).to(dtype)


def fake_quant_fp8(x, block=128):
    """e4m3, one scale per `block` elements of the last dim (per token for activations)."""
    return _fake_quant(x, block, FP8_MAX, FP8_AMAX_MIN, lambda v: v.to(torch.float8_e4m3fn).float())


def fake_quant_fp4(x, block=32):
    """e2m1, one scale per `block` elements of the last dim (the indexer's FP4 sim, applied after hadamard())."""
    return _fake_quant(x, block, FP4_MAX, FP4_AMAX_MIN, _e2m1_round)


# -----------------------------------------------------------------------------
# FP8 reference numerics in the trainer (spec §2.7), switched on by Transformer.set_fp8_emulation(True). Each sim is a
# quantize-dequantize with a straight-through gradient: the forward sees the rounded value, the backward the identity.
# fq + (x - x.detach()) is exactly fq in any dtype, where x + (fq - x).detach() could round twice.

def straight_through(x, fq):
    return fq.detach() + (x - x.detach())


def act_quant_sim(x):
    """FP8 activations before an FP8/FP4 linear: e4m3, one power-of-two scale per token per 128 inputs."""
    return straight_through(x, fake_quant_fp8(x, 128))


def kv_quant_sim(kv, rope_dims):
    """The KV cache's FP8 round trip (spec §2.3 steps 5, 10): the non-RoPE dims only, block 64."""
    nope, rope = kv[..., :-rope_dims], kv[..., -rope_dims:]
    return torch.cat([straight_through(nope, fake_quant_fp8(nope, 64)), rope], dim=-1)


def index_quant_sim(x):
    """The indexer's q and compressed keys: Hadamard rotation, then FP4 e2m1 with block 32. The rotation is
    linear, so the gradient goes through it; only the rounding is straight-through."""
    x = hadamard(x)
    return straight_through(x, fake_quant_fp4(x, 32))


def fp8_round(w, parts=1, dtype=None):
    """w [..., N, K] rounded as the engine gets it (weight_sync: quantize_tensor), FP8 by 128 x 128 blocks, in dtype
    (w's by default; exact). parts: w's rows are that many matrices stacked, each quantized on its own (w1 and w3)."""
    q, scale = fp8_block_quantize(w.unflatten(-2, (parts, -1)))
    return fp8_block_dequantize(q, scale, dtype or w.dtype).flatten(-3, -2)


def weight_round_sim(w):
    """An FP8-stored weight multiplied without FP8 activations (wo_a, spec §2.7), rounded as the engine holds it:
    straight-through, so the full-precision weight learns."""
    return straight_through(w, fp8_round(w))


# -----------------------------------------------------------------------------
# FP8 training (train_quant='fp8'): the FP8 linears compute what the FP8 engine computes, with DeepSeek-V3's recipe
# for the backward (arXiv 2412.19437 §3.3). Forward: x in FP8 per row per 128 inputs (act_quant) times the weight
# rounded by 128 x 128 blocks (fp8_round: what weight_sync sends). dgrad: dy in FP8 per row per 128 times the same
# FP8 weight. wgrad: dy times the forward's FP8 x, in dy's dtype. The gradient reaches the weight as if unrounded
# (straight-through), and AdamW's fp32 master takes it. Saved for the backward: x in FP8 (a byte an element) and
# the weight itself, rounded again there rather than kept as a second copy.

def fp8_mm(a, a_scale, b, b_scale, dtype):
    """a [..., K] e4m3 with a scale per row per 128 inputs (act_quant), b [N, K] e4m3 with one e8m0 scale per
    128 x 128 block -> a @ b.T [..., N] in dtype: an FP8 GEMM's numerics, exact products summed in fp32. One FP8 GEMM
    where dsv4_kernels.fp8 runs these operands (a Hopper GPU, kernel path fp8_gemm); else the reference: both
    dequantized to dtype (exact) and multiplied."""
    a2, s2 = a.reshape(-1, a.shape[-1]), a_scale.reshape(-1, a_scale.shape[-1])
    if fp8_kernels.usable(a2, b):
        y = fp8_kernels.blockwise_mm(a2, s2, b, e8m0_to_float(b_scale), dtype)
    else:
        y = F.linear(act_dequant(a2, s2, dtype), fp8_block_dequantize(b, b_scale, dtype))
    return y.view(*a.shape[:-1], b.shape[0])


class FP8Matmul(torch.autograd.Function):
    """x [..., K] @ w.T (w [N, K]) in FP8, forward and dgrad (the section's comment says how)."""
    @staticmethod
    def forward(ctx, x, w):
        xq, xs = act_quant(x)
        ctx.save_for_backward(xq, xs, w)
        return fp8_mm(xq, xs, *fp8_block_quantize(w), x.dtype)

    @staticmethod
    def backward(ctx, dy):
        xq, xs, w = ctx.saved_tensors
        wq, ws = fp8_block_quantize(w)
        dx = fp8_mm(*act_quant(dy), wq.mT, ws.mT, dy.dtype)
        dw = dy.reshape(-1, dy.shape[-1]).mT @ act_dequant(xq, xs, dy.dtype).reshape(-1, xq.shape[-1])
        return dx, dw.to(w.dtype)


class FP8GroupedMatmul(torch.autograd.Function):
    """The routed experts' FP8Matmul: rows x [R, K] grouped by expert (offs [e]: each group's end row) times their
    expert's w [e, N, K] .T, w's rows `parts` matrices each rounded on its own. Torch has no grouped GEMM with block
    scales (its FP8 grouped GEMM scales whole rows), so the FP8 operands are dequantized, exactly, and multiplied by
    the bf16 grouped GEMM: the FP8 GEMM's numerics, a bf16 GEMM's speed."""
    @staticmethod
    def forward(ctx, x, w, offs, parts):
        xq, xs = act_quant(x)
        ctx.save_for_backward(xq, xs, w, offs)
        ctx.parts = parts
        return torch._grouped_mm(act_dequant(xq, xs, x.dtype), fp8_round(w, parts).mT, offs=offs)

    @staticmethod
    def backward(ctx, dy):
        xq, xs, w, offs = ctx.saved_tensors
        dx = torch._grouped_mm(fake_quant_fp8(dy), fp8_round(w, ctx.parts, dy.dtype), offs=offs)
        # wgrad: each group's dy.T @ x, grouped along the rows. dy.T is passed as the transposed view of dy, as
        # torch's own backward of _grouped_mm does: a row-major copy would make each expert's rows start on whole
        # 16 bytes (a multiple of 8 rows in bf16), which routing does not give (CUDA's device-side assert)
        dw = torch._grouped_mm(dy.contiguous().mT, act_dequant(xq, xs, dy.dtype), offs=offs)
        return dx, dw.to(w.dtype), None, None


def fp8_linear(x, w):
    return FP8Matmul.apply(x, w)


def fp8_grouped_mm(x, w, offs, parts=1):
    return FP8GroupedMatmul.apply(x, w, offs, parts)


class FP8Linear(torch.nn.Linear):
    """nn.Linear whose weight is FP8 (or FP4) in the checkpoint. fp8_emu (serving, compare_logprobs): its input goes
    through act_quant_sim first, the weight used as stored (the server holds it dequantized from FP8: exact, spec
    §2.7). fp8_train (train_quant='fp8'): fp8_linear, the weight rounded as the engine holds it. Off, nn.Linear."""
    fp8_emu = False
    fp8_train = False

    def forward(self, x):
        if self.fp8_train:
            return fp8_linear(x, self.weight)
        return F.linear(act_quant_sim(x) if self.fp8_emu else x, self.weight, self.bias)


def hadamard(x):
    """Normalized Walsh-Hadamard transform of the last dim (Sylvester order, scale 1/sqrt(n)): x @ H with H_1 = [1],
    H_2n = [[H_n, H_n], [H_n, -H_n]] / sqrt(2), orthonormal and symmetric, so applying it twice gives x back. No random
    signs (the reference has none). log2(n) butterfly passes in float32, returned in x's dtype."""
    n = x.shape[-1]
    assert n > 0 and n & (n - 1) == 0, f"last dim {n} must be a power of two"
    y, h = x.float(), 1
    while h < n:
        a, b = y.reshape(*x.shape[:-1], n // (2 * h), 2, h).unbind(-2)
        y, h = torch.stack([a + b, a - b], dim=-2), 2 * h
    return (y.reshape(x.shape) * n**-0.5).to(x.dtype)


# -----------------------------------------------------------------------------
# which tensors are quantized, and how they travel (spec §4.3-4.5): the name table of quantized serving

FP8_WEIGHTS = re.compile(r"(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|indexer\.wq_b|shared_experts\.w[123]|e_proj|h_proj)"
                         r"\.weight$")
FP4_WEIGHTS = re.compile(r"\.experts\.\d+\.w[123]\.weight$")  # routed experts (not shared_experts)
QUANT_MODES = ("none", "fp8", "fp8_fp4")


def quant_format(name, mode):
    """How an official tensor name is served under rollout_quant=mode: 'fp8', 'fp4' or None (as it is).
    fp8 serves routed experts in FP8 too (SGLANG_DSV4_FP4_EXPERTS=0, the FP8 repack); fp8_fp4 in FP4, as
    the official checkpoint ships them. Everything else (norms, router, compressors, mHC, tid2eid) stays."""
    if mode not in QUANT_MODES:
        raise ValueError(f"rollout_quant must be one of {QUANT_MODES}, got {mode!r}")
    if mode != "none" and FP4_WEIGHTS.search(name):
        return "fp4" if mode == "fp8_fp4" else "fp8"
    return "fp8" if mode != "none" and FP8_WEIGHTS.search(name) else None


def scale_name(name):
    return name[:-len("weight")] + "scale"  # official naming: layers.0.attn.wq_a.scale, no weight_scale_inv


def quantized_meta(name, shape, dtype, mode):
    """[(name, shape, dtype)] of what travels for one tensor: itself, or its quantized weight and .scale."""
    fmt, (o, i) = quant_format(name, mode), shape if len(shape) == 2 else (0, 0)
    if fmt == "fp8":
        return [(name, (o, i), torch.float8_e4m3fn),
                (scale_name(name), (-(-o // 128), -(-i // 128)), torch.float8_e8m0fnu)]
    if fmt == "fp4":
        return [(name, (o, i // 2), torch.int8), (scale_name(name), (o, i // 32), torch.float8_e8m0fnu)]
    return [(name, tuple(shape), dtype)]


def quantize_tensor(name, t, mode):
    """{name: t}, or the official quantized pair {name: weight, name.scale: e8m0 scale}."""
    if (fmt := quant_format(name, mode)) is None:
        return {name: t}
    q, s = fp8_block_quantize(t) if fmt == "fp8" else fp4_quantize(t)
    return {name: q, scale_name(name): s}


def dequantize(q, scale, dtype=torch.float32):
    """An FP8 (e4m3) or packed FP4 (int8) weight and its scale -> the weight in dtype (exact: powers of two)."""
    if q.dtype == torch.float8_e4m3fn:
        return fp8_block_dequantize(q, scale, dtype)
    if q.dtype == torch.int8:
        return fp4_dequantize(q, scale, dtype)
    raise ValueError(f"a weight with a .scale must be float8_e4m3fn or int8 (packed FP4), got {q.dtype}")


def as_bytes(t):
    """1-byte float formats viewed as uint8, for transports without float8 (gloo): the bytes are the format."""
    return t.view(torch.uint8) if t.is_floating_point() and t.element_size() == 1 else t
