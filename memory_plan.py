"""
Memory plan of a parallel layout, computed on the meta device from the real config: per pipeline stage, the
bytes of weights, gradients, optimizer state (on the GPU or offloaded), an activation estimate and the loss's peak on
the longest micro-batch. No hardware.

    python train_grpo.py config/mi355x.py --dry_run=True     # the config's layout on dry_run_world (32) GPUs
    python train_grpo.py config/mi355x.py --dry_run=True --dry_run_world=64      # on another number of GPUs
    python train_grpo.py config/h200.py --dry_run=True       # one GPU: does a length fit before launch?
"""
import resource

import torch
import torch.distributed as dist

from model_dsv4 import Transformer
from parallel import all_reduce, stage_layers


def loss_peak(args, tokens, chunk, act_bytes=2, entropy_grad=False):
    """Bytes the last stage's head and loss (Transformer.head_loss, chunked_head.py) hold at their peak for a
    micro-batch of `tokens`, besides the weights: the head's input kept for the backward and its gradient
    [tokens, D]; then the most of: a chunk's fp32 logits with their log-softmax (8 bytes a logit; 10 in the backward
    with an entropy bonus, whose gradient needs one more) beside the head weight's gradient, summed in fp32 (4 bytes a
    weight); or that sum rounded to the weight's dtype at the end (6 bytes a weight). Per-token vectors: ~100 bytes
    a token; the GEMMs' workspaces: 64 MB."""
    c, V, D = min(chunk, tokens), args.vocab_size, args.hidden_size
    logits = (10 if entropy_grad else 8) * c * V + 4 * V * D
    return 2 * act_bytes * tokens * D + 100 * tokens + max(logits, (4 + act_bytes) * V * D) + 64e6


def plan_table(args, pp_size, ep_size, world, micro_batch, seq_len, recompute, n_microbatches, pp_layers=None,
               loss_chunk=1024, entropy_grad=False):
    """The memory plan as a markdown table, with lines saying what it assumes: per stage, the bytes of one rank's
    weights (bf16, fp32 where the reference keeps fp32), grads (same dtype), optimizer (fp32 master + two moments =
    12 B/param; in host memory with offload), an activation estimate for 1F1B with this micro-batch, on the last
    stage the loss's peak for it (loss_peak), and the AdamW step's transients on the GPU (optimizer.AdamW.step, a
    chunk of 2**28 parameters at a time: their fp32 gradients and torch's multi-tensor AdamW's fp32 temporaries, 8
    B/param). The total: weights, optimizer, the backward's (grads, activations, loss) and the step's, all at once:
    training graphs (graphs.py) keep their activations' memory pool through the step."""
    with torch.device("meta"):
        full = Transformer(args, dtype=torch.bfloat16)
    GB = 1e9
    tokens = micro_batch * seq_len
    loss = loss_peak(args, tokens, loss_chunk, entropy_grad=entropy_grad) / GB
    whole = 4 * tokens * args.vocab_size / GB
    lines = [f"Memory plan, computed on the meta device (not run): {world} GPUs, pp {pp_size} x dp {world // pp_size}, "
             f"ep {ep_size}, the longest micro-batch {micro_batch} x {seq_len} tokens, {n_microbatches} micro-batches, "
             f"recompute {recompute}.",
             f"The loss (last stage) on that micro-batch: {loss:.2f} GB at its peak, its logits {loss_chunk} tokens at "
             f"a time (loss_chunk); all {tokens} tokens' fp32 logits at once would be {whole:.1f} GB.",
             "", "| stage | layers | params per rank | weights GB | grads GB | fp32 master + Adam GB | activations GB "
             "| loss GB | AdamW step GB (a chunk) | GPU total GB | GPU total GB, optimizer offloaded |",
             "|---" * 11 + "|"]
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
        inflight = min(pp_size - pp_rank, n_microbatches)  # 1F1B keeps at most pp - rank micro-batches alive
        stream = tokens * args.hc_mult * args.hidden_size * 2  # one layer input [B, T, n, D] in bf16
        # one layer's working set while it (re)computes: fp32 attention probabilities over the window and a
        # quarter of the sequence (CSA's compressed keys), kept for backward, plus the routed experts' activations
        work = micro_batch * args.num_attention_heads * seq_len * (args.sliding_window + seq_len // 4) * 4 * 2 \
            + tokens * args.num_experts_per_tok * args.moe_intermediate_size * 4 * 3
        act = (inflight * len(layers) * (stream if recompute else 12 * stream) + work) / GB  # 12: rough, no recompute
        weights, optim, step = w_bytes / GB, 12 * n_param / GB, 8 * min(n_param, 2 ** 28) / GB  # grads: as weights
        backward = weights + act + (loss if last else 0.0)  # offloaded, the step runs in host memory
        lines.append(f"| {pp_rank} | {layers[0]}-{layers[-1]} | {n_param / 1e9:.2f}B | {weights:.1f} | {weights:.1f} "
                     f"| {optim:.1f} | {act:.1f} | {loss if last else 0.0:.1f} | {step:.1f} "
                     f"| {weights + optim + backward + step:.1f} | {weights + backward:.1f} |")
    return "\n".join(lines)


def peak_gb(device, reset=False):
    """What this process held at most, in GB, (tensors, from the device): on a GPU the caching allocator's peaks since
    the last reset (reset=True starts the next); on the CPU the process's peak resident size since it started, both."""
    if device.type == "cuda":
        out = torch.cuda.max_memory_allocated(device) / 1e9, torch.cuda.max_memory_reserved(device) / 1e9
        if reset:
            torch.cuda.reset_peak_memory_stats(device)
        return out
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # Linux counts KiB
    return rss, rss


def step_peaks(grid, client=None):
    """A GRPO step's memory in GB, the most of any rank: the trainer's peak in the step (peak_gb, then reset for the
    next) and, given the client of the embedded server, that server's since it started (its /server_info); tensors,
    and what each process holds from the device (the caching allocator's reserve: what the GPU sees used)."""
    t = torch.tensor([*peak_gb(grid.device, reset=True), 0.0, 0.0], device=grid.device)
    if grid.rank == 0 and client is not None:
        (answer, err), = [fut.result() for fut in client.each("/server_info", method="GET", timeout=30).values()]
        if err is None:  # a server that does not answer leaves zeros: the next step asks again
            t[2:] = torch.tensor(answer["internal_states"][0]["peak_memory_gb"])
    all_reduce(t, grid.world_group, "memory peaks", op=dist.ReduceOp.MAX)
    names = ["trainer_mem_gb", "trainer_mem_reserved_gb", "server_mem_gb", "server_mem_reserved_gb"]
    return dict(zip(names[:2 if client is None else 4], t.tolist()))
