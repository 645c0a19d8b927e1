"""
FP8 GEMMs with DeepSeek's block scales on a Hopper GPU, for quant.fp8_mm (which keeps the plain reference beside the
call): torch's scaled_mm with blockwise scaling, cuBLASLt's kernels, activations scaled per row per 128 inputs and
weights per 128 x 128 block, fp32 accumulation. Torch takes that pair of scalings on SM90 only (Blackwell refuses it),
from torch 2.10 (F.scaled_mm, the explicit scaling API); elsewhere the reference runs.

The layouts cuBLASLt wants (shared/docs/fp8_notes.md, from torch's own uses of the API): a row-major with its row count
a multiple of 4 and its scales [M, K/128] row-count-major; b column-major (the transpose of a row-major [N, K]); b's
scales [K/128, N/128] with the K blocks padded to a multiple of 4. A wrong layout gives wrong numbers, not an error,
which is why kernel_check.py holds this to the reference before a run takes it (kernel path fp8_gemm).
"""
import functools

import torch
import torch.nn.functional as F

FP8_GEMM = True  # the process's switch (kernel path 'fp8_gemm', as gemm_f32): off, quant.fp8_mm's reference


def use_fp8_gemm(on):
    global FP8_GEMM
    FP8_GEMM = bool(on)


@functools.cache
def _hopper(index):
    return torch.cuda.get_device_capability(index) == (9, 0)


def usable(a, b):
    """Whether blockwise_mm takes a [M, K] times b [N, K]: the switch on, a CUDA Hopper GPU, a torch with
    F.scaled_mm, K and N whole 128-blocks (as the kernels and torchao require)."""
    return (FP8_GEMM and a.is_cuda and hasattr(F, "scaled_mm") and torch.version.hip is None
            and _hopper(a.device.index or 0) and a.shape[1] % 128 == 0 and b.shape[0] % 128 == 0)


def blockwise_mm(a, a_scale, b, b_scale, dtype):
    """a [M, K] e4m3 with float32 scales [M, K/128], b [N, K] e4m3 with float32 scales [N/128, K/128] -> a @ b.T
    [M, N] in dtype. The scales are decode factors (what multiplies the FP8 value back)."""
    M, kb = a.shape[0], a_scale.shape[1]
    if M % 4:  # zero rows (byte 0 is +0 in e4m3), cut off the result
        a = F.pad(a.view(torch.uint8), (0, 0, 0, -M % 4)).view(a.dtype)
        a_scale = F.pad(a_scale, (0, 0, 0, -M % 4), value=1.0)
    if kb % 4:
        b_scale = F.pad(b_scale, (0, -kb % 4), value=1.0)
    y = F.scaled_mm(a.contiguous(), b.contiguous().t(), a_scale.t().contiguous().t(), F.ScalingType.BlockWise1x128,
                    b_scale.contiguous().t(), F.ScalingType.BlockWise128x128, output_dtype=dtype)
    return y[:M]
