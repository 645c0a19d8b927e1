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
    def step(self, chunk=1 << 28):
        """One update from the parameters' gradients, which it takes (each parameter's .grad becomes None), about
        `chunk` parameters at a time: their gradients copied to fp32 and torch's multi-tensor AdamW run on them alone
        (it skips a parameter without a gradient), so the fp32 copies and AdamW's temporaries (8 bytes a parameter at
        once) exist for a chunk, not for the model (1 GB each for a chunk of 2**28)."""
        start = 0
        while start < len(self.params):
            end, n = start, 0
            while end < len(self.params) and (n == 0 or n + self.params[end].numel() <= chunk):
                n, end = n + self.params[end].numel(), end + 1
            params, masters = self.params[start:end], self.master[start:end]
            have = [(p, m) for p, m in zip(params, masters) if p.grad is not None]
            if have:  # the chunk's gradients in one fp32 buffer, copied by one multi-tensor op
                flat = torch.empty(sum(p.numel() for p, _ in have), dtype=torch.float32, device=have[0][1].device)
                grads = [g.view_as(p) for g, (p, _) in zip(flat.split([p.numel() for p, _ in have]), have)]
                torch._foreach_copy_(grads, [p.grad for p, _ in have])
                for (p, m), g in zip(have, grads):
                    m.grad, p.grad = g, None
                del flat
            self.opt.step()
            if params[0].device == masters[0].device:
                torch._foreach_copy_(params, masters)
            else:  # offloaded: the new weights back to the device
                for p, m in zip(params, masters):
                    p.copy_(m.to(p.device, non_blocking=True))
            for m in masters:
                m.grad = None
            start = end

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def state_dict(self):
        return {"opt": self.opt.state_dict(), "master": [m.cpu() for m in self.master]}

    def load_state_dict(self, sd):
        self.opt.load_state_dict(sd["opt"])
        for m, saved in zip(self.master, sd["master"]):
            m.copy_(saved)
