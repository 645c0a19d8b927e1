"""engine.sample_tokens (without top-p and top-k) as two Triton kernels over chunks of the vocabulary, against the
compiled reference (session 24). The reference compiles to one reduction kernel, a program per row, each running the
whole 129280-token vocabulary through log_softmax, engine.gumbel's int64 hash and two fp64 logs: 157 us of a 4.4 ms
decode step at batch 64 on an H200 (its trace, RESULTS.md session 24). Here a program takes a (row, chunk): the
chunk's max and sum of exponentials, then, with the row's log-sum-exp from all chunks, the chunk's best token by
logprob (greedy rows: no noise drawn) or logprob + the same Gumbel noise; the chunks' best compared in torch.
Session 24's one run (bench/probe_admit.py then) timed back-to-back calls, not the device: the kernels took 286-441
us against the compiled reference's 184-372, tokens equal. Not used by the engine until a run shows them faster;
this probe times them, the reference and a third contender (the reference's torch code with a two-stage argmax,
compiled) as CUDA-graph replays (the device's time) and as calls.
python bench/probe_sampler.py   (on a CPU: Triton's interpreter, a check of the tokens against engine.sample_tokens)"""
import os
import sys

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import engine  # noqa: E402
from probe_timing import graph_us, timed  # noqa: E402


@triton.jit
def _srl(x, k: tl.constexpr):
    """x >> k as a logical shift of an int64 (engine.gumbel's srl)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


@triton.jit
def _sample_sums(logits_ptr, temp_ptr, part_ptr, V, CHUNK, S, BLOCK: tl.constexpr):
    """Row program_id(0), chunk program_id(1): the max and sum of exp(x - max) of x = logits / temperature."""
    b, s = tl.program_id(0).to(tl.int64), tl.program_id(1)
    t, end = tl.load(temp_ptr + b), tl.minimum(V, s * CHUNK + CHUNK)
    mx = tl.full([BLOCK], float("-inf"), tl.float32)
    z = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(s * CHUNK, end, BLOCK):
        j = start + tl.arange(0, BLOCK)
        x = tl.load(logits_ptr + b * V + j, mask=j < end, other=float("-inf")) / t
        new = tl.maximum(mx, x)
        ref = tl.where(new > float("-inf"), new, 0.0)  # a lane with no token yet: exp(-inf) = 0, not exp(nan)
        z = z * tl.exp(mx - ref) + tl.exp(x - ref)
        mx = new
    m = tl.max(mx, 0)
    tl.store(part_ptr + (b * S + s) * 2, m)
    tl.store(part_ptr + (b * S + s) * 2 + 1, tl.sum(z * tl.exp(mx - m), 0))


@triton.jit
def _sample_pick(logits_ptr, temp_ptr, greedy_ptr, draws_ptr, part_ptr, best_ptr, idx_ptr, lp_ptr, V, CHUNK, S,
                 SP: tl.constexpr, BLOCK: tl.constexpr):
    """Row program_id(0), chunk program_id(1): the row's log-sum-exp from the chunks' sums, then the chunk's first
    token with the highest score (logprob, + Gumbel noise when sampled), the score and the token's logprob."""
    b, s = tl.program_id(0).to(tl.int64), tl.program_id(1)
    i = tl.arange(0, SP)
    m_i = tl.load(part_ptr + (b * S + i) * 2, mask=i < S, other=float("-inf"))
    z_i = tl.load(part_ptr + (b * S + i) * 2 + 1, mask=i < S, other=0.0)
    m = tl.max(m_i, 0)
    lse = m + tl.log(tl.sum(z_i * tl.exp(m_i - m), 0))
    t, greedy = tl.load(temp_ptr + b), tl.load(greedy_ptr + b) != 0
    seed, count = tl.load(draws_ptr + b * 2), tl.load(draws_ptr + b * 2 + 1)
    row = (seed * -7046029254386353131 + count) * -3335678366873096957  # engine.gumbel's constants, signed
    end = tl.minimum(V, s * CHUNK + CHUNK)
    best, best_j, best_lp = tl.full((), float("-inf"), tl.float64), s * CHUNK, tl.full((), 0.0, tl.float32)
    for start in range(s * CHUNK, end, BLOCK):
        j = start + tl.arange(0, BLOCK)
        lp = tl.load(logits_ptr + b * V + j, mask=j < end, other=float("-inf")) / t - lse
        score = lp.to(tl.float64)
        if not greedy:
            x = (row + j.to(tl.int64)) * -7046029254386353131
            x = (x ^ _srl(x, 30)) * -4658895280553007687
            x = (x ^ _srl(x, 27)) * -7723592293110705685
            u = (_srl(x ^ _srl(x, 31), 11).to(tl.float64) + 0.5) * 1.1102230246251565e-16  # 2 ** -53
            score = tl.where(j < end, score - tl.log(-tl.log(u)), float("-inf"))
        k = tl.argmax(score, 0)
        top = tl.max(score, 0)
        if top > best:  # strictly: the first of equal scores stays
            best, best_j = top, start + k
            best_lp = tl.sum(tl.where(tl.arange(0, BLOCK) == k, lp, 0.0), 0)
    tl.store(best_ptr + b * S + s, best)
    tl.store(idx_ptr + b * S + s, best_j)
    tl.store(lp_ptr + b * S + s, best_lp)


SAMPLE_CHUNK, SAMPLE_BLOCK = 8192, 1024  # 16 chunks of 129280 tokens: 1024 programs at batch 64


def sample_triton(logits, temp, greedy, draws, chunk=SAMPLE_CHUNK):
    """engine.sample_tokens without top-p and top-k: logits fp32 [B, V], temp fp32 [B] (1 for greedy rows), greedy
    bool [B], draws int64 [B, 2] (seed, token index), chunk tokens a program -> fp64 [2, B]: the tokens and their
    logprobs."""
    B, V = logits.shape
    block = min(SAMPLE_BLOCK, triton.next_power_of_2(chunk))
    S = triton.cdiv(V, chunk)
    part = logits.new_empty(B, S, 2)
    best, idx, lp = logits.new_empty(B, S, dtype=torch.float64), draws.new_empty(B, S), logits.new_empty(B, S)
    args = (logits.contiguous(), temp.float().contiguous())
    _sample_sums[(B, S)](*args, part, V, chunk, S, BLOCK=block, num_warps=4)
    _sample_pick[(B, S)](*args, greedy.contiguous().view(torch.uint8), draws.contiguous(), part, best, idx, lp, V,
                         chunk, S, SP=triton.next_power_of_2(S), BLOCK=block, num_warps=4)
    j = best.argmax(1, keepdim=True)  # the first chunk of equal scores
    return torch.stack([idx.gather(1, j)[:, 0].double(), lp.gather(1, j)[:, 0].double()])


def sample_chunked(logits, params, draws, chunk=SAMPLE_CHUNK):
    """engine.sample_tokens' math (no top-p, top-k) in torch, its argmax in two stages (each chunk's first best, then
    the first chunk of the best): a third contender, plain torch code whose reductions inductor may split."""
    B, V = logits.shape
    temp = params[:, 0]
    greedy = temp < engine.GREEDY_T
    lp = (logits / torch.where(greedy, 1.0, temp).float()[:, None]).log_softmax(-1)
    score = torch.where(greedy[:, None], lp.double(), lp.double() + engine.gumbel(draws[:, 0], draws[:, 1], V))
    S = -(-V // chunk)
    best, k = F.pad(score, (0, S * chunk - V), value=float("-inf")).view(B, S, chunk).max(-1)
    j = best.argmax(-1, keepdim=True)
    token = j[:, 0] * chunk + k.gather(1, j)[:, 0]
    return torch.stack([token.double(), lp.gather(1, token[:, None])[:, 0].double()])


def check(B, V, chunk, device, gen):
    """Rows greedy and sampled at 0.3-1.6 under seeds up to 2^62 -> (both contenders' tokens equal the reference's,
    the larger max |Δ logprob|)."""
    logits = torch.randn(B, V, generator=gen).to(device) * 4
    temp = torch.tensor([0.0, 1e-7, 0.3, 0.7, 1.0, 1.6], dtype=torch.float64).repeat(-(-B // 6))[:B].to(device)
    params = torch.stack([temp, torch.ones_like(temp), torch.full_like(temp, V)], 1)
    draws = torch.stack([torch.randint(-2 ** 62, 2 ** 62, (B,), generator=gen),
                         torch.randint(0, 5000, (B,), generator=gen)], 1).to(device)
    greedy = temp < engine.GREEDY_T
    ref = engine.sample_tokens(logits, params, draws, False)
    got = sample_triton(logits, torch.where(greedy, 1.0, temp).float(), greedy, draws, chunk)
    alt = sample_chunked(logits, params, draws, chunk)
    return (bool((got[0] == ref[0]).all() and (alt[0] == ref[0]).all()),
            max((got[1] - ref[1]).abs().max().item(), (alt[1] - ref[1]).abs().max().item()))


gen = torch.Generator().manual_seed(0)
if not torch.cuda.is_available():
    for chunk in (64, 300, 4096):
        same, err = check(48, 1000, chunk, "cpu", gen)
        print(f"interpreter, 48 rows x 1000 tokens, chunks of {chunk}: tokens equal {same}, max |Δ logprob| {err:.1e}")
        assert same and err <= 1e-5
    sys.exit(0)

V = 129280
print(f"sampling, {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
print("  check, 256 rows:", *check(256, V, SAMPLE_CHUNK, "cuda", gen))
compiled, chunked = torch.compile(engine.sample_tokens), torch.compile(sample_chunked)
for B in (64, 256):
    logits = torch.randn(B, V, generator=gen).cuda() * 3
    for temp in (0.0, 1.0):
        params = torch.tensor([[temp, 1.0, V]] * B, dtype=torch.float64, device="cuda")
        draws = torch.stack([torch.arange(B), torch.full((B,), 7)], 1).cuda()
        t1 = torch.full((B,), 1.0 if temp == 0 else temp, device="cuda")
        greedy = torch.full((B,), temp == 0, device="cuda")
        ref = lambda: compiled(logits, params, draws, False)
        ours = lambda: sample_triton(logits, t1, greedy, draws)
        alt = lambda: chunked(logits, params, draws)
        same = bool((ref()[0] == ours()[0]).all() and (ref()[0] == alt()[0]).all())
        print(f"  {B} x {V}, temperature {temp}: device {graph_us(ref, 20):.0f} us compiled reference, "
              f"{graph_us(ours, 20):.0f} us Triton, {graph_us(alt, 20):.0f} us two-stage torch compiled; a call "
              f"{timed(ref) * 1e3:.0f}, {timed(ours) * 1e3:.0f} and {timed(alt) * 1e3:.0f} us; tokens equal {same}",
              flush=True)
