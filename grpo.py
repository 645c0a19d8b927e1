"""
The GRPO pieces train_grpo.py uses, as pure functions so tests can check them: group-normalised advantages,
the dynamic-sampling filter, micro-batch construction with the loss weights, and the token loss; then the step's
rollout and training metrics, summed over the DP ranks.
RESEARCH: this is the file to fork for another policy-gradient variant.
"""
import math

import torch
import torch.distributed as dist

import parallel
import replay as replay_ids
from graphs import bucket


def group_advantages(rewards):
    """(r - mean) / (std + 1e-6) over one prompt's samples; all zeros when every sample scored the same."""
    r = torch.as_tensor(rewards, dtype=torch.float32)
    std = r.std() if len(r) > 1 else torch.tensor(0.0)
    return ((r - r.mean()) / (std + 1e-6) if std > 0 else torch.zeros_like(r)).tolist()


def keep_group(rewards):
    """Dynamic sampling (DAPO): a group whose rewards are all equal carries no signal for GRPO."""
    return len(set(rewards)) > 1


def deal(kept, dp_size, n_minibatches=1):
    """Who trains which of a step's kept groups, the same for any number of DP ranks. kept: [(stream position, rank
    that drew it)], every rank's, in stream order. Minibatch m (one optimizer step) holds kept[m::n_minibatches], as in
    one process; its groups go out in shares that differ by at most one (the lower ranks take the remainder), each
    rank keeping the groups it drew before it takes others', so that few groups change rank.
    -> [rank][minibatch] lists of stream positions."""
    plan = [[[] for _ in range(n_minibatches)] for _ in range(dp_size)]
    for m in range(n_minibatches):
        part = kept[m::n_minibatches]
        share = [len(part) // dp_size + (r < len(part) % dp_size) for r in range(dp_size)]
        spare = []
        for r in range(dp_size):
            own = [pos for pos, owner in part if owner == r]
            plan[r][m], extra = own[:share[r]], own[share[r]:]
            spare += extra
        for r in range(dp_size):
            while len(plan[r][m]) < share[r]:
                plan[r][m].append(spare.pop(0))
    return plan


def inert_group(prompt):
    """A group that trains nothing (no response token is masked in): a DP rank with no share of a minibatch runs it,
    so that its pipeline and expert-parallel peers see the same number of micro-batches."""
    return prompt, [{"output_ids": prompt[-1:], "logprobs": [0.0]}], None


def pack_rows(lengths, align, pad_to=1, row_len=0):
    """Sample lengths -> rows of packed samples, first fit by decreasing length. Each sample starts at a multiple of
    align (model_dsv4.pack_multiple), but a row's last one ends where it ends, so the sample whose round-up to align
    would waste the most goes last. Rows are row_len long, or (0) as long as the longest sample rounded up to pad_to.
    A row then costs what one padded sample cost, and holds several. -> (row length, [[(sample, offset), ...] a row])"""
    T = row_len or -(-max(lengths) // pad_to) * pad_to
    up = lambda n: -(-n // align) * align
    rows = []  # [samples, their lengths rounded up to align, the most one of them wastes]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n, waste = up(lengths[i]), up(lengths[i]) - lengths[i]
        row = next((r for r in rows if r[1] + n - max(r[2], waste) <= T), None)
        if row is None:
            row = [[], 0, 0]
            rows.append(row)
        row[0].append(i)
        row[1], row[2] = row[1] + n, max(row[2], waste)
    out = []
    for samples, _, _ in rows:
        last = max(samples, key=lambda i: up(lengths[i]) - lengths[i])
        order, o = [i for i in samples if i != last] + [last], 0
        out.append([])
        for i in order:
            out[-1].append((i, o))
            o += up(lengths[i])
    return T, out


def split_rows(n_rows, per_mb):
    """Rows a micro-batch for n_rows rows: whole micro-batches of per_mb rows, then the rest in the smallest of per_mb,
    per_mb / 2, per_mb / 4 and per_mb / 8 rows that holds it: four shapes at most, and a last micro-batch at most half
    empty unless the rest is under an eighth of a whole one."""
    sizes, rest = [per_mb] * (n_rows // per_mb), n_rows % per_mb
    if rest:
        sizes.append(min(s for s in (per_mb, per_mb // 2, per_mb // 4, per_mb // 8) if s >= rest))
    return sizes


def plan_microbatches(lengths, align, tokens, pad_to=1, row_len=0):
    """The token-budget layout (train_grpo.py's micro_batch_tokens): micro-batches of about `tokens` tokens, rows of one
    length T for the step, as many micro-batches as the samples need. Their shapes hold still from step to step, as
    CUDA graphs want (graphs.py): tokens // T rows (rounded down to a size graphs.bucket keeps, as are its halves), a
    step's last micro-batch a half, a quarter or an eighth of that where it fits (split_rows).
    T: row_len while the step's longest sample fits in it and its bucket is at least half of it, else the length
    between the longest sample's bucket and twice that (graphs.bucket's sizes, multiples of pad_to) that pads the
    fewest tokens: rows of two or three short samples waste less than rows of one. align: pack_rows' (0: a sample a
    row).
    -> (T, pack_rows' rows, [rows of each micro-batch])"""
    longest = -(-bucket(max(lengths), 8) // pad_to) * pad_to
    lengths_ok = [t for t in range(longest, 2 * longest + 1) if t % pad_to == 0 and bucket(t, 8) == t] or [longest]

    def plan(T):
        rows = pack_rows(lengths, align, row_len=T)[1] if align else [[(i, 0)] for i in range(len(lengths))]
        per_mb = max(1, tokens // T)
        while bucket(per_mb, 4) != per_mb:  # the largest size graphs.bucket leaves as it is
            per_mb -= 1
        return T, rows, split_rows(len(rows), per_mb)

    if row_len and max(lengths) <= row_len <= 2 * longest:
        return plan(row_len)
    return min((plan(T) for T in (lengths_ok if align else lengths_ok[:1])), key=lambda p: (p[0] * sum(p[2]), p[0]))


def n_rows(groups, pack=0, pad_to=1):
    """How many rows make_microbatches lays these groups' samples out in: one a sample, or fewer packed."""
    lengths = sample_lengths(groups)
    return len(pack_rows(lengths, pack, pad_to)[1]) if pack else len(lengths)


def count_microbatches(groups, n_micro, pack=0, tokens=0, pad_to=1, row_len=0):
    """-> (how many micro-batches make_microbatches lays these groups out in, its row length): with tokens,
    plan_microbatches' (row_len kept while it fits), else n_micro or fewer where there are fewer rows. DP ranks then
    run as many: with tokens the most any rank needs, else the fewest (every rank's count reduced by MAX or MIN)."""
    if tokens:
        T, _, sizes = plan_microbatches(sample_lengths(groups), pack, tokens, pad_to, row_len)
        return len(sizes), T
    return min(n_micro, n_rows(groups, pack, pad_to)), row_len


def sample_lengths(groups):
    """Each sample's tokens, prompt and response, in make_microbatches' order."""
    return [len(p) + len(s["output_ids"]) for p, ss, _ in groups for s in ss]


def make_microbatches(groups, n_micro, norm, loss_agg="seq_mean_token_mean", device="cpu", pad_to=1, replay=None,
                      args=None, pack=0, tokens=0, row_len=0):
    """groups: [(prompt ids, [samples], [advantages])] -> right-padded micro-batches holding what the last stage's
    loss needs, per position t (logits at t score token t+1): response mask, advantage, rollout logprob, and the loss
    weight: 1 / (response length * norm) for the per-sample token mean (norm = samples, all DP ranks together),
    1 / norm for the token mean (norm = response tokens, all DP ranks together).
    n_micro micro-batches, the rows dealt out in turn; or with tokens > 0, plan_microbatches' (row_len: its sticky row
    length), at least n_micro of them (inert ones added, so that DP ranks run as many), each padded to its rows with
    inert rows.
    pad_to: each micro-batch's length rounded up to a multiple of it (compiled layers: one graph for every length).
    replay: replay.columns of this stage: the engine's ids to replay, int32 [B, T, this stage's layers, k] under the
    field's name, row t for the token at t; -1 where the engine sent none (the last token, padding): the trainer's
    router picks there, its indexer none. args: the ModelArgs they are checked against. A group whose advantages are
    None (inert_group) adds rows with no mask, weight or replayed ids.
    pack: 0, a sample a row; else samples packed into rows (pack_rows, starting at multiples of pack) with "seg"
    [B, T], each token's sample in its row (-1: padding), which the model reads to keep the samples apart (left out
    where no row holds two samples: of a micro-batch, or with tokens, of the step, so its shapes stay few)."""
    samples = [(prompt, s, a) for prompt, ss, advs in groups for s, a in zip(ss, advs or [None] * len(ss))]
    lengths = [len(p) + len(s["output_ids"]) for p, s, _ in samples]
    if tokens:
        T, rows, sizes = plan_microbatches(lengths, pack, tokens, pad_to, row_len)
        sizes += [min(sizes)] * (n_micro - len(sizes))
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        chunks = [rows[s:s + n] + [[]] * max(0, n - len(rows[s:s + n])) for s, n in zip(starts, sizes)]
        step_shared = any(len(row) > 1 for row in rows)
    else:
        T, rows = pack_rows(lengths, pack, pad_to) if pack else (None, [[(j, 0)] for j in range(len(samples))])
        chunks, step_shared = [rows[i::n_micro] for i in range(n_micro)], None
    out = []
    for chunk in chunks:
        L = T or -(-max(lengths[j] for (j, _), in chunk) // pad_to) * pad_to
        mb = {k: torch.zeros(len(chunk), L, dtype=d) for k, d in (("input_ids", torch.long), ("tgt", torch.long),
              ("mask", torch.bool), ("adv", torch.float32), ("rollout_lp", torch.float32), ("weight", torch.float32),
              ("first", torch.bool))}
        # rows of one sample each need no "seg": its masks cost ~20% of a GPU step and keep nothing apart
        shared = any(len(row) > 1 for row in chunk) if step_shared is None else step_shared
        if shared:
            mb["seg"] = torch.full((len(chunk), L), -1, dtype=torch.long)
        for name, (cols, shape) in (replay or {}).items():
            mb[name] = torch.full((len(chunk), L, len(cols), shape[1]), -1, dtype=torch.int32)
        for b, row in enumerate(chunk):
            for k, (j, o) in enumerate(row):  # sample j at offset o of row b
                (p, s, a), n = samples[j], lengths[j]
                ids, P, R = p + s["output_ids"], len(p), len(s["output_ids"])
                mb["input_ids"][b, o:o + n] = torch.tensor(ids)
                mb["tgt"][b, o:o + n - 1] = torch.tensor(ids[1:])  # a sample's last token scores nothing
                if shared:
                    mb["seg"][b, o:o + n] = k
                if a is None:  # inert: tokens to run, nothing to learn
                    continue
                sl = slice(o + P - 1, o + P - 1 + R)
                mb["mask"][b, sl], mb["adv"][b, sl] = True, a
                mb["rollout_lp"][b, sl] = torch.tensor(s["logprobs"], dtype=torch.float32)
                mb["weight"][b, sl] = 1.0 / norm if loss_agg == "token_mean" else 1.0 / (R * norm)
                mb["first"][b, o + P - 1] = True
                for name, (cols, shape) in (replay or {}).items():
                    mb[name][b, o:o + n - 1] = replay_ids.sample_ids(s, name, n - 1, shape, args)[:, cols]
        out.append({k: v.to(device) for k, v in mb.items()})
    return out


def token_logprobs(logp, entropy, mb):
    """What the no-grad passes keep (parallel.forward_only: the old policy's, a reference's): each token's logprob."""
    return logp


def grpo_loss(logp, entropy, mb, eps_low=0.2, eps_high=0.28, tis_cap=2.0, kl_coef=0.0, entropy_coef=0.0):
    """The clipped policy-gradient token loss with truncated importance sampling, an optional k3 KL to a
    reference (mb["ref_lp"]) and an entropy bonus, from each position's logprob of its target and entropy [B, T]
    (Transformer.head_loss); returns (this micro-batch's share of the loss, metric sums).
    pi_old is mb["old_lp"] when given (several optimizer steps per rollout), else the current policy itself,
    detached: then the ratio is exactly 1 and the step strictly on-policy."""
    m = mb["mask"]
    old = mb["old_lp"] if "old_lp" in mb else logp.detach()
    ratio = torch.exp((logp - old).clamp(-20, 20))
    pg1, pg2 = -mb["adv"] * ratio, -mb["adv"] * ratio.clamp(1 - eps_low, 1 + eps_high)
    tok_loss = torch.maximum(pg1, pg2)
    # TIS: the samples came from the engine's pi_rollout, not pi_old; reweight, capped, without gradient
    tis = (old - mb["rollout_lp"]).exp().clamp(max=tis_cap) if tis_cap > 0 else torch.ones_like(old)
    tok_loss = tok_loss * tis.detach()
    if entropy_coef:  # without the bonus the entropy is a metric only, and its backward pass is skipped
        tok_loss = tok_loss - entropy_coef * entropy
    if kl_coef:
        d = mb["ref_lp"] - logp
        tok_loss = tok_loss + kl_coef * (d.exp() - d - 1)
    loss = (tok_loss * mb["weight"] * m).sum()
    with torch.no_grad():
        diff = (old - mb["rollout_lp"]).abs() * m
        return loss, {"n_tok": m.sum(), "clip": ((pg2 > pg1) & m).sum(), "kl": ((old - logp) * m).sum(),
                      "entropy": (entropy * m).sum(), "lp_diff": diff.sum(), "lp_diff_max": diff.max(),
                      "lp_diff_first": (diff * mb["first"]).sum(), "n_first": mb["first"].sum(), "tis": (tis * m).sum(),
                      "ratio_dev": ((ratio - 1).abs() * m).sum()}


def layout_metrics(parts, minis, grid):
    """The step's micro-batches ([minibatch][micro-batch], make_microbatches'): how many a rank ran, their row
    length, and the share of their tokens that are padding, over every DP rank."""
    real = sum(sum(sample_lengths(part)) for part in parts)
    t = torch.tensor([float(real), float(sum(mb["input_ids"].numel() for mbs in minis for mb in mbs))],
                     device=grid.device)
    parallel.all_reduce(t, grid.dp_group, "padding")
    return {"micro_batches": sum(len(mbs) for mbs in minis), "row_len": minis[0][0]["input_ids"].shape[1],
            "padding": 1 - t[0].item() / max(t[1].item(), 1.0)}


def rollout_metrics(rstats, version, grid):
    """The step's rollouts (rollout_groups' stats: samples, groups drawn and kept, summed over the DP ranks; groups
    trained, already global): reward
    mean and std, accuracy, response lengths, truncation, kept groups, samples from weights other than `version`,
    and requests the client sent again after a server failed them (rollout_retries)."""
    samples = rstats["samples"]
    rw = torch.tensor([s["reward"] for s in samples])
    lens = torch.tensor([float(len(s["output_ids"])) for s in samples])
    t = torch.tensor([rw.sum(), (rw ** 2).sum(), sum(s["correct"] for s in samples), len(samples), lens.sum(),
                      sum(s["finish_reason"]["type"] == "length" for s in samples), rstats["groups"], rstats["kept"],
                      sum(s["weight_version"] != str(version) for s in samples),
                      sum(s["attempts"] - 1 for s in samples)], device=grid.device, dtype=torch.float64)
    mx = torch.tensor([lens.max().item() if len(lens) else 0.0], device=grid.device)
    parallel.all_reduce(t, grid.dp_group, "rollout metrics")
    parallel.all_reduce(mx, grid.dp_group, "rollout length max", op=dist.ReduceOp.MAX)
    names = ("r", "r2", "correct", "n", "tokens", "truncated", "groups", "kept", "stale", "retried")
    tot = dict(zip(names, t.tolist()))
    n = max(tot["n"], 1)
    return {"reward_mean": tot["r"] / n, "reward_std": math.sqrt(max(tot["r2"] / n - (tot["r"] / n) ** 2, 0)),
            "accuracy": tot["correct"] / n, "response_len_mean": tot["tokens"] / n, "response_len_max": mx.item(),
            "response_tokens": tot["tokens"], "truncation_rate": tot["truncated"] / n,
            "kept_group_ratio": tot["kept"] / max(tot["groups"], 1), "sampled_groups": int(tot["groups"]),
            "trained_groups": rstats["trained"], "stale_samples": int(tot["stale"]),
            "rollout_retries": int(tot["retried"])}


def step_line(rec, max_steps):
    """The step's log line, from its metrics record (train_grpo.py): a fixed order, the time split last."""
    g = lambda k, f: format(rec.get(k, 0), f)
    return (f"step {rec['step']:05d}/{max_steps} | reward {g('reward_mean', '.3f')} | acc {g('accuracy', '.3f')} | "
            f"len {g('response_len_mean', '.1f')} | kept {g('kept_group_ratio', '.2f')} | loss {g('loss', '+.4f')} | "
            f"clip {g('pg_clipfrac', '.3f')} | kl {g('approx_kl', '+.1e')} | ent {g('entropy', '.2f')} | |dlp| "
            f"{g('logprob_abs_diff', '.1e')} | gnorm {g('grad_norm', '.2f')} | t_roll {g('t_rollout', '.1f')}s t_train "
            f"{g('t_train', '.1f')}s t_sync {g('t_sync', '.1f')}s | mem {g('trainer_mem_gb', '.1f')}"
            + (f"+{g('server_mem_gb', '.1f')}" if 'server_mem_gb' in rec else '') + f"GB | {g('elapsed_s', '.0f')}s"
            + (f" | {rec['micro_batches']} x {rec['row_len']} pad {rec['padding']:.0%}" if 'padding' in rec else '')
            + (f" | graphs: {rec['graph_captured']} captured" if rec.get('graph_captured') else '')
            + (f" | {rec['graph_eager']} micro-batches eager (graphs full)" if rec.get('graph_eager') else '')
            + (f" | {rec['rollout_retries']} requests retried" if rec.get('rollout_retries') else '')
            + (f" | rollout failed once: {rec['rollout_error'][:200]}" if 'rollout_error' in rec else '')
            + (f" | skipped: {rec['skipped']}" if 'skipped' in rec else ''))


def train_metrics(m, grid):
    """parallel.train_step's metric sums on the last stages, summed over DP (max for maxima) -> means per token."""
    keys = sorted(k for k in m if k not in ("grad_norm", "skipped", "nonfinite", "replay_ids_mib"))
    t = torch.tensor([float(m.get(k, 0.0)) for k in keys], device=grid.device)
    mx = torch.tensor([float(m.get("lp_diff_max", 0.0))], device=grid.device)
    parallel.all_reduce(t, grid.dp_group, "metrics")
    parallel.all_reduce(mx, grid.dp_group, "metrics max", op=dist.ReduceOp.MAX)
    s = dict(zip(keys, t.tolist()))
    n = max(s.get("n_tok", 0), 1)
    # routing replay: (token, layer) pairs whose expert set the trainer's router would pick otherwise than the engine
    replayed = {"routing_disagree": s["routing_differ"] / max(s["routing_rows"], 1)} if "routing_rows" in s else {}
    replayed.update({"replay_ids_mib": m["replay_ids_mib"]} if "replay_ids_mib" in m else {})  # the most on a rank
    return {**replayed, "loss": s.get("loss", 0), "pg_clipfrac": s.get("clip", 0) / n, "approx_kl": s.get("kl", 0) / n,
            "entropy": s.get("entropy", 0) / n, "logprob_abs_diff": s.get("lp_diff", 0) / n,
            "logprob_abs_diff_max": mx.item(),
            "logprob_abs_diff_first": s.get("lp_diff_first", 0) / max(s.get("n_first", 0), 1),
            "tis_mean": s.get("tis", 0) / n, "ratio_abs_dev": s.get("ratio_dev", 0) / n,
            "train_tokens": s.get("n_tok", 0)}
