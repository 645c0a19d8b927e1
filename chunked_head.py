"""
The output head and what a token loss reads from the vocabulary, a chunk of tokens at a time.

A GRPO (or SFT) loss reads two numbers a token from the head's fp32 logits [tokens, vocab]: the target token's
logprob and the entropy of softmax(logits / T), T the rollouts' sampling temperature (the distribution the engine
samples from and reports logprobs of; a trainer at T = 1 beside an engine at 0.8 would weigh one policy's samples by
another's probabilities). Kept whole for the backward, those logits grow with answer length: a
micro-batch of 8 answers of 2,048 tokens at V4's 129k vocabulary holds 8.7 GB of them, and log_softmax's output as
much again. Here the head's GEMM, the log-softmax, the target's logprob and the entropy run over `chunk` tokens at a
time (a chunk's fp32 logits: chunk x vocab x 4 bytes, 0.53 GB for 1,024 tokens of V4). The backward keeps only the
head's input [tokens, dim], the targets and the entropies; it computes each chunk's logits again, forms their gradient
and turns it at once into the chunk's rows of the input's gradient and its share of the weight's (summed in fp32).
This is the pattern of fused linear-cross-entropy kernels (Liger, Cut Cross-Entropy, TRL's chunked logprobs), for the
two outputs a policy-gradient loss needs; it costs one more head GEMM a chunk in the backward.

The forward and the backward are custom ops: torch.compile keeps them whole inside a compiled head + loss (no graph
break, any number of tokens), and PathInvariant runs their Python code under its fp64 sums. `from_logits` is the
plain reference: the same values from whole logits, through autograd.

Shape legend: N tokens, D hidden, V vocabulary, c tokens a chunk.
"""
from typing import Optional

import torch

from dsv4_kernels.fast import addmm_f32_, linear_f32, mm_f32
from dsv4_kernels.invariant import PathInvariant


def from_logits(logits, tgt, temperature=1.0):
    """fp32 logits [..., V] and targets [...] -> (logprob of each target, entropy) of softmax(logits / temperature),
    each [...]: the reference."""
    lsm = (logits / temperature if temperature != 1 else logits).log_softmax(-1)
    return lsm.gather(-1, tgt[..., None])[..., 0], -(lsm.exp() * lsm).sum(-1)


def reference(h, w, tgt, temperature=1.0):
    """token_stats without chunks: the whole [..., V] logits, kept by autograd for the backward."""
    return from_logits(linear_f32(h, w), tgt, temperature)


def token_stats(h, w, tgt, chunk=1024, temperature=1.0):
    """h [..., D] (the head's input), w [V, D] (the head's weight), tgt [...] -> (logprob of each target, entropy)
    of softmax(logits / temperature), the distribution the engine samples from and reports logprobs of, fp32 [...];
    the logits exist a chunk of tokens at a time, here and in the backward."""
    lp, ent = head_token_stats(h.reshape(-1, h.shape[-1]), w, tgt.reshape(-1), int(chunk), float(temperature))
    return lp.view(tgt.shape), ent.view(tgt.shape)


def _chunk_log_softmax(h, w, s, chunk, temperature):
    z = mm_f32(h[s:s + chunk], w.t())  # [c, V] fp32, freed once read
    if temperature != 1:  # divided by a tensor, as the engine divides (a GPU multiplies by a Python scalar's inverse)
        z.div_(torch.full((), temperature, device=z.device))
    return z.log_softmax(-1)


def _forward(h, w, tgt, chunk, temperature):
    logp = h.new_empty(h.shape[0], dtype=torch.float32)
    entropy = torch.empty_like(logp)
    for s in range(0, h.shape[0], chunk):
        lsm = _chunk_log_softmax(h, w, s, chunk, temperature)
        logp[s:s + chunk] = lsm.gather(-1, tgt[s:s + chunk, None])[:, 0]
        entropy[s:s + chunk] = -lsm.exp().mul_(lsm).sum(-1)
    return logp, entropy


def _backward(h, w, tgt, entropy, g_lp, g_ent, chunk, temperature):
    """With z = logits / temperature: d logprob_t / dz_j = [j = t] - p_j, d entropy / dz_j = -p_j (log p_j +
    entropy). g_ent is None when the entropy has no gradient (a metric only): its pass over the chunk is skipped."""
    g_lp = torch.zeros_like(entropy) if g_lp is None else g_lp
    gh, gw = torch.empty_like(h), None
    for s in range(0, h.shape[0], chunk):
        rows = slice(s, s + chunk)
        gz = _chunk_log_softmax(h, w, s, chunk, temperature)  # the chunk's log-softmax, in place into its gradient
        if g_ent is None:
            coef = -g_lp[rows, None]
        else:
            coef = (gz + entropy[rows, None]).mul_(g_ent[rows, None]).add_(g_lp[rows, None]).neg_()
        gz = gz.exp_().mul_(coef).scatter_add_(-1, tgt[rows, None], g_lp[rows, None])
        del coef
        if temperature != 1:
            gz.div_(torch.full((), temperature, device=gz.device))
        gz = gz.to(h.dtype)  # the head's GEMMs read bf16 on a GPU (and the fp32 [c, V] is freed before them)
        gh[rows] = mm_f32(gz, w).to(h.dtype)
        if gw is None:  # [V, D] fp32: the chunks' shares summed in place, then rounded once
            gw = mm_f32(gz.t(), h[rows])
        else:
            addmm_f32_(gw, gz.t(), h[rows])
    return gh, gw.to(w.dtype)


@torch.library.custom_op("nano_dsv4::head_token_stats", mutates_args=())
def head_token_stats(h: torch.Tensor, w: torch.Tensor, tgt: torch.Tensor, chunk: int,
                     temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """h [N, D], w [V, D], tgt [N] -> (logprob [N], entropy [N]) fp32, `chunk` tokens at a time."""
    return _forward(h, w, tgt, chunk, temperature)


@torch.library.custom_op("nano_dsv4::head_token_stats_backward", mutates_args=())
def head_token_stats_backward(h: torch.Tensor, w: torch.Tensor, tgt: torch.Tensor, entropy: torch.Tensor,
                              g_lp: Optional[torch.Tensor], g_ent: Optional[torch.Tensor], chunk: int,
                              temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _backward(h, w, tgt, entropy, g_lp, g_ent, chunk, temperature)


head_token_stats.register_fake(lambda h, *rest: (h.new_empty(h.shape[0], dtype=torch.float32),
                                                 h.new_empty(h.shape[0], dtype=torch.float32)))
head_token_stats_backward.register_fake(lambda h, w, *rest: (torch.empty_like(h), torch.empty_like(w)))
PathInvariant.DECOMPOSE[torch.ops.nano_dsv4.head_token_stats.default] = _forward
PathInvariant.DECOMPOSE[torch.ops.nano_dsv4.head_token_stats_backward.default] = _backward


def _setup(ctx, inputs, output):
    h, w, tgt, ctx.chunk, ctx.temperature = inputs
    ctx.save_for_backward(h, w, tgt, output[1])
    ctx.set_materialize_grads(False)  # an output without a gradient comes as None, not as zeros


def _grad(ctx, g_lp, g_ent):
    h, w, tgt, entropy = ctx.saved_tensors
    grads = head_token_stats_backward(h, w, tgt, entropy, g_lp, g_ent, ctx.chunk, ctx.temperature)
    return (*grads, None, None, None)


head_token_stats.register_autograd(_grad, setup_context=_setup)
