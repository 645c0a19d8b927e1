"""
Memory plan of a parallel layout, computed on the meta device from the real config: per pipeline stage, the
bytes of weights, gradients, optimizer state (on the GPU or offloaded) and an activation estimate. No hardware.

    python train_grpo.py config/mi355x.py --dry_run=True     # the config's layout on WORLD_SIZE (else 32) GPUs
    DRY_RUN_WORLD=64 python train_grpo.py config/mi355x.py --dry_run=True     # on another number of GPUs
"""
import torch

from model_dsv4 import Transformer
from parallel import stage_layers


def plan_table(args, pp_size, ep_size, world, micro_batch, seq_len, recompute, n_microbatches, gpu_gb=288,
               pp_layers=None):
    """The memory plan as a markdown table, with a line saying what it assumes: per stage, the bytes of one rank's
    weights (bf16, fp32 where the reference keeps fp32), grads (same dtype), optimizer (fp32 master + two moments =
    12 B/param; in host memory with offload) and an activation estimate for 1F1B with this micro-batch."""
    with torch.device("meta"):
        full = Transformer(args, dtype=torch.bfloat16)
    GB = 1e9
    lines = [f"Memory plan, computed on the meta device (not run): {world} GPUs of {gpu_gb:.0f} GB, pp {pp_size} x "
             f"dp {world // pp_size}, ep {ep_size}, micro-batch {micro_batch} x {seq_len} tokens, {n_microbatches} "
             f"micro-batches, recompute {recompute}.", "",
             "| stage | layers | params per rank | weights GB | grads GB | fp32 master + Adam GB | activations GB "
             "| GPU total GB | GPU total GB, optimizer offloaded |", "|---|---|---|---|---|---|---|---|---|"]
    for pp_rank, layers in enumerate(stage_layers(args.num_hidden_layers, pp_size, pp_layers)):
        first, last = pp_rank == 0, pp_rank == pp_size - 1
        n_param = w_bytes = 0
        for name, p in full.named_parameters():
            top = name.split(".")[0]
            if top == "layers" and int(name.split(".")[1]) not in layers or top == "embed" and not first \
                    or top in ("norm", "head", "mtp", "hc_head_fn", "hc_head_base", "hc_head_scale") and not last:
                continue
            share = 1 / ep_size if ".experts." in name else 1  # routed experts are sharded over EP
            n_param += p.numel() * share
            w_bytes += p.numel() * p.element_size() * share
        tokens = micro_batch * seq_len
        inflight = min(pp_size - pp_rank, n_microbatches)  # 1F1B keeps at most pp - rank micro-batches alive
        stream = tokens * args.hc_mult * args.hidden_size * 2  # one layer input [B, T, n, D] in bf16
        # one layer's working set while it (re)computes: fp32 attention probabilities over the window and a
        # quarter of the sequence (CSA's compressed keys), kept for backward, plus the routed experts' activations
        work = micro_batch * args.num_attention_heads * seq_len * (args.sliding_window + seq_len // 4) * 4 * 2 \
            + tokens * args.num_experts_per_tok * args.moe_intermediate_size * 4 * 3
        act = (inflight * len(layers) * (stream if recompute else 12 * stream) + work) / GB  # 12: rough, no recompute
        weights, optim = w_bytes / GB, 12 * n_param / GB  # the grads take as many bytes as the weights
        lines.append(f"| {pp_rank} | {layers[0]}-{layers[-1]} | {n_param / 1e9:.2f}B | {weights:.1f} | {weights:.1f} "
                     f"| {optim:.1f} | {act:.1f} | {2 * weights + act + optim:.1f} | {2 * weights + act:.1f} |")
    return "\n".join(lines)

