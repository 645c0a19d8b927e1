"""Tests for quant.py against hand-computed values (CPU, fast)."""
import math, os, sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from quant import (e8m0_to_float, fake_quant_fp4, fake_quant_fp8, fp4_dequantize, fp4_quantize,
                   fp8_block_dequantize, fp8_block_quantize, hadamard)


def raw(t):  # raw bytes of a 1-byte-dtype tensor
    return t.view(torch.uint8).flatten().tolist()


def test_e8m0_decode_bytes():
    b = torch.tensor([0, 1, 127, 128, 254, 255], dtype=torch.uint8)
    want = [2.0**-127, 2.0**-126, 1.0, 2.0, 2.0**127]
    for s in (b, b.view(torch.float8_e8m0fnu)):
        f = e8m0_to_float(s)
        assert f.dtype == torch.float32
        assert f[:5].tolist() == want
        assert math.isnan(f[5].item())
    # fp32 scales pass through unchanged
    assert e8m0_to_float(torch.tensor([0.3])).tolist() == [pytest.approx(0.3)]


def test_fp8_scale_is_pow2_ceil():
    # One 128x128 block per case; amax/448 -> expected e8m0 byte 127 + ceil(log2(.)).
    cases = [(448.0 * 3, 129),           # 3 -> 4 = 2^2
             (448.0 * 4, 129),           # exactly 4: ceil keeps 2^2
             (448.0 * 4 * 1.001, 130),   # just above 4 -> 8
             (448.0 * 1.25, 128),        # 1.25 -> 2 (torch's e8m0 cast would give 1)
             (448.0, 127),
             (448.0 / 3, 126),           # 1/3 -> 1/2
             (0.0, 105)]                 # clamp 1e-4: 1e-4/448 = 2^-22.09 -> 2^-22
    for amax, byte in cases:
        w = torch.zeros(128, 128)
        w[5, 7] = -amax
        q, s = fp8_block_quantize(w)
        assert s.dtype == torch.float8_e8m0fnu and s.shape == (1, 1)
        assert raw(s) == [byte], (amax, raw(s))
    # amax 448*3 with scale 4 -> 336, a tie between e4m3 320 (mantissa 010) and 352 (011) -> 320
    w = torch.zeros(128, 128)
    w[0, 0] = 448.0 * 3
    q, s = fp8_block_quantize(w)
    assert q[0, 0].float().item() == 320.0
    assert fp8_block_dequantize(q, s)[0, 0].item() == 1280.0


def test_fp8_known_e4m3_values():
    # 448 in the block fixes the scale at 2^0, so q is just the e4m3 rounding of w.
    w = torch.zeros(128, 128)
    vals = [448.0, 1.0, 0.3, -5.0, 1.0625, 1.1875, -0.0009765625, 0.5]
    w[0, :len(vals)] = torch.tensor(vals)
    q, s = fp8_block_quantize(w)
    assert raw(s) == [127] and raw(q[1:]) == [0] * (127 * 128)
    got = q[0, :len(vals)]
    # 0x7E=448, 0x38=1.0, 0x2A=0.3125 (0.3 rounds up), 0xCA=-5, 1.0625 ties to 1.0 (even),
    # 1.1875 ties to 1.25 (even), -2^-10 ties between -0 and -2^-9 -> -0 (0x80), 0.5 = 0x30
    assert raw(got) == [0x7E, 0x38, 0x2A, 0xCA, 0x38, 0x3A, 0x80, 0x30]
    assert got.float().tolist() == [448.0, 1.0, 0.3125, -5.0, 1.0, 1.25, -0.0, 0.5]


def test_fp8_partial_blocks_and_dequant_dtype():
    torch.manual_seed(0)
    w = torch.randn(130, 200) * torch.logspace(-3, 2, 200)
    q, s = fp8_block_quantize(w)
    assert q.shape == (130, 200) and q.dtype == torch.float8_e4m3fn
    assert s.shape == (2, 2)
    sf = e8m0_to_float(s)
    for r, rs in enumerate((slice(0, 128), slice(128, 130))):
        for c, cs in enumerate((slice(0, 128), slice(128, 200))):
            amax = w[rs, cs].abs().max().item()
            k = math.ceil(math.log2(amax / 448))
            assert sf[r, c].item() == 2.0**k
    d = fp8_block_dequantize(q, s)
    assert d.dtype == torch.float32 and d.shape == w.shape
    # e4m3 has 3 mantissa bits: relative error <= 2^-4; subnormals: abs error <= scale * 2^-10
    sfull = sf.repeat_interleave(128, 0).repeat_interleave(128, 1)[:130, :200]
    bound = torch.maximum(w.abs() * 2.0**-4, sfull * 2.0**-10)
    assert ((d - w).abs() <= bound).all()
    assert (d - w).abs().max() > 0  # random data is not exactly representable
    assert fp8_block_dequantize(q, s, dtype=torch.bfloat16).dtype == torch.bfloat16
    # raw uint8 scales decode the same as float8_e8m0fnu scales
    assert torch.equal(fp8_block_dequantize(q, s.view(torch.uint8)), d)


def test_fp8_exactly_representable_roundtrip_is_bit_exact():
    torch.manual_seed(1)
    codes = torch.randint(0, 256, (256, 384), dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x38  # drop NaN encodings
    codes[::128, ::128] = 0x7E  # one 448 per block pins the block scale to 2^k
    ks = torch.randint(-20, 20, (2, 3))
    scale = 2.0 ** ks.float()
    w = codes.view(torch.float8_e4m3fn).float() * scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
    q, s = fp8_block_quantize(w)
    assert raw(s) == (ks + 127).flatten().tolist()
    assert raw(q) == raw(codes)
    d = fp8_block_dequantize(q, s)
    assert torch.equal(d.view(torch.int32), w.view(torch.int32))  # bit-exact, signs of zero too


def test_fp8_fp32_scale_fmt():
    torch.manual_seed(2)
    w = torch.randn(100, 300)
    q, s = fp8_block_quantize(w, scale_fmt="fp32")
    assert s.dtype == torch.float32 and s.shape == (1, 3)
    for c in range(3):
        blk = w[:, 128 * c:128 * (c + 1)]
        assert s[0, c].item() == pytest.approx(blk.abs().max().item() / 448, rel=1e-6)
        # the block's amax element maps to (almost) exactly +-448
        assert q[:, 128 * c:128 * (c + 1)].float().abs().max().item() == 448.0
    d = fp8_block_dequantize(q, s)
    assert ((d - w).abs() <= torch.maximum(w.abs() * 2.0**-4, s.max() * 2.0**-10)).all()


def test_fp4_packing_known_row():
    row = torch.zeros(64)
    row[:6] = torch.tensor([0.5, -6.0, 1.5, 3.0, -0.5, 4.0])
    row[32:36] = torch.tensor([1.0, 2.0, -1.0, 0.0])  # second group: amax 2 -> scale 2^-1
    packed, s = fp4_quantize(row[None])
    assert (packed.dtype, packed.shape, s.dtype) == (torch.int8, (1, 32), torch.float8_e8m0fnu)
    assert raw(s) == [127, 126]
    # codes 0.5->1, -6->15, 1.5->3, 3->5, -0.5->9, 4->6; low nibble = even element
    # group 2 at scale 1/2: 1->2 (code 4), 2->4 (code 6), -1->-2 (code 12), 0->0
    want = [0xF1, 0x53, 0x69] + [0] * 13 + [0x64, 0x0C] + [0] * 14
    assert raw(packed) == want
    assert packed[0, 0].item() == -15  # 0xF1 as int8
    assert torch.equal(fp4_dequantize(packed, s), row[None])


def test_fp4_tie_rounding_half_even():
    # 6 in the group pins the scale at 1; then values are rounded on the e2m1 grid.
    x = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0, -2.5, 0.2, 5.1, -0.1])
    want = [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -4.0, -2.0, 0.0, 6.0, -0.0]
    row = torch.zeros(32)
    row[:len(x)] = x
    packed, s = fp4_quantize(row[None])
    got = fp4_dequantize(packed, s)[0, :len(x)]
    assert got.tolist() == want
    assert torch.signbit(got[-1])  # -0.1 rounds to -0 (code 8)
    assert fake_quant_fp4(row)[:len(x)].tolist() == want


def test_fp4_roundtrip_bound_and_shapes():
    torch.manual_seed(3)
    w = torch.randn(48, 256) * torch.logspace(-4, 1, 256)
    packed, s = fp4_quantize(w)
    d = fp4_dequantize(packed, s, dtype=torch.float64)
    assert packed.shape == (48, 128) and s.shape == (48, 8) and d.dtype == torch.float64
    sf = e8m0_to_float(s).double().repeat_interleave(32, 1)
    # half the grid step: <= scale/4 below 2*scale, <= |w|/4 above
    bound = torch.maximum(w.double().abs() * 0.25, sf * 0.25)
    assert ((d - w.double()).abs() <= bound + 1e-12).all()
    # group amax lands in (3, 6] after scaling, so the scale is tight
    ratio = w.abs().view(48, 8, 32).amax(-1) / e8m0_to_float(s)
    assert (ratio > 3).all() and (ratio <= 6).all()
    # fake_quant_fp4 is the same math without packing
    assert torch.equal(fake_quant_fp4(w), d.float())
    with pytest.raises(AssertionError, match="in=40 must be divisible by group=32"):
        fp4_quantize(torch.zeros(2, 40))


def test_fp4_tiny_group_scale_clamp():
    packed, s = fp4_quantize(torch.zeros(1, 32))
    assert raw(s) == [1] and raw(packed) == [0] * 16  # amax clamped to 6*2^-126 -> 2^-126


def test_fake_quant_fp8_matches_block_quantize_and_dtype():
    torch.manual_seed(4)
    x = torch.randn(1, 320) * 10
    q, s = fp8_block_quantize(x)  # a single row: 128x128 blocks reduce to 1x128 blocks
    assert torch.equal(fake_quant_fp8(x), fp8_block_dequantize(q, s))
    # per-row scales: one row with a huge value must not affect the others
    x2 = torch.randn(3, 64)
    x2[1, 0] = 1e4
    assert torch.equal(fake_quant_fp8(x2, block=64)[0], fake_quant_fp8(x2[0], block=64))
    xb = (torch.randn(2, 5, 192) * 3).bfloat16()
    y = fake_quant_fp8(xb, block=64)
    assert y.dtype == torch.bfloat16 and y.shape == xb.shape and y.abs().max() > 0
    assert not torch.equal(y, xb)  # bf16 has more mantissa bits than e4m3
    assert torch.equal(fake_quant_fp8(y, block=64), y)  # idempotent
    # exactly representable e4m3 values with 448 present survive untouched
    z = torch.tensor([[448.0, 1.0, -0.3125, 6.0] * 32])
    assert torch.equal(fake_quant_fp8(z), z)


def test_hadamard_4x4_and_orthonormal():
    H4 = torch.tensor([[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]]) / 2.0
    assert torch.allclose(hadamard(torch.eye(4)), H4)
    assert torch.allclose(hadamard(torch.tensor([1.0, 2, 3, 4])), torch.tensor([5.0, -1, -2, 0]))
    H = hadamard(torch.eye(128))
    assert torch.allclose(H, H.T)
    assert torch.allclose(H @ H, torch.eye(128), atol=1e-5)
    v = torch.randn(3, 7, 128)
    assert torch.allclose(hadamard(hadamard(v)), v, atol=1e-5)
    assert hadamard(v.bfloat16()).dtype == torch.bfloat16
    with pytest.raises(AssertionError):
        hadamard(torch.zeros(3, 12))
