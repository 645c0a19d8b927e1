"""Runs a few training steps of a tiny V4 under a parallel layout and saves what the test compares.
Launched by tests/test_parallel.py on 4 gloo ranks (and imported by it for the one-process reference):
    python tests/helpers/parallel_run.py OUT_DIR PP EP VARIANT[,VARIANT...]     (with RANK/WORLD_SIZE/... set)
A variant is n_micro:schedule[:recompute][:offload][:fp8], e.g. 4:1f1b:recompute; or "moe", which checks EP
dispatch/combine against a plain per-token loop over the unsharded experts, forward and backward."""
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import parallel  # noqa: E402
from model_dsv4 import ModelArgs  # noqa: E402
from optimizer import AdamW  # noqa: E402

# every mechanism, small enough for 4 processes on 2 cores: window, CSA (ratio 4, indexer) and HCA layers,
# hash routing on the first two (so stage 1 of PP4 holds one), an MTP layer on the last stage
ARGS = dict(vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=2, head_dim=64,
            qk_rope_head_dim=32, q_lora_rank=32, o_groups=1, o_lora_rank=32, sliding_window=8,
            compress_ratios=[0, 4, 8, 4, 0], index_n_heads=2, index_head_dim=32, index_topk=2,
            n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, num_hash_layers=2)
N_SEQ, STEPS = 16, 2


def global_batch(step):
    """16 sequences of different lengths (right-padded per micro-batch, the pads masked out of the loss)."""
    g = torch.Generator().manual_seed(step)
    lengths = torch.randint(12, 33, (N_SEQ,), generator=g).tolist()
    return [torch.randint(0, 128, (n,), generator=g) for n in lengths]


def microbatches(seqs, n_micro, dp_rank, dp_size):
    """This DP rank's contiguous share, split into n_micro micro-batches, each padded to its longest sequence."""
    per = len(seqs) // dp_size
    mine = seqs[dp_rank * per:(dp_rank + 1) * per]
    out = []
    for chunk in [mine[i::n_micro] for i in range(n_micro)]:
        T = max(len(s) for s in chunk)
        ids = torch.stack([F.pad(s, (0, T - len(s))) for s in chunk])
        mask = torch.stack([torch.arange(T) < len(s) - 1 for s in chunk])  # positions with a next token
        out.append({"input_ids": ids, "tgt": ids.roll(-1, 1), "mask": mask})
    return out


def run(grid, n_micro, schedule, recompute=False, offload=False, fp8=False):
    """STEPS optimizer steps; returns (global loss and grad norm per step, this rank's state dict).
    The grad norm is checked too because AdamW's update is blind to the scale of the gradient. fp8: train_quant."""
    model = parallel.build_stage(ModelArgs(**ARGS), grid, dtype=torch.float32, seed=7).set_fp8_training(fp8)
    opt = AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, offload=offload)
    losses = []
    for step in range(STEPS):
        mbs = microbatches(global_batch(step), n_micro, grid.dp_rank, grid.dp_size)
        n_tok = parallel.all_reduce(sum(mb["mask"].sum() for mb in mbs).float(), grid.dp_group, "token count")

        def loss_fn(logp, entropy, mb):  # this micro-batch's share of the mean next-token loss over the global batch
            return -(logp * mb["mask"]).sum() / n_tok

        m = parallel.train_step(model, grid, opt, mbs, loss_fn, grad_clip=0.5, schedule=schedule, recompute=recompute)
        loss = torch.tensor(m.get("loss", 0.0))
        parallel.all_reduce(loss, grid.dp_group, "loss")  # the last stage of each DP rank holds a share
        losses.append((loss.item(), m["grad_norm"]))
    return losses, {k: v.detach().cpu() for k, v in model.state_dict().items()}


def check_moe(grid):
    """Each rank routes its own tokens through the EP-sharded MoE; a plain loop over the unsharded experts
    (the reference: for every token, the weighted sum of its top-k experts plus the shared expert) must agree,
    and so must the gradients of the input, the router and this rank's experts."""
    from model_dsv4 import MoE
    args = ModelArgs(**ARGS)
    torch.manual_seed(0)
    full = MoE(5, args).float()  # layer 5 >= num_hash_layers: learned routing, bias-steered top-k
    with torch.no_grad():
        full.gate.weight.copy_(torch.randn(8, 64) * 0.1)
        full.gate.bias.copy_(torch.randn(8) * 0.1)
    sharded = MoE(5, args, grid.ep_group).float()
    sharded.load_state_dict({k: v for k, v in full.state_dict().items() if k in sharded.state_dict()})
    x = torch.randn(2, 24, 64, generator=torch.Generator().manual_seed(grid.rank), requires_grad=True)
    ids = torch.zeros(2, 24, dtype=torch.long)
    y = sharded(x, ids)
    y.square().sum().backward()
    xr = x.detach().clone().requires_grad_()
    flat = xr.view(-1, 64)
    w, idx = full.gate(flat, ids.view(-1))
    rows = [sum(w[t, j] * full.experts[str(int(idx[t, j]))](flat[t:t + 1]).squeeze(0) for j in range(2))
            + full.shared_experts(flat[t:t + 1]).squeeze(0) for t in range(flat.shape[0])]
    torch.stack(rows).view_as(xr).square().sum().backward()
    torch.testing.assert_close(y, torch.stack(rows).view_as(y), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-5, atol=1e-6)
    # parameter grads: the sharded ones saw every EP rank's tokens, so sum the reference's over the group
    ref = {k: p.grad.clone() for k, p in full.named_parameters()}
    for k, g in ref.items():
        parallel.all_reduce(g, grid.ep_group, "reference grads")
    for k, p in sharded.named_parameters():
        g = p.grad.clone()
        if not k.startswith("experts."):  # the router and shared expert are replicated: sum theirs too
            parallel.all_reduce(g, grid.ep_group, "replicated grads")
        torch.testing.assert_close(g, ref[k], rtol=1e-5, atol=1e-5, msg=k)
    print(f"rank {grid.rank}: EP MoE equals the per-token reference (ep {grid.ep_size}, "
          f"{len(sharded.experts)} local experts)", flush=True)


if __name__ == "__main__":
    out, pp, ep, variants = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split(",")
    grid = parallel.init_distributed(pp_size=pp, ep_size=ep, timeout_s=int(os.environ.get("DIST_TIMEOUT", 60)))
    fault = os.environ.get("FAULT", "")
    if fault == "wrong_shape" and grid.rank == 0:  # stage 0 sends one token too few
        send = parallel.send_fwd
        parallel.send_fwd = lambda g, y: send(g, y[:, :-1])
    if fault == "die" and grid.rank == 1:  # rank 1 dies in the middle of its first forward
        parallel.stage_forward = lambda *a, **k: os._exit(9)
    for v in variants:
        if v == "moe":
            check_moe(grid)
            continue
        n_micro, schedule, *flags = v.split(":")
        losses, sd = run(grid, int(n_micro), schedule, "recompute" in flags, "offload" in flags, "fp8" in flags)
        torch.save({"losses": losses, "state": sd, "last_stage": grid.is_last_stage},
                   os.path.join(out, f"{v}.rank{grid.rank}.pt"))
    print(f"rank {grid.rank} done", flush=True)
    # every group down, and no interpreter teardown: left to it, gloo's worker threads can abort a rank ("terminate
    # called without an active exception", seen in CI on the EP layouts after every rank was done). The test reads
    # the files written above and this output.
    parallel.barrier(grid.world_group, "parallel_run done")
    torch.distributed.destroy_process_group()
    os._exit(0)
