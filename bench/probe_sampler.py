"""engine.sample_tokens (without top-p and top-k) as kernels_decode.sample_triton's two Triton kernels over chunks of
the vocabulary, against the compiled reference, in the same run. The reference compiles to one reduction kernel, a
program per row, each running the whole 129280-token vocabulary through log_softmax, engine.gumbel's int64 hash and
two fp64 logs: 157 us of a 4.4 ms decode step at batch 64 on an H200 (its trace, RESULTS.md session 24). Session 25's
run of this probe put the kernels at 42 and 107 us (greedy, temperature 1) against the reference's 174 and 175 at
batch 64, which is why the engine takes them on a GPU. A third contender: the reference's torch code with a two-stage
argmax, compiled. Each timed as CUDA-graph replays (the device's time) and as calls.
python bench/probe_sampler.py   (a GPU)"""
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kernels_decode import SAMPLE_CHUNK, sample_triton, triton  # noqa: E402  (without a GPU: the interpreter)
import engine  # noqa: E402
from probe_timing import graph_us, timed  # noqa: E402


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


gen = torch.Generator().manual_seed(0)
if not torch.cuda.is_available():  # the tokens against the reference: tests/test_decode_kernels.py -k sample
    sys.exit("a timing probe for a GPU; the sampler's check on a CPU: pytest tests/test_decode_kernels.py -k sample")

V = 129280
print(f"sampling, {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
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
