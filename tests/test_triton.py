"""kernels_triton.sinkhorn_triton (mHC's Sinkhorn loop as one Triton kernel forward and one backward) against the loop it
replaces, model_dsv4.sinkhorn: values and gradients, eager and under torch.compile. Without a GPU, kernels_triton.py runs
Triton's interpreter on CPU tensors (the same kernel code, executed in numpy)."""
import os
import subprocess
import sys

import pytest
import torch

from kernels_triton import sinkhorn_triton  # before triton: without a GPU it turns on Triton's interpreter first
from model_dsv4 import sinkhorn

pytest.importorskip("triton", reason="Triton comes with torch's GPU builds; requirements.txt installs it for the CPU")

DEV = "cuda" if torch.cuda.is_available() else "cpu"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EPS = 1e-6


def comb(shape, n, dtype, seed):
    """Positive [*shape, n, n] matrices with entries over four orders of magnitude, as a softmax gives."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, n, n, generator=g, dtype=torch.float64) * 3).softmax(-1).add(EPS).to(DEV, dtype)


@pytest.mark.parametrize("n,iters,dtype", [(4, 20, torch.float64), (4, 20, torch.float32), (2, 6, torch.float32),
                                           (3, 6, torch.float32)])
def test_sinkhorn_triton_equals_loop(n, iters, dtype):
    """Forward and gradient equal the loop's, for 2 x 19 tokens (not a multiple of the kernel's block of tokens) and
    n = 3, which the kernel pads to 4. fp64: to ~1e-14 (the same operations; only the order of a sum of n may
    differ). fp32: to a few roundings of the result's largest value."""
    x = comb((2, 19), n, dtype, seed=n).requires_grad_()
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(1), dtype=dtype).to(DEV)
    y, ref = sinkhorn_triton(x, iters, EPS), sinkhorn(x, iters, EPS)
    (dx,), (dref,) = (torch.autograd.grad(t, x, dy) for t in (y, ref))
    tol = 1e-13 if dtype == torch.float64 else 2e-6
    assert y.shape == ref.shape and y.dtype == dtype
    assert (y - ref).abs().max() <= tol * ref.abs().max(), (y - ref).abs().max()
    assert (dx - dref).abs().max() <= tol * 10 * dref.abs().max(), ((dx - dref).abs().max(), dref.abs().max())
    # and the loop ran to its last step, which divides each column by its sum
    torch.testing.assert_close(y.detach().sum(-2), torch.ones_like(y[..., 0]), atol=1e-5, rtol=0)


def test_sinkhorn_triton_under_compile():
    """Inside a compiled function (the layers are compiled in training), the op keeps its forward and backward: its
    fake implementation gives the graph its shape, and autograd reaches the backward kernel. The CPU runs compile's
    graphs without code generation (aot_eager); a GPU through inductor."""
    backend = "inductor" if DEV == "cuda" else "aot_eager"

    def f(logits, w):  # as hc_split_sinkhorn: a softmax + eps, the loop, then something downstream
        return (sinkhorn_triton(logits.softmax(-1) + EPS, 20, EPS) * w).sum(-1)

    g = torch.Generator().manual_seed(0)
    logits, w = (torch.randn(*s, generator=g).to(DEV).requires_grad_() for s in ((37, 4, 4), (4, 4)))
    ref = sinkhorn(logits.softmax(-1) + EPS, 20, EPS)
    out = torch.compile(f, backend=backend, fullgraph=True)(logits, w)
    grads = torch.autograd.grad(out.square().sum(), (logits, w))
    refs = torch.autograd.grad(((ref * w).sum(-1)).square().sum(), (logits, w))
    torch.testing.assert_close(out, (ref * w).sum(-1), atol=1e-5, rtol=1e-5)
    for a, b in zip(grads, refs):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_sinkhorn_kernels_compile_for_h200_and_mi355x():
    """Triton's interpreter runs code that its compiler refuses (session 14's first kernel passed the tests above on
    the CPU and failed to compile on the GPU: an `if` whose branches gave two shapes). So both kernels are also
    compiled here, without a GPU, to machine code for the H200 (sm_90, a cubin) and the MI355X (gfx950, a hsaco), as
    _launch calls them (4 x 4 matrices, 20 iterations). In a subprocess: this process's kernels are interpreted."""
    code = """
import kernels_triton, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
for target, binary in ((GPUTarget("cuda", 90, 32), "cubin"), (GPUTarget("hip", "gfx950", 64), "hsaco")):
    for fn in (kernels_triton._sinkhorn_fwd, kernels_triton._sinkhorn_bwd):
        ptrs = [a for a in fn.arg_names if a.endswith("_ptr")]
        sig = {**{a: "*fp32" for a in ptrs}, "n_tok": "i32", "eps": "fp32",
               **{a: "constexpr" for a in ("STEPS", "N", "NP", "BLOCK")}}
        src = ASTSource(fn, sig, constexprs={"STEPS": 39, "N": 4, "NP": 4, "BLOCK": kernels_triton.BLOCK})
        assert binary in triton.compile(src, target=target, options={"num_warps": 1}).asm, (target, fn)
        print(target.arch, fn.__name__, "compiled")
"""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("compiled") == 4, out.stdout
