"""
Which functions torch.compile wraps: a program's decision, made once by the entry points (train_grpo.py, server.py,
bench/bench.py) before they build models. The model and the engine stay plain eager code; this module swaps some of their
functions for compiled ones where they are looked up, so one call covers the trainer, the engine's prefill and its
decode (inside the engine's CUDA graphs) alike.

  'off'     eager
  'hot'     the chains of small elementwise ops: mHC's activations and Sinkhorn, norms, RoPE (compile_hot_paths)
  'layers'  a whole layer at a time, the head and the losses (compile_layers)
  'graphs'  bench/bench.py only: 'layers' with the trainer's layers recorded as CUDA graphs

Any mode but 'off' also keeps inductor's compiled graphs and Triton kernels in one directory the user sees
(`compile_cache`, default out/compile_cache), so a second launch loads what the first compiled, and prints each
library warning once.
"""
import functools
import os
import warnings

import torch

import engine
import grpo
import kv_cache
import mhc
import model_dsv4
import parallel


def use_compile(mode, cache_dir="out/compile_cache"):
    """Returns the compile cache's directory, or None when mode is 'off'."""
    if mode not in ("off", "hot", "layers", "graphs"):
        raise ValueError(f"compile must be 'off', 'hot' or 'layers', got {mode!r}")
    if mode == "off":
        return None
    warn_once()
    if mode == "hot":
        compile_hot_paths()
    else:
        compile_layers(graphs=mode == "graphs")
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


def compile_layers(backend="inductor", graphs=False):
    """torch.compile a whole layer at a time, where a step is bound by launching small kernels: Block.forward (the
    trainer's layers and MTP), the head (Transformer.logits), the GRPO losses, the engine's prefill and decode of a
    layer and its sampler. Layers of one kind (window / CSA / HCA, hash or learned router) share one graph, since a
    module's parameters are inputs of the graph, not constants. The first call of each kind compiles (minutes for a
    2B model on a GPU).

    The trainer's functions and the prefill take batch and length as symbolic from the first call
    (_dynamic_dims): every GRPO step brings new lengths, and a graph for the first step's exact shape
    would be compiled again at the second. The prefill pads its length to model_dsv4.length_multiple, so one graph of
    each kind takes every length. Decode keeps static shapes: its batch buckets repeat (Engine.warm_up compiles them).
    The CPU tests pass backend="aot_eager": the same graphs without code generation.

    graphs=True adds mode="reduce-overhead" to Block.forward: inductor records each layer's forward and backward as
    CUDA graphs, so the host no longer launches every kernel. It asks for static shapes, no host sync inside a layer,
    and each forward's backward before the next forward; train_grpo.py's schedule (micro-batches in flight,
    recompute, a new length every batch) is not checked against that, so only bench/bench.py offers it."""
    import torch._inductor.config  # here: importing inductor takes seconds, and most runs stay eager
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)  # kinds x shapes
    # inductor's pad_mm pass weighs a GEMM's arithmetic intensity on the symbolic sizes and so guards on batch x
    # length (a prefill compiled again at a new shape); V4's dims and the padded lengths are multiples of 64 already
    torch._inductor.config.shape_padding = False
    trainer = (lambda f: torch.compile(f, backend=backend)) if graphs else \
              (lambda f: _dynamic_dims(torch.compile(f, backend=backend)))
    m = model_dsv4
    m.Block.forward = torch.compile(m.Block.forward, backend=backend, mode="reduce-overhead") if graphs \
        else trainer(m.Block.forward)
    # the head: hc_head's collapse of the streams, the final norm and the head's GEMM (decode calls it with length
    # 1, which stays static: dynamo specialises sizes 0 and 1)
    m.Transformer.logits = trainer(m.Transformer.logits)
    # the losses: log-softmax, gather and entropy fused into a pass or two over the fp32 logits
    grpo.grpo_loss, grpo.token_logprobs = (trainer(f) for f in (grpo.grpo_loss, grpo.token_logprobs))
    # the last stage's head and loss in one graph: the loss's backward writes the logits' gradient in bf16
    parallel.head_loss = trainer(parallel.head_loss)
    kv_cache.KVCache.prefill_layer = trainer(kv_cache.KVCache.prefill_layer)
    kv_cache.KVCache.pad_prefill = True
    # decode: the batch symbolic from the first call, so each layer kind compiles once for every batch bucket (the
    # engine's buckets start at 2: a size-1 batch would be specialised into a graph of its own)
    kv_cache.KVCache.decode_layer = _dynamic_dims(torch.compile(kv_cache.KVCache.decode_layer, backend=backend), 1)
    kv_cache.KVCache.step_rope = _dynamic_dims(torch.compile(kv_cache.KVCache.step_rope, backend=backend), 1)
    engine.sample_tokens = torch.compile(engine.sample_tokens, backend=backend)  # the Gumbel noise: one kernel


def _dynamic_dims(compiled, dims=2):
    """Call `compiled` with its leading `dims` dims (batch, and length) marked dynamic: those of the first tensor
    argument outside a dict, and the same dims of every other tensor argument (dict values too: the losses' micro-batch)
    where the sizes match, so dynamo does not specialise them through an op that joins two tensors. A hint
    (maybe_mark_dynamic): a size 0 or 1 stays static, and a guard the code needs still specialises. For decode (dims=1)
    the engine's cache tensors (a row per slot plus a scratch one) never match the batch, so they stay static."""
    @functools.wraps(compiled)
    def run(*args, **kwargs):
        if not torch.compiler.is_compiling():  # called from compiled code (grpo_loss -> token_logprobs): traced
            values = (*args, *kwargs.values())
            lead = next((a.shape[:dims] for a in values if isinstance(a, torch.Tensor)), ())
            for t in (t for a in values for t in (a.values() if isinstance(a, dict) else (a,))):
                for d, n in enumerate(lead if isinstance(t, torch.Tensor) else ()):
                    if t.dim() > d and t.shape[d] == n:
                        torch._dynamo.maybe_mark_dynamic(t, d)
        return compiled(*args, **kwargs)
    return run


def compile_hot_paths():
    """torch.compile the chains of small elementwise ops that leave a GPU waiting on launches: mHC's activations and
    Sinkhorn (with the fast kernels off, 20 iterations of sum and divide a sublayer), norms and RoPE."""
    compile = lambda fn: torch.compile(fn, dynamic=True)
    m = model_dsv4
    m.hc_split_sinkhorn, m.hc_mixes, m.apply_rope = (compile(f) for f in (m.hc_split_sinkhorn, m.hc_mixes,
                                                                          m.apply_rope))
    mhc.hc_mixes = m.hc_mixes  # where hc_head looks it up
    m.Block.hc_post = compile(m.Block.hc_post)
    m.RMSNorm.forward = compile(m.RMSNorm.forward)
