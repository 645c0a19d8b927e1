"""Packed micro-batches (grpo.make_microbatches(pack=...)): several samples in one row, each starting at a multiple of
every compress ratio, kept apart by "seg": sample-local RoPE positions, window keys, compressor windows (the overlap
compressor's first window of a sample has nothing before it) and indexer picks. A packed forward equals each sample's
own forward, on the reference paths and on the fast ones; the GRPO loss and every gradient equal the unpacked
micro-batches'."""
import pytest
import torch

import parallel
from conftest import randomize_
from grpo import grpo_loss, make_microbatches, pack_rows
from model_dsv4 import ModelArgs, Transformer, pack_multiple

ARGS = ModelArgs(vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=2, head_dim=32,
                 qk_rope_head_dim=16, q_lora_rank=32, o_groups=1, o_lora_rank=32, sliding_window=8,
                 compress_ratios=[0, 4, 16], index_n_heads=2, index_head_dim=32, index_topk=3, n_routed_experts=4,
                 num_experts_per_tok=2, moe_intermediate_size=32, num_hash_layers=1, hc_mult=2, hc_sinkhorn_iters=3,
                 num_nextn_predict_layers=0)
LENGTHS = [61, 37, 5, 22, 16, 9, 30, 3]


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])  # on a GPU, its Triton kernels too


def model(fast, device="cpu"):
    return randomize_(Transformer(ARGS, dtype=torch.float32), ARGS.n_routed_experts, ARGS.num_experts_per_tok,
                      seed=3).set_kernels(fast).to(device)


def test_pack_rows_first_fit_aligned():
    T, rows = pack_rows(LENGTHS, 16)
    assert T == 61 and sorted(j for row in rows for j, _ in row) == list(range(len(LENGTHS)))
    for row in rows:
        ends = sorted((o, o + LENGTHS[j]) for j, o in row)
        assert all(o % 16 == 0 for o, _ in ends) and ends[-1][1] <= T
        assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:]))  # no overlap
    assert len(rows) < len(LENGTHS) and max(len(row) for row in rows) >= 3  # packed


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fast", [False, True], ids=["reference", "fast"])
def test_packed_forward_equals_each_samples_own(fast, device):
    m, g = model(fast, device), torch.Generator().manual_seed(4)
    tol = 1e-5 if device == "cpu" else 1e-3  # a GPU's kernels sum in other orders (and TF32 where they may)
    seqs = [torch.randint(2, ARGS.vocab_size, (n,), generator=g) for n in LENGTHS]
    T, rows = pack_rows(LENGTHS, pack_multiple(ARGS))
    ids, seg = torch.zeros(len(rows), T, dtype=torch.long), torch.full((len(rows), T), -1)
    for b, row in enumerate(rows):
        for k, (j, o) in enumerate(row):
            ids[b, o:o + LENGTHS[j]], seg[b, o:o + LENGTHS[j]] = seqs[j], k
    ids, seg, seqs = ids.to(device), seg.to(device), [q.to(device) for q in seqs]
    with torch.no_grad():
        packed = m(ids, seg=seg)
        for b, row in enumerate(rows):
            for j, o in row:
                alone = m(seqs[j][None])[0]
                err = (packed[b, o:o + LENGTHS[j]] - alone).abs().max() / alone.abs().max()
                assert err <= tol, (j, err.item())
        # without seg the samples of a row read each other: the test can tell
        mixed = m(ids)
    b = next(b for b, row in enumerate(rows) if len(row) > 1)
    j, o = max(rows[b], key=lambda jo: jo[1])
    assert (mixed[b, o:o + LENGTHS[j]] - packed[b, o:o + LENGTHS[j]]).abs().max() > 1e-3


def test_packed_grpo_step_equals_unpacked():
    m, g = model(True), torch.Generator().manual_seed(5)
    m.loss_chunk = 24  # the head's logits in chunks that cross the rows and the packed samples
    groups = []
    for i, n in enumerate(LENGTHS[:4]):
        prompt = torch.randint(2, ARGS.vocab_size, (n // 3 + 1,), generator=g).tolist()
        outs = [torch.randint(2, ARGS.vocab_size, (L,), generator=g).tolist() for L in (n, n // 2 + 1)]
        groups.append((prompt, [{"output_ids": o, "logprobs": [-1.0] * len(o)} for o in outs], [1.0, -1.0]))
    results = []
    for pack in (0, pack_multiple(ARGS)):
        mbs = make_microbatches(groups, 2, 8.0, pack=pack)
        total = 0.0
        for mb in mbs:
            x = parallel.stage_forward(m, None, mb["input_ids"], seg=mb.get("seg"))
            loss, metrics = m.head_loss(x, mb, grpo_loss)
            loss.backward()
            total += metrics["entropy"].item()
        grads = torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None])
        m.zero_grad()
        results.append((sum(mb["input_ids"].numel() for mb in mbs), grads, total))
    (cells0, g0, e0), (cells1, g1, e1) = results
    assert cells1 < cells0  # fewer padded positions
    assert g0.abs().max() > 0 and (g1 - g0).abs().max() <= 1e-5 * g0.abs().max()
    assert e1 == pytest.approx(e0, rel=1e-5)


def math_lengths(n, seed):
    """The GPU math study's samples (config/gpu_math.py): byte-tokenized prompts and worked solutions + EOS."""
    import random
    from tasks import ByteTokenizer, math_problems, prompt_ids
    tok, rng = ByteTokenizer(), random.Random(seed)
    pool = math_problems("rl", 400, 1337, steps=3, digits=2, ops="+--")
    return [len(prompt_ids(tok, p["prompt"])) + len(tok.encode(p["solution"])) + 1 for p in rng.choices(pool, k=n)]


def test_token_budget_layout_holds_its_shapes():
    """plan_microbatches: every sample once, aligned but a row's last, within its row; rows of one length between the
    longest sample's bucket and twice it; at most four micro-batch shapes (the whole one a size graphs.bucket keeps,
    a half, a quarter and an eighth), and the row length kept from step to step while the samples fit it. Over 30
    steps of the math study's samples (64 to 256 a step) at 4,096 tokens: four shapes in all and under 15 % padding,
    where rows of the longest sample's length pad over a fifth."""
    from graphs import bucket
    from grpo import plan_microbatches
    shapes, row_len, pad, slots, plain, plain_slots = set(), 0, 0, 0, 0, 0
    for step in range(30):
        lengths = math_lengths(8 * (8 + (step * 7) % 25), step)
        T, rows, sizes = plan_microbatches(lengths, 32, 4096, row_len=row_len)
        assert step == 0 or T == row_len  # the lengths do not move: the row length holds
        row_len, longest = T, bucket(max(lengths), 8)
        assert longest <= T <= 2 * longest and sorted(j for row in rows for j, _ in row) == list(range(len(lengths)))
        for row in rows:
            assert all(o % 32 == 0 for _, o in row) and row[-1][1] + lengths[row[-1][0]] <= T
            assert all(o + lengths[j] <= o2 for (j, o), (_, o2) in zip(row, row[1:]))  # in order, no overlap
        assert sum(sizes) >= len(rows) and sum(sizes[:-1]) < len(rows) and bucket(sizes[0], 4) == sizes[0]
        assert set(sizes) <= {sizes[0] >> k for k in range(4)} and sizes[0] * T <= 4096
        shapes |= {(s, T) for s in sizes}
        pad, slots = pad + T * sum(sizes) - sum(lengths), slots + T * sum(sizes)
        T1, rows1, sizes1 = plan_microbatches(lengths, 32, 4096, row_len=longest)
        assert T1 == longest
        plain, plain_slots = plain + T1 * sum(sizes1) - sum(lengths), plain_slots + T1 * sum(sizes1)
    assert len(shapes) <= 4 and pad / slots <= 0.15 < 0.2 < plain / plain_slots, (shapes, pad / slots)
    longer = math_lengths(64, 99) + [3 * row_len]  # a sample that no longer fits: a new row length
    assert plan_microbatches(longer, 32, 4096, row_len=row_len)[0] >= 3 * row_len


def test_token_budget_microbatches_train_the_same_step():
    """make_microbatches(tokens=...) against a sample a row in two micro-batches: the same loss, metrics and gradient,
    in micro-batches of the planned shapes (inert rows where a micro-batch is not full, every one carrying "seg"
    once a row holds two samples), and with more micro-batches asked for than the samples need (DP ranks run as many
    as the busiest one), the extra ones inert."""
    from grpo import plan_microbatches, sample_lengths
    m, g = model(True), torch.Generator().manual_seed(6)
    groups = []
    for i, n in enumerate(LENGTHS[:6]):
        prompt = torch.randint(2, ARGS.vocab_size, (n // 4 + 2,), generator=g).tolist()
        outs = [torch.randint(2, ARGS.vocab_size, (L,), generator=g).tolist() for L in (n, n // 3 + 1, 7)]
        groups.append((prompt, [{"output_ids": o, "logprobs": [-1.0] * len(o)} for o in outs], [1.0, -0.5, -0.5]))
    T, rows, sizes = plan_microbatches(sample_lengths(groups), pack_multiple(ARGS), 800)
    assert sum(sizes) > len(rows)  # inert rows
    results = []
    for kw in (dict(n_micro=2), dict(n_micro=len(sizes) + 2, pack=pack_multiple(ARGS), tokens=800)):
        mbs = make_microbatches(groups, kw.pop("n_micro"), 12.0, **kw)
        total, metrics = 0.0, []
        for mb in mbs:
            x = parallel.stage_forward(m, None, mb["input_ids"], seg=mb.get("seg"))
            loss, extra = m.head_loss(x, mb, grpo_loss)
            loss.backward()
            total += loss.item()
            metrics.append(extra["n_tok"].item())
        grads = torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None])
        m.zero_grad()
        results.append((mbs, total, sum(metrics), grads))
    (_, l0, n0, g0), (mbs, l1, n1, g1) = results
    assert [tuple(mb["input_ids"].shape) for mb in mbs] == [(s, T) for s in sizes] + [(min(sizes), T)] * 2
    assert all("seg" in mb for mb in mbs) and not any(mb["mask"].any() for mb in mbs[-2:])
    assert g0.abs().max() > 0 and (g1 - g0).abs().max() <= 1e-5 * g0.abs().max() and n1 == n0
    assert l1 == pytest.approx(l0, rel=1e-5, abs=1e-7)
