"""
torch.compile at the call site: the entry points (train_grpo.py, server.py, bench/bench.py) decide once, and each object
holds its compiled callables: each block its forward, the model its logits and head_loss, the engine its cache's
methods and its sampler (instance attributes over the class's methods). No module's functions are swapped, so code a
fork adds (a new loss, a new layer) runs eager until it is compiled where it is called, and two models in one process
can differ.

  'off'     eager
  'layers'  a whole layer at a time, the head and the last stage's head + loss (compile_model), and the engine's
            prefill, decode and sampler (compile_engine, compile_kv_cache)
  'static'  as 'layers', each shape compiled on its own (dynamic=False): kernels specialised to the token-budget
            layout's few shapes (grpo.plan_microbatches), more graphs to build
  'background'  as 'static', compiled in a side thread while the blocks run eagerly (Background): no wait
  'graphs'  bench/bench.py only: 'layers' with the trainer's layers recorded as CUDA graphs

Any mode but 'off' also keeps inductor's compiled graphs and Triton kernels in one directory the user sees
(`compile_cache`, default out/compile_cache), so a second launch loads what the first compiled, and prints each
library warning once.
"""
import atexit
import contextlib
import functools
import os
import queue
import threading
import time
import types
import warnings

import torch

import engine as engine_module
import kv_cache
import model_dsv4

MODES = ("off", "layers", "static", "background", "graphs")


def use_compile(mode, cache_dir="out/compile_cache"):
    """The process's side of a compile mode: each warning once, the cache directory, dynamo's limits. Returns the
    cache's directory, or None when mode is 'off'."""
    if mode not in MODES:
        raise ValueError(f"compile must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "off":
        return None
    warn_once()
    import torch._inductor.config  # here: importing inductor takes seconds, and most runs stay eager
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)  # kinds x shapes
    # inductor's pad_mm pass weighs a GEMM's arithmetic intensity on the symbolic sizes and so guards on batch x
    # length (a prefill compiled again at a new shape); V4's dims and the padded lengths are multiples of 64 already
    torch._inductor.config.shape_padding = False
    return set_cache_dir(cache_dir)


def set_cache_dir(path):
    """inductor's FX graph and autograd caches and Triton's kernels (its triton/ subfolder) go under `path`; the
    embedded server, a child process, inherits it. A TORCHINDUCTOR_CACHE_DIR the user set wins; importing inductor
    sets it to torch's default (/tmp/torchinductor_USER), which does not count. Returns the directory in use."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.abspath(os.path.expanduser(path))
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


def warn_once():
    """Print each warning (category and text) once in this process. Python's default already shows a warning once
    per place, but it forgets what it showed whenever the warning filters change, and torch.compile changes them
    while it works (catch_warnings in dynamo and in inductor's CUDA-graph trees): inductor's "Online softmax is
    disabled on the fly ..." then came back for every graph compiled."""
    show = warnings.showwarning
    if getattr(show, "seen", None) is not None:  # installed already
        return
    seen = set()

    def show_once(message, category, filename, lineno, file=None, line=None):
        if (category, str(message)) not in seen:
            seen.add((category, str(message)))
            show(message, category, filename, lineno, file, line)
    show_once.seen = seen
    warnings.showwarning = show_once


def compile_model(model, mode="layers", backend="inductor", log=print):
    """Whole layers compiled where a step is bound by launching small kernels: each block's forward (one compiled
    function for all: layers of one kind, window / CSA / HCA with a hash or learned router, share a graph, since a
    module's parameters are inputs of the graph, not constants), the head (Transformer.logits: hc_head's collapse, the
    final norm and the head's GEMM) and the last stage's head and loss as one graph (Transformer.head_loss: the chunked
    head's custom ops whole inside it), the loss it is called with traced into it. Each compiled
    callable is an attribute of its module, so every caller of layer(x, ids), model.logits(x) and
    model.head_loss(...) takes it. The first call of each kind compiles (minutes for a 2B model on a GPU). Batch and
    length are symbolic from the first call (_dynamic_dims): every GRPO step brings new lengths, and a graph for the
    first step's exact shape would be compiled again at the second. The CPU tests pass backend="aot_eager": the same
    graphs without code generation. Blocks added later (build the model first) and MTP's stay eager.

    mode='graphs' records each layer's forward and backward as CUDA graphs (inductor's reduce-overhead), so the host
    no longer launches every kernel. It asks for static shapes, no host sync inside a layer, and each forward's
    backward before the next forward; train_grpo.py's schedule (micro-batches in flight, recompute, a new length every
    batch) is not checked against that, so only bench/bench.py offers it. mode='background': the blocks through
    Background (model.background), the head eager; log takes its lines. Returns the model."""
    if mode in ("static", "background"):  # a graph per kind of layer, shape and grad mode: past the limit, eager
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 96)
    if mode == "background":  # the blocks only: the head and loss, compiled in the trainer's thread, would wait
        model.background = Background(model, backend, log)
        return model
    trainer = ((lambda f: torch.compile(f, backend=backend, dynamic=False)) if mode == "static" else
               (lambda f: _dynamic_dims(torch.compile(f, backend=backend))))
    T = model_dsv4.Transformer
    block = (torch.compile(model_dsv4.Block.forward, backend=backend, mode="reduce-overhead") if mode == "graphs"
             else trainer(model_dsv4.Block.forward))
    for layer in model.layers.values():
        layer.forward = types.MethodType(block, layer)
    if model.head is not None:  # the last stage; decode calls the head with length 1, which stays static
        model.logits = trainer(types.MethodType(T.logits, model))
        model.head_loss = trainer(types.MethodType(T.head_loss, model))
    return model


def compile_engine(engine, backend="inductor"):
    """The engine's cache (compile_kv_cache) and its sampler (the Gumbel noise in one kernel) compiled; with
    compile_model(engine.model), its layers' forward and the head. Returns the engine."""
    compile_kv_cache(engine.cache, backend)
    engine.sample_tokens = torch.compile(engine_module.sample_tokens, backend=backend)
    return engine


def compile_kv_cache(cache, backend="inductor"):
    """A KVCache's prefill of a layer, the step's RoPE tables and the decode of a layer, compiled on this cache. The
    prefill pads its length to model_dsv4.length_multiple, so one graph of each kind takes every length; the decode's
    batch is symbolic from the first call, so each layer kind compiles once for every batch bucket (the engine's
    buckets start at 2: a size-1 batch would be specialised into a graph of its own; Engine.warm_up compiles them
    all). Returns the cache."""
    K = kv_cache.KVCache
    cache.prefill_layer = types.MethodType(_dynamic_dims(torch.compile(K.prefill_layer, backend=backend)), cache)
    cache.pad_prefill = True
    cache.decode_layer = types.MethodType(_dynamic_dims(torch.compile(K.decode_layer, backend=backend), 1), cache)
    cache.step_rope = types.MethodType(_dynamic_dims(torch.compile(K.step_rope, backend=backend), 1), cache)
    return cache


def _dynamic_dims(compiled, dims=2):
    """Call `compiled` with its leading `dims` dims (batch, and length) marked dynamic: those of the first tensor
    argument outside a dict, and the same dims of every other tensor argument (dict values too: the losses' micro-batch)
    where the sizes match, so dynamo does not specialise them through an op that joins two tensors. A hint
    (maybe_mark_dynamic): a size 0 or 1 stays static, and a guard the code needs still specialises. For decode (dims=1)
    the engine's cache tensors (a row per slot plus a scratch one) never match the batch, so they stay static."""
    @functools.wraps(compiled)
    def run(*args, **kwargs):
        if not torch.compiler.is_compiling():  # called from compiled code (head_loss -> logits): traced
            values = (*args, *kwargs.values())
            lead = next((a.shape[:dims] for a in values if isinstance(a, torch.Tensor)), ())
            for t in (t for a in values for t in (a.values() if isinstance(a, dict) else (a,))):
                for d, n in enumerate(lead if isinstance(t, torch.Tensor) else ()):
                    if t.dim() > d and t.shape[d] == n:
                        torch._dynamo.maybe_mark_dynamic(t, d)
        return compiled(*args, **kwargs)
    return run


# the backward compiled with its forward, here: compiled lazily, in its first backward, it would be compiled on the
# autograd engine's thread for the GPU, which the trainer's backward waits for meanwhile (an option of newer torch)
EAGER_BACKWARD = ({"force_non_lazy_backward_lowering": True}
                  if hasattr(torch._functorch.config, "force_non_lazy_backward_lowering") else {})


class Background:
    """compile='background': the blocks compiled off the critical path. A block runs eagerly at a shape until a side
    thread has compiled that shape, then its compiled graph; each shape (the inputs' sizes, grad mode) has a graph of
    its own (dynamic=False), and the token-budget layout brings a handful (grpo.plan_microbatches).

    A shape's first forward through the model leaves each block's inputs (detached copies; the first block's streams
    stand for every block's) to the thread, which runs each block's compiled forward on them, and its backward with
    respect to those inputs alone (torch.autograd.grad), so no parameter's .grad moves. Dynamo keys its graphs by the
    code and its guards, not by the caller: the trainer's next call at that shape finds them. `version` counts the
    shapes made ready; graphs.StepGraphs captures again when it grows, so its graphs take the compiled kernels. The
    thread's GPU work runs on a stream of its own, and StepGraphs captures thread-locally. A failure in the thread
    leaves every block eager, said once in the log."""

    def __init__(self, model, backend="inductor", log=print):
        self.compiled = torch.compile(model_dsv4.Block.forward, backend=backend, dynamic=False)
        self.n_layers, self.log = len(model.layers), log
        self.ready, self.seen, self.pending = set(), set(), {}  # shape keys: compiled, handed over, being gathered
        self.version, self.failed, self.closing = 0, None, False
        self.jobs = queue.SimpleQueue()
        self.thread = threading.Thread(target=self.work, daemon=True, name="background compile")
        self.thread.start()
        atexit.register(self.close)
        for layer in model.layers.values():
            layer.forward = types.MethodType(self.forward, layer)

    def forward(self, layer, x, ids, **kw):
        key = (tuple(x.shape), x.requires_grad, tuple(ids.shape), torch.is_grad_enabled(),
               tuple((k, tuple(v.shape) if torch.is_tensor(v) else v is None) for k, v in sorted(kw.items())))
        if key in self.ready:
            return self.compiled(layer, x, ids, **kw)
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        if key not in self.seen and self.failed is None and not capturing:
            copy = lambda v: v.detach().clone() if torch.is_tensor(v) else v
            job = self.pending.setdefault(key, ({}, copy(x).requires_grad_(x.requires_grad), copy(ids)))
            job[0][id(layer)] = (layer, {k: copy(v) for k, v in kw.items()})
            if len(job[0]) == self.n_layers:  # every block has been called at this shape: hand it over
                self.seen.add(key)
                self.jobs.put((key, self.pending.pop(key)))
        return model_dsv4.Block.forward(layer, x, ids, **kw)

    def work(self):
        stream = torch.cuda.Stream() if torch.cuda.is_available() else None
        while (job := self.jobs.get()) is not None and not self.closing:
            key, (layers, x, ids) = job
            t0 = time.perf_counter()
            try:
                with (torch.cuda.stream(stream) if stream else contextlib.nullcontext(), torch.set_grad_enabled(key[3]),
                      torch._functorch.config.patch(**EAGER_BACKWARD)):
                    for layer, kw in layers.values():
                        out = self.compiled(layer, x, ids, **kw)
                        if out.requires_grad:
                            torch.autograd.grad(out, x, torch.ones_like(out))
                    if stream is not None:
                        stream.synchronize()
            except Exception as e:  # noqa: BLE001  (any failure: the blocks stay eager, which is always right)
                self.failed = f"{type(e).__name__}: {str(e)[:300]}"
                if not self.closing:  # at exit torch's compiler may refuse to start: nothing to say
                    self.log(f"background compile failed, the blocks stay eager: {self.failed}")
                return
            self.ready.add(key)
            self.version += 1
            self.log(f"background compile: blocks at {'x'.join(map(str, key[0][:2]))} tokens "
                     f"({'forward + backward' if key[3] else 'forward'}) ready in {time.perf_counter() - t0:.0f} s")

    def close(self):
        """At exit: the shape being compiled is finished, no other one started (the process aborts if it ends while
        the thread is inside torch's compiler)."""
        self.closing = True
        self.jobs.put(None)
        if self.thread.is_alive() and len(self.ready) < len(self.seen) and self.failed is None:
            self.log("background compile: finishing the shape under way before the exit")
        self.thread.join()

    def join(self, timeout=None):
        """Waits until every shape handed over so far is compiled (tests, benchmarks). -> True if none is left."""
        end = time.perf_counter() + (timeout if timeout is not None else float("inf"))
        while len(self.ready) < len(self.seen) and self.failed is None and time.perf_counter() < end:
            time.sleep(0.05)
        return len(self.ready) == len(self.seen)
