"""The FP8 GEMM's error against exact products of the same rounded operands, by reduction length K (one Hopper GPU):

    python bench/fp8_gemm_error.py

For each K, FP8 activations (1 x 128 blocks) times an FP8 weight (128 x 128 blocks) from bf16 normals, as
train_quant='fp8' multiplies them: dsv4_kernels.fp8.blockwise_mm (torch's blockwise scaled_mm) and an fp32 product of
the dequantized operands (the reference path, quant.fp8_mm with the kernel off), each against the same product in
fp64. Prints each one's largest error relative to the output's largest value, and the root-mean-square error
relative to the output's RMS: what bounds the kernel test (tests/test_fp8_training.py) and kernel_check."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import dsv4_kernels.fp8 as fp8_kernels  # noqa: E402
from quant import act_dequant, act_quant, e8m0_to_float, fp8_block_dequantize, fp8_block_quantize  # noqa: E402


def main(M=512, N=1024, Ks=(128, 256, 512, 1024, 2048, 4096, 7168)):
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; M={M}, N={N}")
    print("K     | kernel max/|y|max  rms/rms | fp32 max/|y|max  rms/rms")
    g = torch.Generator(device="cuda").manual_seed(0)
    for K in Ks:
        x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
        w = (torch.randn(N, K, device="cuda", generator=g) * K ** -0.5).bfloat16()
        xq, xs = act_quant(x)
        wq, ws = fp8_block_quantize(w)
        a, b = act_dequant(xq, xs, torch.float64), fp8_block_dequantize(wq, ws).double()
        exact = a @ b.T
        got = fp8_kernels.blockwise_mm(xq, xs, wq, e8m0_to_float(ws), torch.float32).double()
        f32 = (a.float() @ b.float().T).double()
        row = [f"{K:5d}"]
        for y in (got, f32):
            err = y - exact
            rms = err.pow(2).mean().sqrt() / exact.pow(2).mean().sqrt()
            row.append(f"{err.abs().max() / exact.abs().max():.2e}  {rms:.2e}")
        print(" | ".join(row))


if __name__ == "__main__":
    main()
