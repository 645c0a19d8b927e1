"""
Path-invariant numerics (compare_logprobs --invariant, Transformer.set_invariant).
"""
import torch


class PathInvariant(torch.utils._python_dispatch.TorchDispatchMode):
    """Every sum the model takes (GEMMs, reductions, softmax, index_add) and every transcendental function computed
    in fp64 and rounded to the dtype it would have had. A kernel's summation order depends on the shape it is given
    (cuBLAS picks tiles and split-K by the row count; CPU BLAS has other kernels under 12 rows; a reduction over few
    rows is split across blocks), so a token's logprob depends on whether it came from one full forward or a
    KV-cache decode in a batch. In fp64 every order gives the same sum to well below fp32's rounding, so both paths
    round to the same value: the bit-equal alignment of compare_logprobs --invariant, on any device. Inputs and
    outputs keep their dtypes (bf16 stays bf16): only the accumulation is wider. Slow: a Python hop per op and
    fp64 GEMMs (the H200's engine: 30x)."""
    aten = torch.ops.aten
    SUMS = {aten.mm, aten.bmm, aten.addmm, aten.baddbmm, aten.mv, aten.dot, aten.sum, aten.mean, aten.cumsum,
            aten._softmax, aten._log_softmax, aten.logsumexp, aten.linalg_vector_norm, aten.index_add,
            aten.index_add_, aten.scatter_add, aten.scatter_add_,
            # and the transcendental functions: CPU kernels take vector (SLEEF) or scalar code by an element's place
            aten.exp, aten.log, aten.sigmoid, aten.silu, aten.softplus, aten.rsqrt, aten.sin, aten.cos, aten.tanh}

    # the project's own ops whose insides hold such functions, each run as its Python code under the mode (a custom op
    # is one call to the mode, and inside it the mode is off): model_dsv4's rope_angles, whose cos and sin the
    # decode's inline angles have in fp64 (in fp32 the two paths part by a rounding: |Δ logprob| 0.079 on an H200
    # with --invariant)
    DECOMPOSE = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.DECOMPOSE:
            with self:
                return self.DECOMPOSE[func](*args, **kwargs)
        if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
            # met inside a DECOMPOSE op's code, below autograd, a composite op (matmul, log_softmax) comes whole: its
            # decomposition runs under the mode, where the sums it is made of are seen
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        if func.overloadpacket not in self.SUMS or func._overloadname in ("out", "dtype_out", "IntList_out"):
            return func(*args, **kwargs)
        meta = lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t
        want = func(*map(meta, args), **{k: meta(v) for k, v in kwargs.items()}).dtype  # the usual result dtype
        if not want.is_floating_point:  # counts (cumsum, scatter_add of ones): exact already
            return func(*args, **kwargs)
        up = lambda t: t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
        a, kw = [up(t) for t in args], {k: torch.float64 if k == "dtype" else up(v) for k, v in kwargs.items()}
        name = func.overloadpacket.__name__
        if func._overloadname == "dtype":  # mm(a, b, out_dtype)
            return getattr(self.aten, name).default(*a[:-1]).to(want)
        if name in ("_softmax", "_log_softmax"):
            a[2] = False  # half_to_float
        if name.endswith("_"):  # in place: the out-of-place op in fp64, then written back
            out = getattr(self.aten, name[:-1]).default(*a, **kw)
            return args[0].copy_(out)
        return func(*a, **kw).to(want)
