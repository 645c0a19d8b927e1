"""The chunked head (chunked_head.py, Transformer.head_loss): the token logprobs and entropies, the GRPO loss and every
gradient equal the whole-logits reference; no tensor of [every token x vocabulary] is kept for the backward or made
at all, in the training step or the no-grad logprob passes, whatever the answer length; the dry run's loss peak."""
from dataclasses import replace

import pytest
import torch

import grpo
from chunked_head import from_logits, reference, token_stats
from conftest import randomize_
from dsv4_kernels.invariant import PathInvariant
from grpo import grpo_loss
from memory_plan import loss_peak
from model_dsv4 import ModelArgs, Transformer

# a wide vocabulary beside a narrow model, so that [tokens x vocabulary] outgrows everything else the head holds
ARGS = ModelArgs(vocab_size=1024, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, head_dim=32,
                 qk_rope_head_dim=16, q_lora_rank=32, o_groups=1, o_lora_rank=32, sliding_window=8,
                 compress_ratios=[0], n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                 num_hash_layers=0, hc_mult=2, hc_sinkhorn_iters=3, num_nextn_predict_layers=0)
CUDA = torch.cuda.is_available()


def head_model(chunk, device="cpu", dtype=torch.float32):
    m = randomize_(Transformer(ARGS, dtype=torch.float32), ARGS.n_routed_experts, ARGS.num_experts_per_tok, seed=2)
    m.loss_chunk = chunk
    return m.set_dtype(dtype).to(device)


def micro_batch(T, B=2, seed=0, device="cpu", dtype=torch.float32):
    """Streams x [B, T, n, D] for the last stage and a GRPO micro-batch over them, old logprobs off the policy."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, ARGS.hc_mult, ARGS.hidden_size, generator=g).to(device, dtype)
    mb = {"tgt": torch.randint(0, ARGS.vocab_size, (B, T), generator=g), "mask": torch.rand(B, T, generator=g) < 0.7,
          "adv": torch.randn(B, 1, generator=g).expand(B, T), "rollout_lp": -torch.rand(B, T, generator=g) * 6,
          "old_lp": -torch.rand(B, T, generator=g) * 6, "ref_lp": -torch.rand(B, T, generator=g) * 6,
          "weight": torch.full((B, T), 1.0 / T), "first": torch.zeros(B, T, dtype=torch.bool)}
    mb["first"][:, 0] = True
    return x, {k: v.to(device) for k, v in mb.items()}


@pytest.mark.parametrize("chunk,temperature", [(1, 1.0), (7, 1.0), (96, 1.0), (1000, 1.0), (7, 0.7)])
def test_token_stats_equal_the_whole_logits(chunk, temperature):
    """token_stats in chunks of 1, 7, all 96 tokens and more than there are, and at a sampling temperature: the
    logprobs and entropies, and the gradients of the head's input and weight from both outputs (and from the logprobs
    alone: the entropy's pass skipped), as the whole logits' reference through autograd, fp32."""
    g = torch.Generator().manual_seed(1)
    h0, w0 = torch.randn(4, 24, 16, generator=g), torch.randn(300, 16, generator=g)
    tgt, c_lp, c_ent = torch.randint(0, 300, (4, 24), generator=g), torch.randn(4, 24, generator=g), torch.randn(4, 24)
    for with_entropy in (False, True):
        out = []
        for fn in (lambda h, w: token_stats(h, w, tgt, chunk, temperature),
                   lambda h, w: reference(h, w, tgt, temperature)):
            h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
            lp, ent = fn(h, w)
            ((lp * c_lp).sum() + (ent * c_ent).sum() * with_entropy).backward()
            out.append((lp, ent, h.grad, w.grad))
        for a, b in zip(*out):  # fp32 sums in another order: apart by a few roundings of the largest element
            assert 0 < (a - b).abs().max() <= 1e-5 * b.abs().max() or torch.equal(a, b)


def test_chunked_head_loss_and_gradients_equal_the_whole_logits():
    """Transformer.head_loss with chunks of 7 tokens and the GRPO loss (clip, TIS, KL, the entropy bonus): loss, every
    metric and the gradients of the streams and the head's parameters equal the whole logits' path (Transformer.logits,
    then chunked_head.from_logits) in fp32."""
    m = head_model(7)
    x0, mb = micro_batch(40)
    params = [m.head.weight, m.norm.weight, m.hc_head_fn]
    loss_fn = lambda lp, ent, mb: grpo_loss(lp, ent, mb, kl_coef=0.1, entropy_coef=0.01)
    out = []
    for head_loss in (m.head_loss, lambda x, mb, fn: fn(*from_logits(m.logits(x), mb["tgt"]), mb)):
        x = x0.clone().requires_grad_()
        loss, metrics = head_loss(x, mb, loss_fn)
        out.append(([loss, *torch.autograd.grad(loss, [x, *params])], metrics))
    (chunked, m1), (whole, m0) = out
    assert m0["clip"] > 0 and m0["tis"] > 0
    for a, b in zip(chunked, whole):
        assert b.abs().max() > 0 and (a - b).abs().max() <= 1e-5 * b.abs().max()
    assert all(torch.allclose(m1[k], m0[k], rtol=1e-5, atol=1e-6) for k in m0)


def test_trainer_scores_the_engines_samples_at_the_sampling_temperature():
    """Samples drawn at temperature 0.7 by the engine, scored by the trainer's step (make_microbatches, the stage's
    forward, head_loss with the model's temperature, grpo_loss): its |logprob - the engine's| metric is rounding, and a
    trainer left at temperature 1 would be off by the temperature's effect (what TIS would then reweight by)."""
    import parallel
    from engine import Engine, SamplingParams
    from grpo import make_microbatches
    m = head_model(16)
    prompts = [[5, 6, 7, 8], [9] * 11]
    reqs = Engine(m, max_batch=4, max_len=64).generate(prompts, SamplingParams(temperature=0.7, max_new_tokens=12,
                                                                               ignore_eos=True, seed=1))
    groups = [(p, [{"output_ids": r.output_ids, "logprobs": r.output_logprobs}], [1.0]) for p, r in zip(prompts, reqs)]
    mb = make_microbatches(groups, 1, 2.0)[0]
    diff = {}
    for T in (0.7, 1.0):
        m.temperature = T
        with torch.no_grad():
            _, metrics = m.head_loss(parallel.stage_forward(m, None, mb["input_ids"]), mb, grpo_loss)
        diff[T] = metrics["lp_diff"].item() / metrics["n_tok"].item()
    assert diff[0.7] <= 1e-5 and diff[1.0] > 1e-2, diff


def test_path_invariant_mode_runs_the_chunked_head_in_fp64():
    """Under PathInvariant (set_invariant: the trainer and the engine bit-equal) the chunked head's logprobs equal the
    whole logits' to the bit: the mode runs the custom op's own code with its sums in fp64."""
    g = torch.Generator().manual_seed(2)
    h, w, tgt = torch.randn(50, 16, generator=g), torch.randn(300, 16, generator=g), torch.randint(0, 300, (50,))
    with PathInvariant():
        chunked, whole = token_stats(h, w, tgt, 7), reference(h, w, tgt)
    assert all(torch.equal(a, b) for a, b in zip(chunked, whole))


def test_no_saved_tensor_spans_every_token_and_the_vocabulary():
    """The GRPO step's last stage (head_loss, chunks of 64 tokens) keeps nothing of [every token x vocabulary] for the
    backward at 2 x 150 and at 2 x 600 tokens (saved_tensors_hooks: the largest tensor saved with a vocabulary
    dimension is the head's weight either way); the whole logits' path keeps one, so the hook would see it."""
    def largest_saved(head_loss, T):
        x, mb = micro_batch(T)
        seen = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t.shape) or t, lambda t: t):
            loss, _ = head_loss(x.requires_grad_(), mb, grpo_loss)
        loss.backward()
        return max((s.numel() for s in seen if ARGS.vocab_size in s), default=0)
    m = head_model(64)
    whole = lambda x, mb, fn: fn(*from_logits(m.logits(x), mb["tgt"]), mb)
    weight = m.head.weight.numel()
    assert largest_saved(m.head_loss, 150) == largest_saved(m.head_loss, 600) == weight
    assert largest_saved(whole, 600) >= 2 * 600 * ARGS.vocab_size > 10 * weight


class LargestVocabTensor(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the most elements of any tensor an op makes with a vocabulary-sized dimension; the chunked head's
    custom ops run their own code under the mode, as PathInvariant runs them."""
    def __init__(self):
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in PathInvariant.DECOMPOSE:
            with self:
                return PathInvariant.DECOMPOSE[func](*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and ARGS.vocab_size in t.shape:
                self.most = max(self.most, t.numel())
        return out


def test_no_tensor_of_every_token_and_the_vocabulary_is_made():
    """Forward, backward and the no-grad logprob pass (parallel.forward_only's, for the old policy or a reference)
    at 2 x 600 tokens in chunks of 64: no op makes a tensor bigger than a chunk's logits or the head's weight; the
    whole logits' path makes [2 x 600 x vocabulary]."""
    m = head_model(64)
    x, mb = micro_batch(600)
    bound = max(64 * ARGS.vocab_size, m.head.weight.numel())
    with LargestVocabTensor() as train:
        loss, _ = m.head_loss(x.clone().requires_grad_(), mb, lambda lp, ent, mb: grpo_loss(lp, ent, mb,
                                                                                              entropy_coef=0.01))
        loss.backward()
    with torch.no_grad(), LargestVocabTensor() as scoring:
        lp = m.head_loss(x, mb, grpo.token_logprobs)
    with torch.no_grad(), LargestVocabTensor() as whole:
        from_logits(m.logits(x), mb["tgt"])
    assert lp.shape == (2, 600) and m.head.weight.grad.abs().max() > 0
    assert 0 < train.most <= bound and 0 < scoring.most <= bound
    assert whole.most == 2 * 600 * ARGS.vocab_size > 10 * bound


def test_loss_peak_does_not_grow_with_the_vocabulary_times_length():
    """memory_plan.loss_peak (the dry run's loss line) at V4's vocabulary: the head's input grows with the tokens, a
    chunk's logits do not; the whole logits would grow by 0.5 GB a 1,000 tokens."""
    v4 = replace(ARGS, vocab_size=129280, hidden_size=4096)
    short, long = loss_peak(v4, 2048, 1024), loss_peak(v4, 32768, 1024)
    assert long - short < 0.05 * 4 * (32768 - 2048) * v4.vocab_size
    assert loss_peak(v4, 32768, 1024, entropy_grad=True) > long  # the bonus's gradient: one more [chunk x vocab]


@pytest.mark.skipif(not CUDA, reason="CUDA: bf16 GEMMs with fp32 results, the allocator's peak")
def test_chunked_head_on_a_gpu_within_its_planned_peak():
    """bf16 on a GPU (the head's GEMMs in bf16 with fp32 results, the weight's gradient summed in place in fp32): the
    GRPO loss and its gradients match the whole logits' path to bf16 rounding, and the peak memory of the forward and
    backward stays within memory_plan.loss_peak for 8 x 2048 tokens at bench_2b's head; the whole logits' path
    exceeds the logits' size."""
    args = replace(ARGS, vocab_size=129280, hidden_size=1536)
    head = torch.randn(args.vocab_size, args.hidden_size, device="cuda", dtype=torch.bfloat16) * 0.02
    head.requires_grad_()
    g = torch.Generator().manual_seed(3)
    h0 = torch.randn(8, 2048, args.hidden_size, generator=g).to("cuda", torch.bfloat16)
    tgt = torch.randint(0, args.vocab_size, (8, 2048), generator=g).cuda()
    out = []
    for stats in (lambda h: token_stats(h, head, tgt, 1024), lambda h: reference(h, head, tgt)):
        h = h0.clone().requires_grad_()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        held = torch.cuda.memory_allocated()
        lp, ent = stats(h)
        (lp.mean() + 0.01 * ent.mean()).backward()
        torch.cuda.synchronize()
        out.append((lp.detach(), h.grad, head.grad, torch.cuda.max_memory_allocated() - held))
        head.grad = None
    (lp1, gh1, gw1, peak1), (lp0, gh0, gw0, peak0) = out
    for a, b in ((lp1, lp0), (gh1, gh0), (gw1, gw0)):
        assert (a.float() - b.float()).norm() <= 2e-2 * b.float().norm()
    assert peak1 <= loss_peak(args, 8 * 2048, 1024, entropy_grad=True) < 4 * 8 * 2048 * args.vocab_size < peak0
