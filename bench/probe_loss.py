"""The loss over the vocabulary in bench_2b's training step (4096 x 129280 fp32 logits), forward+backward, on a GPU:
F.cross_entropy (what bench.py's training step takes), grpo.grpo_loss eager (what train_grpo.py runs), and
grpo.grpo_loss compiled (what kernels_torch.compile_layers swaps in), and grpo.token_logprobs (what bench.py's step
takes), each with the target logprob's written-out backward (grpo._TargetLogprob, session 15) and with autograd's
through log_softmax and gather (before). Session 9 ran this as part of bench/probe_hc_loss.py (commit fa6e1c2).
python bench/probe_loss.py"""
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import grpo  # noqa: E402
from probe_timing import timed  # noqa: E402


ids = torch.randint(0, 129280, (1, 4096), device="cuda")
mask = torch.ones_like(ids, dtype=torch.bool)
mask[:, -1] = False
adv = torch.ones(ids.shape, device="cuda")
mb = {"tgt": ids.roll(-1, 1), "mask": mask, "adv": adv, "rollout_lp": torch.zeros_like(adv),
      "weight": torch.full_like(adv, 1 / 4095), "first": torch.zeros_like(mask)}  # all response, on-policy
logits = torch.randn(1, 4096, 129280, device="cuda").requires_grad_()
written_out = grpo.token_logprobs
plain = lambda lg, mb: lg.log_softmax(-1).gather(-1, mb["tgt"][..., None])[..., 0]
print(f"loss over 4096 x 129280 logits, forward+backward, {torch.cuda.get_device_name()}, torch {torch.__version__}")
ce = lambda: F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
print(f"  {'F.cross_entropy':52s} {timed(lambda: ce().backward(), 10):6.2f} ms", flush=True)
for backward, lp_fn in (("written-out backward", written_out), ("autograd's backward", plain)):
    grpo.token_logprobs = lp_fn  # grpo_loss looks it up when called (and compile when it traces)
    torch._dynamo.reset()
    loss_c, lp_c = torch.compile(grpo.grpo_loss), torch.compile(lp_fn)
    for name, f in ((f"grpo_loss eager, {backward}", lambda: grpo.grpo_loss(logits, mb)[0]),
                    (f"grpo_loss compiled, {backward}", lambda: loss_c(logits, mb)[0]),
                    (f"token_logprobs compiled, {backward}", lambda: -lp_c(logits, mb)[:, :-1].mean())):
        print(f"  {name:52s} {timed(lambda: f().backward(), 10):6.2f} ms", flush=True)
