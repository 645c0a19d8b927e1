"""The KV-cache engine against the training forward, and its sampling semantics."""
import copy
import os
import re
import subprocess
import sys

import pytest
import torch

from conftest import SMALL, TINY, randomize_
from engine import Engine, SamplingParams
from model_dsv4 import Transformer


def model_of(args, dtype=torch.float32):
    m = Transformer(copy.deepcopy(args), dtype=torch.float32)
    return randomize_(m, args.n_routed_experts, args.num_experts_per_tok).set_dtype(dtype)


def forward_logprobs(model, req, temperature=1.0):
    """What the trainer computes for a finished request: log_softmax(logits / T) at the generated tokens."""
    ids = torch.tensor(req.input_ids + req.output_ids)[None]
    with torch.no_grad():
        logits = model(ids)[0, len(req.input_ids) - 1:-1]
    return (logits / temperature).log_softmax(-1).gather(-1, ids[0, len(req.input_ids):, None])[:, 0]


@pytest.mark.slow
@pytest.mark.parametrize("args,lengths,new", [(TINY, (1, 3, 17, 33, 70), 40), (SMALL, (5, 120, 200), 70)],
                         ids=["tiny", "small"])
def test_prefill_then_decode_equals_full_forward(args, lengths, new):
    """Prompts shorter than a compression window, longer than the sliding window, and decodes that cross
    CSA (4), HCA (16 / 128) and window boundaries."""
    model = model_of(args)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, args.vocab_size, (n,), generator=g).tolist() for n in lengths]
    engine = Engine(model, max_batch=8, max_len=512)
    reqs = engine.generate(prompts, SamplingParams(temperature=0.7, max_new_tokens=new, ignore_eos=True, seed=3))
    for r in reqs:
        assert len(r.output_ids) == new and r.finish_reason == {"type": "length", "length": new}
        diff = (forward_logprobs(model, r, 0.7) - torch.tensor(r.output_logprobs)).abs().max().item()
        assert diff <= 1e-4, f"prompt {len(r.input_ids)}: engine vs forward {diff:.2e}"


@pytest.mark.slow
def test_batched_equals_one_by_one_and_prefix_sharing():
    """Same seeds give the same tokens whether requests run alone or together, and n samples of one
    prompt (prefilled once, cache copied) differ only through their seeds."""
    model = model_of(TINY)
    prompts = [[5, 6, 7, 8, 9], [11] * 40, [5, 6, 7, 8, 9], [3, 4]]
    params = [SamplingParams(max_new_tokens=24, ignore_eos=True, seed=s) for s in (1, 2, 3, 4)]
    together = Engine(model, max_batch=8, max_len=128).generate(prompts, params)
    for p, sp, r in zip(prompts, params, together):
        alone = Engine(model, max_batch=8, max_len=128).generate([p], sp)[0]
        assert alone.output_ids == r.output_ids
        torch.testing.assert_close(torch.tensor(alone.output_logprobs), torch.tensor(r.output_logprobs))
    assert together[0].output_ids != together[2].output_ids  # same prompt, other seed


def test_continuous_batching_admits_mid_flight():
    """2 slots for 4 requests: request 0 stops after 3 tokens, 1 runs for 12, and 2, then the late one, take the
    slot that frees while 1 still runs."""
    model = model_of(TINY)
    engine = Engine(model, max_batch=2, max_len=128)
    sp = lambda n: SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)
    reqs = [engine.submit(p, sp(n), str(i)) for i, (p, n) in enumerate([([1, 2, 3], 3), ([4] * 9, 12), ([7, 8], 3)])]
    engine.step()
    late = engine.submit([9, 9, 9, 9, 9], sp(6), "late")
    beside = set()  # the requests that held a slot while request 1 was running
    while not all(r.done.is_set() for r in reqs + [late]):
        engine.step()
        if not reqs[1].done.is_set():
            assert engine.running.get(reqs[1].slot) is reqs[1]
            beside |= {r.rid for r in engine.running.values() if r is not reqs[1]}
    assert {"2", "late"} <= beside and late.slot is not None, beside
    for r in reqs + [late]:  # greedy: every token is the argmax of the full forward
        ids = torch.tensor(r.input_ids + r.output_ids)[None]
        with torch.no_grad():
            want = model(ids)[0, len(r.input_ids) - 1:-1].argmax(-1).tolist()
        assert r.output_ids == want


@pytest.mark.slow
def test_admission_waits_for_an_eighth_of_the_batch():
    """16 slots for 40 requests that finish one by one: while others decode, a prefill admits at least 2 (an
    eighth of the batch) unless fewer wait, and the tokens are those of a batch that holds every request at once."""
    model = model_of(TINY)
    prompts = [[2 + i % 50, 3 + i // 50, 7] for i in range(40)]
    params = [SamplingParams(max_new_tokens=1 + i % 13, ignore_eos=True, seed=i) for i in range(40)]
    engine, admitted = Engine(model, max_batch=16, max_len=64), []
    prefill = engine.prefill
    engine.prefill = lambda slots, ps: admitted.append((len(slots), len(engine.running), len(engine.waiting))) or \
        prefill(slots, ps)
    reqs = engine.generate(prompts, params)
    mid = [(n, waiting) for n, running, waiting in admitted if running]
    assert len(mid) >= 3 and all(n >= min(2, n + waiting) for n, waiting in mid), admitted
    assert any(n < 16 for n, _ in mid)  # the chunks are not whole batches: the slots are reused mid-flight
    at_once = Engine(model, max_batch=64, max_len=64).generate(prompts, params)
    assert [r.output_ids for r in reqs] == [r.output_ids for r in at_once]


def test_sampling_semantics():
    model = model_of(TINY)
    engine = Engine(model, max_batch=8, max_len=128)
    prompt = [10, 20, 30]
    with torch.no_grad():
        logits = model(torch.tensor([prompt]))[0, -1]
    # top-k 3: the first token is one of the 3 most likely, and its logprob is still over the full vocab
    reqs = engine.generate([prompt] * 6, [SamplingParams(top_k=3, max_new_tokens=1, seed=s) for s in range(6)])
    top3 = set(logits.topk(3).indices.tolist())
    for r in reqs:
        assert r.output_ids[0] in top3
        assert abs(r.output_logprobs[0] - logits.log_softmax(-1)[r.output_ids[0]].item()) < 1e-5
    # top-p small: only the most likely token survives
    r = engine.generate([prompt], SamplingParams(top_p=1e-4, max_new_tokens=1, seed=0))[0]
    assert r.output_ids[0] == int(logits.argmax())
    # stop tokens and EOS end a request with SGLang's finish reasons
    first = int(logits.argmax())
    r = engine.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=9, stop_token_ids=(first,)))[0]
    assert r.output_ids == [first] and r.finish_reason == {"type": "stop", "matched": first}


def splitmix64_uniform(seed, counter, token):
    """The reference for engine.gumbel's hash, in Python's unbounded integers taken mod 2^64."""
    m, G = (1 << 64) - 1, 0x9E3779B97F4A7C15
    x = (((seed * G + counter) * 0xD1B54A32D192ED03 + token) * G) & m
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
    return ((x ^ (x >> 31)) >> 11) * 2.0 ** -53 + 2.0 ** -54


def test_gumbel_noise_is_splitmix64_and_sampling_follows_the_distribution():
    from engine import Request, gumbel
    seeds = torch.tensor([0, 1, 3, 2 ** 62 + 12345, 2 ** 63 - 1])
    counters = torch.tensor([0, 7, 1 << 20, 5, 999])
    u = torch.exp(-torch.exp(-gumbel(seeds, counters, 300)))
    want = torch.tensor([[splitmix64_uniform(s, c, v) for v in range(300)]
                         for s, c in zip(seeds.tolist(), counters.tolist())], dtype=torch.float64)
    assert (u - want).abs().max() < 1e-12
    # 6000 draws, one per seed, of a known distribution: temperature 1, temperature 0.5, and top-k 2
    engine = Engine(model_of(TINY), max_batch=8, max_len=64)
    p = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    for params, q in [(SamplingParams(), p), (SamplingParams(temperature=0.5), p ** 2),
                      (SamplingParams(top_k=2), torch.tensor([0.4, 0.3, 0, 0, 0]))]:
        reqs = [Request(str(s), [1], params, seed=s) for s in range(6000)]
        engine._apply(engine._launch_sample(reqs, p.log().expand(len(reqs), -1)))
        freq = torch.bincount(torch.tensor([r.output_ids[0] for r in reqs]), minlength=5).double()
        expect = q.double() / q.sum() * len(reqs)
        seen = expect > 0
        assert freq[~seen].sum() == 0
        chi2 = ((freq - expect)[seen] ** 2 / expect[seen]).sum()
        assert chi2 < 20, (params, freq, expect)  # 4 degrees of freedom at most: p < 1e-3
        lp = (p.log() / params.temperature).log_softmax(-1)  # SGLang's logprob: tempered, before top-k
        assert max(abs(r.output_logprobs[0] - lp[r.output_ids[0]].item()) for r in reqs[:50]) < 1e-5


def test_overlapped_steps_drop_the_token_after_a_stop():
    """A step decodes from the last step's tokens before reading them back (Engine.step), so a request that hits a
    stop token has one token decoded past it: dropped, and its slot goes to a waiting request. Greedy outputs with
    stops must be the no-stop outputs cut after the stop's first occurrence."""
    model = model_of(TINY)
    prompts = [[1, 2, 3], [4] * 9, [7, 8], [9, 9, 9, 9, 9]]
    free = Engine(model, max_batch=4, max_len=64).generate(
        prompts, SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True))
    stops = [r.output_ids[2 + 3 * i] for i, r in enumerate(free)]  # each stops at a different step
    engine = Engine(model, max_batch=2, max_len=64)  # two slots for four requests
    reqs = [engine.submit(p, SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True, stop_token_ids=[t]),
                          str(i)) for i, (p, t) in enumerate(zip(prompts, stops))]
    engine.step()  # prefill (first tokens applied at once), then the first decode, left in flight
    assert engine.inflight is not None and all(len(r.output_ids) == 1 for r in reqs[:2])
    while not all(r.done.is_set() for r in reqs):
        engine.step()
    for r, f, t in zip(reqs, free, stops):
        cut = f.output_ids.index(t) + 1
        assert r.output_ids == f.output_ids[:cut] and r.finish_reason == {"type": "stop", "matched": t}
        torch.testing.assert_close(torch.tensor(r.output_logprobs), torch.tensor(f.output_logprobs[:cut]))
    r = engine.submit([5, 5], SamplingParams(max_new_tokens=8, ignore_eos=True), "p")
    engine.step()
    engine.step()
    engine.pause()  # applies what is in flight: a weight swap after it sees every sampled token
    assert engine.inflight is None and len(r.output_ids) == 3


def test_abort_and_bad_input():
    model = model_of(TINY)
    engine = Engine(model, max_batch=2, max_len=64)
    with pytest.raises(ValueError, match="max_len"):
        engine.submit([1] * 60, SamplingParams(max_new_tokens=10), "too-long")
    r = engine.submit([1, 2], SamplingParams(max_new_tokens=50, ignore_eos=True), "a")
    engine.step()
    engine.abort("a")
    engine.step()
    assert r.done.is_set() and r.finish_reason["type"] == "abort"
    with pytest.raises(ValueError, match="unknown"):
        engine.load_weights({"layers.0.nope.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="shape"):
        engine.load_weights({"embed.weight": torch.zeros(3, 3)})


@pytest.mark.slow
def test_bf16_engine_close_to_bf16_forward():
    model = model_of(TINY, torch.bfloat16)
    engine = Engine(model, max_batch=4, max_len=128)
    r = engine.generate([list(range(2, 50))], SamplingParams(max_new_tokens=30, ignore_eos=True, seed=0))[0]
    diff = (forward_logprobs(model, r) - torch.tensor(r.output_logprobs)).abs()
    assert diff.mean().item() < 0.05, diff.mean().item()


@pytest.mark.slow
def test_decode_bench_counts_the_experts_a_step_reads():
    """bench/bench.py --what=decode takes the floor's expert bytes from the experts the batch's tokens pick. Its model
    and prompts, rebuilt here (tiny's trunk drawn by init_weights, torch.manual_seed(0), then the prompts), routed with
    the gates' own expert ids: the distinct experts of each layer and the weight bytes they imply, exactly."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    B, T = 4, 8
    run = subprocess.run([sys.executable, "bench/bench.py", "--what=decode", f"--batch={B}", f"--seq={T}",
                          "--new_tokens=4", "--no_peer"], cwd=root, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    from model_dsv4 import ModelArgs
    args = ModelArgs.from_json(os.path.join(root, "config/models/tiny.json"))
    args.num_nextn_predict_layers, args.compress_ratios = 0, args.compress_ratios[:args.num_hidden_layers]
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(copy.deepcopy(args), dtype=torch.float32)
    model.to_empty(device="cpu").init_weights()
    prompts = torch.randint(2, args.vocab_size, (B, T))
    ids = {}  # layer -> the expert ids its gate returns for the batch's first tokens
    hooks = [layer.ffn.gate.register_forward_hook(lambda gate, inputs, out, i=i: ids.__setitem__(i, out[1]))
             for i, layer in model.layers.items()]
    with torch.no_grad():
        model(prompts[:, :1])
    for h in hooks:
        h.remove()
    counts = [len(set(ids[i].flatten().tolist())) for i in model.layers]
    size = lambda prefix: sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n.startswith(prefix))
    dense = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                if not n.startswith(("embed.", "mtp.")) and ".experts." not in n)
    weights = dense + sum(c * size(f"layers.{i}.ffn.experts.0.") for i, c in zip(model.layers, counts))
    picked = re.search(r"experts picked a layer: ([\d.]+) of 16 \(uniform routing: ([\d.]+)\); by layer: \[([\d, ]+)\]",
                       run.stdout)
    assert picked, run.stdout
    assert [int(c) for c in picked[3].split(", ")] == counts, (run.stdout, counts)
    assert picked[1] == f"{sum(counts) / len(counts):.1f}" and picked[2] == "10.9"
    floor = re.search(r"floor: [\d.]+ GB weights \((\d+) bytes\) \+ .* = [\d.]+ ms/step; ours [\d.]+x the floor",
                      run.stdout)
    assert floor and int(floor[1]) == weights, (run.stdout, weights)
