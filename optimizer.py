"""
AdamW on fp32 master copies of the parameters, for a bf16 (or fp32) model: the master weights and both moments live
on the device or, with offload=True, in host memory, where the step runs on the CPU and the new weights are copied
back. Offloading frees 12 bytes per parameter of device memory (config/mi355x.py offloads). parallel.train_step
calls step() after the gradient reduce and the global clip.
"""
import math

import torch


def lr_at(step, lr, warmup_steps=0, schedule="constant", max_steps=1, min_lr_ratio=0.1):
    """The learning rate of a step: a linear warm-up over warmup_steps, then constant, or a linear or cosine decay
    to min_lr_ratio * lr at max_steps."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    t = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    decay = {"constant": 1.0, "linear": 1 - t, "cosine": 0.5 * (1 + math.cos(math.pi * t))}[schedule]
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * decay)


class AdamW:
    """torch.optim.AdamW on the fp32 masters; matrices decay, norms and biases do not."""
    def __init__(self, params, lr, betas=(0.9, 0.95), weight_decay=0.0, eps=1e-8, offload=False):
        self.params = [p for p in params if p.requires_grad]
        home = torch.device("cpu") if offload else None
        self.master = [p.detach().to(device=home or p.device, dtype=torch.float32, copy=True) for p in self.params]
        decay = [m for m, p in zip(self.master, self.params) if p.dim() >= 2]  # matrices decay; norms, biases don't
        no_decay = [m for m, p in zip(self.master, self.params) if p.dim() < 2]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                                      {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=betas, eps=eps)

    @property
    def param_groups(self):
        return self.opt.param_groups

    @torch.no_grad()
    def step(self):
        """One update from the parameters' gradients, which it takes: each becomes its master's fp32 gradient and
        leaves the parameter (None), so a bf16 and an fp32 copy of every gradient are never held together."""
        for p, m in zip(self.params, self.master):
            m.grad = p.grad.to(device=m.device, dtype=torch.float32) if p.grad is not None else None
            p.grad = None
        self.opt.step()
        for p, m in zip(self.params, self.master):
            p.copy_(m.to(p.device, non_blocking=True))
            m.grad = None

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def state_dict(self):
        return {"opt": self.opt.state_dict(), "master": [m.cpu() for m in self.master]}

    def load_state_dict(self, sd):
        self.opt.load_state_dict(sd["opt"])
        for m, saved in zip(self.master, sd["master"]):
            m.copy_(saved)
