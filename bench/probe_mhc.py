"""mHC under inductor on a GPU, bench_2b's sizes (4096 tokens, n = 4 streams of 1536, bf16): forms of its pieces,
each compiled alone, with its first call (a cold cache compiles), its kernels per call and their time (from the
profiler), and its time per call replayed as one CUDA graph (as in `--compile=graphs`, without launch costs):
  - Sinkhorn with autograd (the training step): the batched loop (mhc.sinkhorn) against the same loop with
    its backward written out, the Triton kernels (kernels_triton.sinkhorn_triton) and each token's n x n entries as one
    row of n * n, summed under masks (below);
  - Sinkhorn without autograd (the engine's decode): one tensor per entry (mhc.sinkhorn_entries) against the
    Triton kernel and the masked form;
  - a whole sublayer, forward+backward (Block.hc_pre, then Block.hc_post with the identity as the sublayer): the mixes
    as an fp32 GEMM (the reference) or on bf16 tensor cores (kernels_torch.hc_mixes_bf16), with the batched loop or the
    Triton kernels, each checked against the first, with its 8 costliest kernels.
python bench/probe_mhc.py   (PROBE_MASKED=1: the masked form too; PROBE_BACKEND=aot_eager: the CPU smoke test)
Session 13 (2026-12-02, H200, torch 2.11.0+cu130, bench/calls/gpu_session13.sh and 13b.sh; bench/RESULTS.md) kept the
bf16 mixes (a sublayer 787 -> 699 us replayed). It left the Sinkhorn loop batched: one tensor per row ran 177
kernels against the loop's 158 (inductor writes out every step), and the masked form below ran 19 kernels in 75 us
against 158 in 169 us but took 148 s to compile against 14 s, a cost each of a model's compiled layer kinds would pay
twice. Session 14 (bench/calls/gpu_session14b.sh) took the Triton kernels: 6 kernels in 20 us against the loop's 158 in
170 us, a sublayer 706 -> 485 us replayed. Its written-out backward (157 kernels, 169 us) gained nothing: inductor
still writes every step out. (The captures of the Sinkhorn alone with autograd fail, for every form; not looked into.)
Each form's top kernels show their time in the profiled eager calls and in the replays; the last form's kernels are
then listed one by one, forward and backward apart."""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import mhc  # noqa: E402
import model_dsv4 as m  # noqa: E402
from kernels_triton import sinkhorn_triton  # noqa: E402
from probe_timing import captured  # noqa: E402

BACKEND = os.environ.get("PROBE_BACKEND", "inductor")
CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
T = int(os.environ.get("PROBE_TOKENS", 4096 if CUDA else 64))
sync = torch.cuda.synchronize if CUDA else (lambda: None)


class _SinkhornBackward(torch.autograd.Function):
    """The batched loop with its backward written out. A step y = c / d, d = c summed over rows (or columns) + eps,
    has dc = (dy - (dy * y) summed the same way) / d: sums of four and a division, the shape of the forward step,
    which inductor compiles into one kernel a step (the sums inlined). Autograd's own backward of the step (dy / d,
    then the sum of -dy * c / d^2 broadcast back) took two kernels a step (session 12's trace). Saved: each step's
    input (the loop writes them anyway); d is summed again from it."""
    @staticmethod
    def forward(ctx, comb, iters, eps):
        xs = [comb]
        for k in range(2 * iters - 1):
            c = xs[-1]
            xs.append(c / (c.sum(dim=-2 if k % 2 == 0 else -1, keepdim=True) + eps))
        ctx.eps = eps
        ctx.save_for_backward(*xs)
        return xs[-1]

    @staticmethod
    def backward(ctx, dy):
        xs = ctx.saved_tensors
        for k in reversed(range(len(xs) - 1)):
            dim = -2 if k % 2 == 0 else -1
            dy = (dy - (dy * xs[k + 1]).sum(dim, keepdim=True)) / (xs[k].sum(dim, keepdim=True) + ctx.eps)
        return dy, None, None


def written_backward(comb, iters, eps):
    return _SinkhornBackward.apply(comb, iters, eps)


def masked(comb, iters, eps):
    """Each token's n x n entries as one row of n * n; row i's sum (or column j's) is the row's sum under the mask of
    its entries, and each entry is divided by the sum of its own row (column). Every step reduces and divides over
    the same [..., n * n] index space, the pattern of a softmax, which inductor can chain in one kernel."""
    n = comb.shape[-1]
    c, e = comb.flatten(-2), torch.arange(n * n, device=comb.device)
    rows, cols = [e // n == i for i in range(n)], [e % n == j for j in range(n)]

    def norm(c, masks):
        return c / (sum(torch.where(k, torch.where(k, c, 0.0).sum(-1, keepdim=True), 0.0) for k in masks) + eps)

    c = norm(c, cols)
    for _ in range(iters - 1):
        c = norm(norm(c, rows), cols)
    return c.unflatten(-1, (n, n))


AGAIN = (("masked", masked),) if os.environ.get("PROBE_MASKED") else ()  # session 13 measured it: 148 s to compile


def profile(fn, top, calls=5):
    """Kernels of one call of fn, from the profiler: (count, their time in us, the `top` by time as (name, count,
    us))."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        sync()
    ks = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name = {}
    for e in ks:
        count, us = by_name.get(e.name, (0, 0.0))
        by_name[e.name] = (count + 1, us + e.device_time)
    tops = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    return len(ks) / calls, sum(e.device_time for e in ks) / calls, [(k, c / calls, t / calls) for k, (c, t) in tops]


def measure(name, fn, top=0):
    """fn() runs one call. Prints its first call, kernels per call, kernel time and CUDA-graph replay time, and the
    `top` kernels by time (per call, with their count)."""
    t0 = time.perf_counter()
    fn()
    sync()
    first = time.perf_counter() - t0
    for _ in range(3):
        fn()
    sync()
    line = f"{name:44s} first call {first:6.1f} s"
    if CUDA:
        n_kernels, us, tops = profile(fn, top)
        line += f"  {n_kernels:6.0f} kernels, {us:7.1f} us kernel time"
        try:
            graph = captured(fn)
            for _ in range(3):
                graph.replay()
            sync()
            t0 = time.perf_counter()
            for _ in range(20):
                graph.replay()
            sync()
            line += f", {(time.perf_counter() - t0) / 20 * 1e6:7.1f} us a CUDA-graph replay"
            n_kernels, us, replay_tops = profile(graph.replay, top)
            line += f" ({n_kernels:.0f} kernels, {us:.1f} us kernel time, replayed)"
            tops = [(k, c, t, dict((k2, t2) for k2, c2, t2 in replay_tops).get(k)) for k, c, t in tops]
        except Exception as e:  # noqa: BLE001
            line += f", no graph ({type(e).__name__}: {str(e)[:80]})"
            tops = [(k, c, t, None) for k, c, t in tops]
        line += "".join(f"\n      {t:7.1f} us {c:4.0f}x{'' if r is None else f' (replayed {r:7.1f} us)'} {k[:100]}"
                        for k, c, t, r in tops)
    print(line, flush=True)


def sinkhorns():
    g = torch.Generator(device=DEV).manual_seed(0)
    logits = torch.randn(T, 4, 4, device=DEV, generator=g, requires_grad=True)
    dy = torch.randn(T, 4, 4, device=DEV, generator=g)
    want = None
    forms = (("batched", mhc.sinkhorn), ("written backward", written_backward), ("triton", sinkhorn_triton))
    for name, form in forms + AGAIN:
        torch._dynamo.reset()
        f = torch.compile(lambda t, form=form: form(t.softmax(-1) + 1e-6, 20, 1e-6), backend=BACKEND)
        out = {}

        def once():
            out["y"] = f(logits)
            out["g"], = torch.autograd.grad(out["y"], logits, dy)
        measure(f"Sinkhorn fwd+bwd, {name}", once)
        if want is None:
            want = (out["y"].clone(), out["g"].clone())
        else:
            dy_, dg = ((out[k] - w).abs().max() for k, w in zip("yg", want))
            print(f"    against batched: out {dy_:.1e}, grad {dg:.1e} (largest {want[1].abs().max():.1e})")
    with torch.no_grad():
        for name, form in (("entries", mhc.sinkhorn_entries), ("triton", sinkhorn_triton)) + AGAIN:
            torch._dynamo.reset()
            f = torch.compile(lambda t, form=form: form(t.softmax(-1) + 1e-6, 20, 1e-6), backend=BACKEND)
            measure(f"Sinkhorn forward, no grad, {name}", lambda: f(logits))


def mhc_inputs(tokens=T):
    """A Block holding only what hc_pre and hc_post use (bench_2b's width, n = 4), its parameters fn, scale and base,
    bf16 streams x [1, tokens, n, D] and a gradient dy for them, and the generator that made them."""
    args = m.ModelArgs(hidden_size=1536, hc_mult=4)
    block = m.Block.__new__(m.Block)
    torch.nn.Module.__init__(block)
    block.args, n, D = args, args.hc_mult, args.hidden_size
    g = torch.Generator(device=DEV).manual_seed(1)
    fn = (torch.randn((2 + n) * n, n * D, device=DEV, generator=g) * 0.02).requires_grad_()
    scale = torch.tensor([0.5, 0.5, 1.0], device=DEV, requires_grad=True)
    base = (torch.randn((2 + n) * n, device=DEV, generator=g) * 0.1).requires_grad_()
    x = torch.randn(1, tokens, n, D, device=DEV, generator=g).bfloat16().requires_grad_()
    dy = torch.randn(1, tokens, n, D, device=DEV, generator=g).bfloat16()
    return block, fn, scale, base, x, dy, g


def sublayers():
    block, fn, scale, base, x, dy, _ = mhc_inputs()

    def sublayer(x, fn, scale, base):
        h, post, comb = block.hc_pre(x, fn, scale, base)
        return block.hc_post(h, x, post, comb)

    want, model_sinkhorn = None, mhc.sinkhorn
    batched = lambda comb, iters, eps, fast: model_sinkhorn(comb, iters, eps)  # the loop, whatever `fast` says
    forms = {"batched": batched, "triton": model_sinkhorn}  # mhc.sinkhorn takes the Triton kernel when fast
    for fast, form in ((False, "batched"), (True, "batched"), (True, "triton")):
        torch._dynamo.reset()
        block.fast, mhc.sinkhorn = fast, forms[form]  # hc_split_sinkhorn calls mhc.sinkhorn
        f = torch.compile(sublayer, backend=BACKEND)
        out = {}

        def once():
            out["y"] = f(x, fn, scale, base)
            out["g"] = torch.autograd.grad(out["y"], [x, fn, base], dy)
        name = f"sublayer, {'bf16' if fast else 'fp32'} mixes, {form}"
        measure(name, once, top=8)
        got = (out["y"].float(), *(t.float() for t in out["g"]))
        if want is None:
            want = [t.clone() for t in got]
        else:
            rel = [((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got, want)]
            print("    against the first, largest difference over largest value: out, dx, dfn, dbase "
                  + " ".join(f"{r:.1e}" for r in rel))
    if CUDA:  # the last (kept) form's kernels one by one, in the order they run: its forward, then its backward
        y = f(x, fn, scale, base)  # the graph that the backward below runs through
        for part, run in (("forward", lambda: f(x, fn, scale, base)),
                          ("backward", lambda: torch.autograd.grad(y, [x, fn, base], dy))):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                run()
                sync()
            ks = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                        key=lambda e: e.time_range.start)
            print(f"  {name}, {part}: {len(ks)} kernels, {sum(e.device_time for e in ks):.1f} us"
                  + "".join(f"\n    {e.device_time:7.1f} us {e.name[:110]}" for e in ks))
    mhc.sinkhorn = model_sinkhorn


if __name__ == "__main__":
    print(f"{torch.cuda.get_device_name() if CUDA else 'cpu'}, torch {torch.__version__}, {T} tokens, {BACKEND}")
    sinkhorns()
    sublayers()
