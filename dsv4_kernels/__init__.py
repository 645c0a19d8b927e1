"""
The fast paths, each beside the plain reference it replaces in the model (model_dsv4.py, moe.py, mhc.py,
kv_cache.py, engine.py). This package imports torch and Triton and nothing of the project: the model reaches it
through its one switch, `Transformer.set_kernels`, and keeps its plain path next to every call.

  fast.py              torch fast paths: fp32-result GEMMs, mHC mixes on bf16 tensor cores, grouped-GEMM experts,
                       block window attention, decode's fused projections
  mhc_triton.py        mHC in Triton: Sinkhorn, hc_post (training) and hc_pre (decode)
  route.py             the router's top-k and the (token, expert) pair order of a decode step
  decode.py            a decode step's experts, compressor step, window key, query norm + RoPE, sampler
  decode_attention.py  a decode step's sink attention over the cached keys
  fp8.py               FP8 GEMMs with DeepSeek's block scales (torch's scaled_mm on Hopper), for FP8 training
  invariant.py         the exact, slow numerics of compare_logprobs --invariant (every sum in fp64)

Each Triton kernel is a torch.library custom op, so torch.compile keeps it as it is and a CUDA graph records it.
Triton ships with torch's GPU builds (CUDA and ROCm). Without a GPU, Triton's interpreter runs the same kernels on
CPU tensors: the tests use that, and the model takes its references there (has_triton).
"""
import os

import torch

# No GPU (the tests on a CPU): Triton's interpreter runs the kernels on CPU tensors in numpy. triton.language reads the
# switch at its import, so it is set here, before triton is imported.
_SET_HERE = not torch.accelerator.is_available() and "TRITON_INTERPRET" not in os.environ
if not torch.accelerator.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
try:
    import triton
    import triton.language as tl
except ImportError:  # torch's CPU build comes without Triton: the references run instead
    triton = tl = None
if _SET_HERE and triton is not None and hasattr(triton, "knobs"):
    # From here Triton's own setting holds the switch, and the variable is dropped: child processes (the embedded
    # server, torchrun's ranks, the tests' subprocesses) then start as a user starts them. Inherited from the start,
    # it crashes torch's custom-op calls ("vector::reserve").
    triton.knobs.runtime.interpret = True
    os.environ.pop("TRITON_INTERPRET", None)

_jit = triton.jit if triton else (lambda fn: fn)
INTERPRETED = triton is not None and bool(triton.knobs.runtime.interpret if hasattr(triton, "knobs")
                                          else os.environ.get("TRITON_INTERPRET") == "1")


def has_triton(t):
    """Whether the model takes the Triton kernels for t: Triton is installed and t is on a GPU. (On a CPU the
    references are faster than Triton's interpreter, which the tests run the kernels through.)"""
    return triton is not None and t.is_cuda


@_jit
def _dot(a, b, F32: tl.constexpr):
    """tl.dot(a, b) in fp32. F32 multiplies fp32 copies in full fp32 ("ieee", not the tensor cores' tf32): for fp32
    inputs, and in Triton's interpreter, whose bf16 dot returns garbage (the same exact products of bf16 numbers,
    summed in fp32 as the tensor cores sum them)."""
    if F32:
        r = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        r = tl.dot(a, b)
    return r
