"""FP8 training (train_quant='fp8', quant.py's FP8 training section): the linears against their formulas written out,
the grouped experts against a loop over them, the model's forward against the FP8 engine's, a GRPO run that re-scores
an FP8 server's samples as it sampled them, and on a Hopper GPU the FP8 GEMM against the reference."""
import copy

import pytest
import torch
import torch.nn.functional as F

import dsv4_kernels.fp8 as fp8_kernels
import quant
from compare_logprobs import prepare
from conftest import SMALL, randomize_
from helpers.grpo_base import ARGS as BASE_ARGS, base_checkpoint, run
from model_dsv4 import Transformer
from quant import act_quant, fake_quant_fp8, fp8_block_quantize, fp8_grouped_mm, fp8_linear, fp8_mm, fp8_round


def test_fp8_linear_is_fp8_forward_and_dgrad_with_a_straight_through_weight():
    """Forward: FP8 x (per row per 128) times the weight rounded by 128 x 128 blocks. dgrad: FP8 dy times the same
    weight. wgrad: dy times the forward's FP8 x. Widths that are not whole blocks (200 in, 136 out) pad inside."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 200, generator=g).mul(3).requires_grad_()
    w = torch.randn(136, 200, generator=g).mul(0.05).requires_grad_()
    y = fp8_linear(x, w)
    dy = torch.randn(y.shape, generator=g)
    y.backward(dy)
    xq, wq = fake_quant_fp8(x.detach()), fp8_round(w.detach())
    assert not torch.equal(xq, x) and not torch.equal(wq, w)  # both do round
    assert torch.equal(y, F.linear(xq, wq))
    torch.testing.assert_close(x.grad, fake_quant_fp8(dy) @ wq, rtol=0, atol=1e-6)
    torch.testing.assert_close(w.grad, dy.flatten(0, 1).T @ xq.flatten(0, 1), rtol=0, atol=1e-6)
    assert (x.grad - dy @ w.detach()).abs().max() > 1e-3  # and differs from a plain linear's


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_grouped_experts_equal_a_loop_of_fp8_linears(device):
    """The grouped path's FP8 GEMMs (w1 and w3 stacked: two matrices rounded on their own, 40 rows each, not a block)
    equal each expert's own fp8_linear, forward and backward; an expert with no rows gets a zero gradient. Row counts
    that are not a multiple of 8 (on a GPU, bf16: the grouped wgrad reads each group where routing puts it)."""
    g = torch.Generator().manual_seed(1)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # CUDA's grouped GEMM is bf16
    E, inter, D, counts = 4, 40, 256, [5, 0, 11, 3]
    w13 = torch.randn(E, 2 * inter, D, generator=g).mul(0.1).to(device, dtype).requires_grad_()
    xs = torch.randn(sum(counts), D, generator=g).to(device, dtype).requires_grad_()
    y = fp8_grouped_mm(xs, w13, torch.tensor(counts, device=device).cumsum(0).to(torch.int32), 2)
    dy = torch.randn(y.shape, generator=g).to(device, dtype)
    y.backward(dy)
    w_ref, x_ref = w13.detach().clone().requires_grad_(), xs.detach().clone().requires_grad_()
    rows = x_ref.split(counts)
    ref = torch.cat([torch.cat([fp8_linear(r, w_ref[e, :inter]), fp8_linear(r, w_ref[e, inter:])], -1)
                     for e, r in enumerate(rows)])
    ref.backward(dy)
    tol = 0 if device == "cpu" else 1e-2  # bf16 GEMMs that sum in other orders
    assert (y - ref).abs().max() <= tol * ref.abs().max() and w13.grad[0].abs().max() > 0
    torch.testing.assert_close(xs.grad, x_ref.grad, rtol=0, atol=1e-6 + tol * x_ref.grad.abs().max().item())
    torch.testing.assert_close(w13.grad, w_ref.grad, rtol=0, atol=1e-6 + tol * w_ref.grad.abs().max().item())
    assert torch.equal(w13.grad[1], torch.zeros_like(w13.grad[1]))


@pytest.mark.parametrize("kernels", [False, True])
def test_fp8_training_forward_is_the_fp8_engines(kernels):
    """bf16, from full-precision weights: set_fp8_training's logits equal, bit for bit, those of the FP8 engine's
    numerics (compare_logprobs' fp8 side: weights rounded once in place, FP8 activations, KV and indexer rounding),
    the reference loop and the grouped experts alike; each FP8-stored weight that learns in bf16 gets a gradient."""
    base = randomize_(Transformer(copy.deepcopy(SMALL), dtype=torch.float32), SMALL.n_routed_experts,
                      SMALL.num_experts_per_tok).set_dtype(torch.bfloat16).eval()
    ids = torch.randint(0, SMALL.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    engine = prepare(base, "fp8").set_kernels(kernels)
    trainer = copy.deepcopy(base).set_fp8_training(True).set_kernels(kernels)
    with torch.no_grad():
        want = engine(ids)
    got, plain = trainer(ids), base(ids)
    assert torch.equal(got, want) and not torch.equal(got, plain)
    got.float().logsumexp(-1).mean().backward()
    plain.float().logsumexp(-1).mean().backward()
    learns = [n for n, p in base.named_parameters() if quant.quant_format(n, "fp8") and p.grad is not None]
    assert len(learns) > 10 and "layers.0.attn.wo_a.weight" in learns
    for name, p in trainer.named_parameters():
        if name in learns and ".experts." not in name:  # a routed expert may draw no token
            assert p.grad.abs().max() > 0 and not torch.equal(p.grad, base.get_parameter(name).grad), name


@pytest.mark.slow
def test_grpo_step_with_fp8_rollouts_and_fp8_training(tmp_path_factory, tmp_path):
    """The trainer re-scores an FP8 server's samples (W8A8, FP8 weights sent by the weight sync) as the server
    scored them when it trains in FP8 too; a full-precision trainer does not."""
    base = [f"--init_from={base_checkpoint(tmp_path_factory)}", *BASE_ARGS, "--max_steps=1", "--rollout_quant=fp8"]
    fp8 = run(tmp_path / "fp8", *base, "--train_quant=fp8")[0]
    full = run(tmp_path / "full", *base)[0]
    assert fp8["train_tokens"] > 0 and fp8["grad_norm"] > 0, fp8
    assert fp8["logprob_abs_diff"] < 1e-5 and full["logprob_abs_diff"] > 100 * fp8["logprob_abs_diff"], (fp8, full)


hopper = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0) and hasattr(F, "scaled_mm")


@pytest.mark.skipif(not hopper, reason="torch's blockwise FP8 GEMM runs on Hopper GPUs")
@pytest.mark.parametrize("M,N,K", [(64, 256, 512), (37, 384, 640), (1, 128, 128), (300, 1024, 2048)])
def test_fp8_gemm_equals_the_reference_on_a_gpu(M, N, K):
    """dsv4_kernels.fp8.blockwise_mm against the reference (dequantize, multiply in fp32), both orientations the
    training takes (forward: w [N, K]; dgrad: its transpose): row counts not a multiple of 4, K / 128 not one of 4."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
    w = (torch.randn(N, K, device="cuda", generator=g) * 0.05).bfloat16()
    wq, ws = fp8_block_quantize(w)
    for a, b, s in ((x, wq, ws), (torch.randn(M, N, device="cuda", generator=g).bfloat16(), wq.mT, ws.mT)):
        aq, a_s = act_quant(a)
        assert fp8_kernels.usable(aq, b)
        got = fp8_kernels.blockwise_mm(aq, a_s, b, quant.e8m0_to_float(s), torch.float32)
        want = quant.act_dequant(aq, a_s, torch.float32) @ quant.fp8_block_dequantize(b, s).T
        # Hopper's FP8 tensor cores keep ~14 bits between the promotions to fp32 every 128 of K (DeepSeek-V3,
        # arXiv 2412.19437 section 3.3.2): 1.7-2.3e-4 of the largest output at these shapes on an H200 (2026-12-07).
        # The bound, 2^-11, is a quarter of a bf16 output's rounding step; a wrong scale block errs by > 1e-2
        assert (got - want).abs().max() <= 2 ** -11 * want.abs().max(), (M, N, K)
        fp8_kernels.use_fp8_gemm(False)
        try:  # fp8_mm takes the kernel where it can, the reference where switched off: the same bf16 numbers
            ref = fp8_mm(aq, a_s, b, s, torch.bfloat16)
        finally:
            fp8_kernels.use_fp8_gemm(True)
        assert (fp8_mm(aq, a_s, b, s, torch.bfloat16).float() - ref.float()).abs().max() <= 1e-2 * ref.abs().max()
