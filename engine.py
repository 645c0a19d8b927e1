"""
The embedded rollout engine: batched generation for model_dsv4 with a real KV cache (kv_cache.py: the cache, and the
model's prefill and decode through it), continuous batching, and SGLang's sampling and logprob semantics. server.py
serves it over SGLang's HTTP API. On a GPU each batch bucket's decode step is replayed as one CUDA graph.

Logprobs are log_softmax(logits / temperature) over the full vocabulary (log_softmax(logits) when greedy),
taken before top-p / top-k, as SGLang returns them.
"""
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from dsv4_kernels import has_triton
from dsv4_kernels.decode import sample_triton
from kv_cache import KVCache
from model_dsv4 import length_multiple

GREEDY_T = 1e-6  # SGLang treats temperature below this as greedy


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 128
    stop_token_ids: tuple = ()
    ignore_eos: bool = False
    seed: int = None


@dataclass
class Request:
    rid: str
    input_ids: list
    params: SamplingParams
    output_ids: list = field(default_factory=list)
    output_logprobs: list = field(default_factory=list)
    finish_reason: dict = None
    weight_version: str = None
    slot: int = None
    seed: int = None  # the request's draws: gumbel(seed, token index) (params.seed, or a random one)
    record: tuple = ()  # replay.py's fields to return (Engine's record): read from the cache when it finishes
    recorded: dict = None  # field -> int32 [prompt + output - 1, ...] (KVCache.recorded)
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def prompt_tokens(self):
        return len(self.input_ids)


def gumbel(seeds, counters, V):
    """Gumbel noise [B, V] in fp64 for row b's draw number counters[b] under seeds[b] (int64 [B]): a counter-based
    generator, u = hash(seed, counter, token id) -> -log(-log u). The hash: a row's state (seed and counter mixed
    by two odd multipliers) plus the token id, times splitmix64's increment, then splitmix64's finaliser, in int64
    arithmetic, which wraps as the unsigned original does; a right shift that would copy the sign bit is masked back
    to a logical one. Same integers on every device, so a seed's draws are too."""
    srl = lambda x, k: (x >> k) & ((1 << (64 - k)) - 1)
    signed = lambda c: c - (1 << 64) if c >= 1 << 63 else c
    row = (seeds * signed(0x9E3779B97F4A7C15) + counters) * signed(0xD1B54A32D192ED03)  # [B]
    x = (row[:, None] + torch.arange(V, device=seeds.device)) * signed(0x9E3779B97F4A7C15)  # [B, V]
    x = (x ^ srl(x, 30)) * signed(0xBF58476D1CE4E5B9)
    x = (x ^ srl(x, 27)) * signed(0x94D049BB133111EB)
    u = (srl(x ^ srl(x, 31), 11).double() + 0.5) * 2.0 ** -53  # 53 random bits, in (0, 1)
    return -torch.log(-torch.log(u))


def sample_tokens(logits, params, draws, filtered):
    """The device side of Engine._sample (compile_policy.compile_engine compiles it). logits fp32 [B, V]; params fp64
    [B, 3]: temperature, top_p, top_k (V: off); draws int64 [B, 2]: seed, token index; filtered: some row has
    top-p or top-k -> fp64 [2, B]: the tokens and their logprobs."""
    V = logits.shape[1]
    temp, top_p, top_k = params.T
    greedy = temp < GREEDY_T
    logprobs = (logits / torch.where(greedy, 1.0, temp).float()[:, None]).log_softmax(-1)
    keep = logprobs
    if filtered:
        sorted_lp, order = logprobs.sort(dim=-1, descending=True)
        sorted_p = sorted_lp.exp()
        drop = torch.arange(V, device=logits.device)[None] >= top_k[:, None]
        drop |= sorted_p.cumsum(-1) - sorted_p > top_p[:, None]  # top-p: the smallest prefix reaching top_p
        keep = logprobs.scatter(1, order, sorted_lp.masked_fill(drop, float("-inf")))
    token = torch.where(greedy, logprobs.argmax(-1), (keep.double() + gumbel(draws[:, 0], draws[:, 1], V)).argmax(-1))
    return torch.stack([token.double(), logprobs.gather(1, token[:, None])[:, 0].double()])


class Engine:
    """record: the replay fields (replay.py) the cache keeps for every sequence ("routed_experts", "indexer_topk"),
    which a request may then ask for."""
    def __init__(self, model, max_batch=64, max_len=4096, cuda_graphs=True, record=()):
        self.model, self.args, self.record = model.eval(), model.args, tuple(record)
        self.device = next(model.parameters()).device
        self.max_batch, self.max_len = max_batch, max_len
        # the batch sizes decode runs at on a GPU (CUDA graphs): a batch takes the smallest bucket that holds it; none
        # of 1, which compiled code would specialise into a graph of its own (compile_policy._dynamic_dims)
        self.buckets = [b for b in (2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768) if b < max_batch]
        self.buckets += [max_batch]
        self.module_of = dict(model.named_modules())  # for load_weights: the module tree is fixed once built
        # batch bucket -> CUDA graph of _decode; graphs need its sync-free path: fast kernels (grouped GEMM
        # experts, which CUDA runs in bf16). FP8 numerics (a W8A8 server) decode eager: sync-free too with the grouped
        # experts, but their capture has not been checked on a GPU
        fast = all(layer.ffn.fast for layer in model.layers.values())
        self.graphs = {} if (cuda_graphs and self.device.type == "cuda" and fast and model.dtype == torch.bfloat16
                             and not any(getattr(m, "fp8_emu", False) for m in model.modules())) else None
        # a scratch slot past max_batch: the padding rows of the CUDA graphs' batch buckets decode into it
        self.cache = KVCache(model, max_batch + 1, max_len, self.device, static=self.graphs is not None, record=record)
        self._weights_in_place()
        self.vocab_size, self.eos_token_id = self.args.vocab_size, self.args.eos_token_id
        self.sample_tokens = sample_tokens  # compile_policy.compile_engine puts a compiled one here
        self.weight_version = "default"
        self.lock = threading.Lock()  # held while stepping: weight swaps take it
        self.wake = threading.Condition()
        self.waiting, self.running = deque(), {}  # running: slot -> Request
        self.inflight = None  # the last decode's sampled tokens, not yet applied (step)
        self.paused = False

    # ------------------------------------------------------------------ public, thread-safe
    def submit(self, input_ids, params, rid, record=()):
        if not input_ids or len(input_ids) + params.max_new_tokens > self.max_len:
            raise ValueError(f"prompt length {len(input_ids)} + max_new_tokens {params.max_new_tokens} must be "
                             f"in [1, max_len={self.max_len}]")
        if not set(record) <= set(self.record):
            raise ValueError(f"the engine records {list(self.record)}, not {sorted(set(record) - set(self.record))}")
        req = Request(rid, list(input_ids), params, record=tuple(record))
        req.seed = (params.seed if params.seed is not None else torch.seed()) % 2 ** 63
        with self.wake:
            self.waiting.append(req)
            self.wake.notify()
        return req

    def abort(self, rid=None):
        """Abort one request by rid, or every request when rid is None."""
        with self.wake:
            for req in list(self.waiting) + list(self.running.values()):
                if rid is None or req.rid == rid:
                    req.aborted = True
            self.wake.notify()

    def abort_all(self):
        self.abort(None)

    def pause(self):
        with self.lock:  # returns once the current step is over
            self.paused = True
            self._drain()

    def resume(self):
        with self.wake:
            self.paused = False
            self.wake.notify()

    def flush(self):
        """No prefix cache outlives a request here; report whether the engine is idle, as SGLang's flush does."""
        return not self.running and not self.waiting

    @torch.no_grad()
    def load_weights(self, named_tensors):
        """Copy tensors into the model by official name; checks everything before touching anything. Each name is
        looked up on its module (a weight sync's bucket names a few hundred of the model's thousands)."""
        def own(k):  # the parameter or buffer named k, or None
            module, _, attr = k.rpartition(".")
            m = self.module_of.get(module)
            return None if m is None else m._parameters.get(attr, m._buffers.get(attr))
        sd = {k: own(k) for k in named_tensors}
        bad = [f"{k}: unknown" if sd[k] is None else f"{k}: shape {tuple(v.shape)} vs {tuple(sd[k].shape)}"
               for k, v in named_tensors.items() if sd[k] is None or tuple(v.shape) != tuple(sd[k].shape)]
        if bad:
            raise ValueError("cannot load weights: " + "; ".join(bad))
        with self.lock:
            self._drain()
            dst = [sd[k] for k in named_tensors]  # one multi-tensor copy: a bucket names a few hundred tensors
            if dst:
                torch._foreach_copy_(dst, [v.to(d.device, d.dtype) for d, v in zip(dst, named_tensors.values())])

    def generate(self, prompts, params):
        """Offline use (tests, benchmarks): run the loop in this thread until every prompt is done. Each request
        returns what the engine records (record)."""
        params = params if isinstance(params, list) else [params] * len(prompts)
        reqs = [self.submit(p, sp, str(i), self.record) for i, (p, sp) in enumerate(zip(prompts, params))]
        while not all(r.done.is_set() for r in reqs):
            self.step()
        return reqs

    def run_forever(self, stop):
        """The scheduler loop of the server: step while there is work, sleep on the condition otherwise."""
        while not stop.is_set():
            with self.wake:
                while not stop.is_set() and (self.paused or not (self.waiting or self.running)):
                    self.wake.wait(timeout=0.5)
            if not stop.is_set():
                self.step()

    # ------------------------------------------------------------------ scheduling
    @torch.no_grad()
    def step(self):
        """Admit waiting requests into free slots (prefill), then decode one token for every running one.
        Overlapped: this step's decode starts from the last step's tokens where they lie on the device, and only
        then are those tokens read back and applied (appended, stops checked), so the device decodes while the host
        does its per-request work. A request that stops on EOS or a stop token has had one more token decoded,
        which is dropped; one that reaches max_new_tokens is known to and left out of the next decode."""
        with self.lock, self.model.numerics():
            if self.paused:
                return
            self._finish_aborted()
            self._admit()
            prev, self.inflight = self.inflight, None
            ahead = {} if prev is None else {id(r): i for i, r in enumerate(prev.reqs) if not r.done.is_set()}
            reqs = [r for _, r in sorted(self.running.items())
                    if len(r.output_ids) + (id(r) in ahead) < r.params.max_new_tokens]
            if reqs:
                k = torch.tensor([id(r) in ahead for r in reqs], dtype=torch.long)  # 1: its last token is in flight
                rows = torch.tensor([[r.slot for r in reqs], [r.output_ids[-1] for r in reqs],
                                     [len(r.input_ids) + len(r.output_ids) - 1 for r in reqs],
                                     [ahead.get(id(r), 0) for r in reqs]])
                tokens = rows[1]
                if prev is not None and k.any():  # in-flight tokens, gathered on the device
                    src = self._upload(rows[[1, 3]])  # host tokens, rows of prev.tokens
                    tokens = torch.where(self._upload(k).bool(), prev.tokens[src[1]], src[0])
                logits = self.decode(rows[0], tokens, rows[2] + k)
                self.inflight = self._launch_sample(reqs, logits, k)
            if prev is not None:
                self._apply(prev)

    def _drain(self):
        """Apply the tokens still in flight (before a weight swap or a pause, so a finish names the old version)."""
        prev, self.inflight = self.inflight, None
        if prev is not None:
            self._apply(prev)

    def _admit(self):
        with self.wake:
            free = [s for s in range(self.max_batch) if s not in self.running]
            # each admission is a prefill, and the host waits for its first tokens: while others decode, a batch
            # whose sequences finish one by one admits once an eighth of it is free (or all that wait fit), not
            # at every step
            if self.running and len(free) < min(len(self.waiting), max(1, self.max_batch // 8)):
                return
            batch = [self.waiting.popleft() for _ in range(min(len(free), len(self.waiting)))]
        if not batch:
            return
        # GRPO sends n samples of one prompt: prefill each distinct prompt once, then copy its cache slot
        first = {}
        for req, slot in zip(batch, free):
            req.slot = slot
            first.setdefault(tuple(req.input_ids), req)
        self.cache.reset([r.slot for r in batch])  # a slot's previous sequence leaves no window or overlap state
        uniq = list(first.values())
        logits = {}
        for i in range(0, len(uniq), self.max_batch):  # prompts of one chunk are right-padded together
            chunk = uniq[i:i + self.max_batch]
            out = self.prefill([r.slot for r in chunk], [r.input_ids for r in chunk])
            logits.update({id(r): row for r, row in zip(chunk, out)})
        copies = [(first[tuple(r.input_ids)].slot, r.slot) for r in batch if first[tuple(r.input_ids)] is not r]
        if copies:
            self.cache.copy(*zip(*copies))
        for req in batch:
            self.running[req.slot] = req
        self._apply(self._launch_sample(batch, torch.stack([logits[id(first[tuple(r.input_ids)])] for r in batch])))

    def _finish_aborted(self):
        with self.wake:
            for req in [r for r in self.waiting if getattr(r, "aborted", False)]:
                self.waiting.remove(req)
                self._finish(req, {"type": "abort", "message": "aborted"})
        for req in [r for r in self.running.values() if getattr(r, "aborted", False)]:
            self._finish(req, {"type": "abort", "message": "aborted"})

    def _finish(self, req, reason):
        req.finish_reason, req.weight_version = reason, self.weight_version
        if req.record and req.slot is not None:  # before the slot is reused; the last token was never fed
            req.recorded = self.cache.recorded(req.slot, len(req.input_ids) + len(req.output_ids) - 1, req.record)
        self.running.pop(req.slot, None)
        req.done.set()

    def _launch_sample(self, reqs, logits, ahead=None):
        """logits: fp32 [B, vocab], a row per request; ahead: int64 [B], 1 where the request's last token is still
        in flight (this draw is its next one). Gumbel-max: argmax(log p_i + G_i), G_i Gumbel noise, picks token i
        with probability p_i. Each row's noise is a function of its request's seed and token index (gumbel()), so a
        request draws the same tokens alone or in any batch, and the whole batch is sampled by one set of kernels.
        Nothing waits here: the tokens stay on the device for the next decode and are copied back (to pinned memory
        on a GPU) behind an event; _apply reads them. Also SGLang's logprob of the chosen token."""
        V = logits.shape[1]
        params = torch.tensor([[r.params.temperature, r.params.top_p, r.params.top_k if 0 < r.params.top_k < V else V]
                               for r in reqs], dtype=torch.float64)
        draws = torch.tensor([[r.seed, len(r.output_ids)] for r in reqs])
        if ahead is not None:
            draws[:, 1] += ahead
        filtered = bool(params[:, 1].min() < 1.0 or params[:, 2].min() < V)
        # dsv4_kernels.decode.sample_triton: the same draws, on a GPU ('sampling': off with set_invariant too)
        if self.model.fast_sampling and has_triton(logits) and not filtered:
            greedy = params[:, 0] < GREEDY_T
            temp = torch.where(greedy, 1.0, params[:, 0]).float()
            chosen = sample_triton(logits, *(self._upload(t) for t in (temp, greedy, draws)))
        else:
            chosen = self.sample_tokens(logits, self._upload(params), self._upload(draws), filtered)
        out = type("InFlight", (), {})()
        out.reqs, out.tokens, out.host = reqs, chosen[0].long(), chosen.to("cpu", non_blocking=True)
        out.event = torch.cuda.Event() if chosen.is_cuda else None
        if chosen.is_cuda:
            out.event.record()
        return out

    def _apply(self, chosen):
        """Append the sampled tokens of a _launch_sample to their requests and finish those that stop; requests
        finished or aborted meanwhile are skipped."""
        if chosen.event is not None:
            chosen.event.synchronize()
        for req, token, lp in zip(chosen.reqs, *chosen.host.tolist()):
            if req.done.is_set():
                continue
            p, token = req.params, int(token)
            req.output_ids.append(token)
            req.output_logprobs.append(lp)
            if token in p.stop_token_ids or (token == self.eos_token_id and not p.ignore_eos):
                self._finish(req, {"type": "stop", "matched": token})
            elif len(req.output_ids) >= p.max_new_tokens:
                self._finish(req, {"type": "length", "length": len(req.output_ids)})

    # ------------------------------------------------------------------ the model, with the cache
    @torch.no_grad()
    def prefill(self, slots, prompts):
        """prompts: token lists -> fp32 logits [B, vocab] at each prompt's last position, each slot's cache filled."""
        return self.cache.prefill(self.model, slots, prompts)

    def _weights_in_place(self):
        """Experts read in place by the grouped GEMM (Transformer.stack_experts), and each layer's attention input
        projections by one GEMM (Transformer.fuse_projections). Done again where something replaced the parameters (a
        dtype cast), and then the CUDA graphs, which read the old tensors, are dropped."""
        if self.model.stack_experts() | self.model.fuse_projections():  # both, always
            self.graphs = self.graphs and {}  # {} or None as before, without the stale captures

    def _upload(self, t):
        """A host tensor to the device without waiting for the work queued there. From pageable memory the CUDA
        driver may synchronise with the stream to stage the copy (the API's documented behaviour), which would hold
        the host until the decode in flight is done and undo the overlapped step; from pinned memory the copy is
        queued and the host goes on (the caching host allocator keeps the block until the copy is done)."""
        if self.device.type == "cuda" and t.device.type == "cpu" and not t.is_pinned():
            t = t.pin_memory()
        return t.to(self.device, non_blocking=True)

    @torch.no_grad()  # in any caller's mode: compiled with autograd on, inductor failed (mm_f32 has no derivative)
    def decode(self, slots, tokens, pos):
        """One token per sequence. slots, tokens, pos: int64 [B] (on any device) -> fp32 logits [B, vocab].
        On a GPU this replays a CUDA graph of _decode captured for the smallest batch bucket >= B (the padding
        rows decode into the scratch slot): one launch instead of thousands, which is what bounds decode there."""
        B = len(slots)
        self._weights_in_place()  # here, not in the model: compiled code and CUDA graphs read them as given
        if self.graphs is None:
            return self._decode(*(self._upload(t) for t in (slots, tokens, pos)))
        bucket = next(b for b in self.buckets if b >= B)
        if bucket not in self.graphs:
            self.graphs[bucket] = self._capture(bucket)
        g = self.graphs[bucket]
        host = torch.zeros(3, bucket, dtype=torch.long, pin_memory=True)  # see _upload
        host[0] = self.max_batch  # the padding rows: the scratch slot, token 0, position 0
        host[0, :B], host[2, :B] = slots, pos
        if tokens.device.type == "cpu":
            host[1, :B] = tokens
        g.inputs.copy_(host, non_blocking=True)  # a blocking copy would wait for the decode still running
        if tokens.device.type != "cpu":  # the last step's tokens, gathered on the device (step)
            g.tokens[:B].copy_(tokens)
        g.graph.replay()
        return g.out[:B]

    def warm_up(self, progress=None):
        """Decode once at every bucket, on the scratch slot, before the first request: under compile='layers' the
        first bucket compiles each kind of layer (its batch symbolic, so the other buckets share the graph) and a GPU
        captures each bucket's graph, which the first rollout would pay otherwise. With a compiled
        prefill (KVCache.pad_prefill) also two prefills there, of 2 prompts
        padded to one length multiple and of 3 to two, after which batch and length are dynamic in every piece of
        the compiled layers (a size first seen as 1, or only once in a piece after a graph break, would compile
        again at the first request). progress(done, total, bucket) follows each bucket. Returns the seconds it took."""
        t0 = time.perf_counter()
        with self.lock, self.model.numerics():
            if self.cache.pad_prefill:
                for b, n in ((2, 1), (3, length_multiple(self.model.args) + 1)):
                    self.prefill([self.max_batch] * b, [[0] * n] * b)
                self.cache.reset([self.max_batch])
            for i, b in enumerate(self.buckets):
                rows = torch.full((b,), self.max_batch, dtype=torch.long)  # every row on the scratch slot
                self.decode(rows, torch.zeros(b, dtype=torch.long), torch.zeros(b, dtype=torch.long))
                if progress:
                    progress(i + 1, len(self.buckets), b)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    def _capture(self, bucket):
        """Record _decode for `bucket` rows on static input tensors, after two warm-up runs on a side stream."""
        g = type("Graph", (), {})()
        g.inputs = torch.zeros(3, bucket, dtype=torch.long, device=self.device)
        g.inputs[0] = self.max_batch
        g.slots, g.tokens, g.pos = g.inputs  # views: decode() writes all three with one copy (host tokens)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._decode(g.slots, g.tokens, g.pos)
        torch.cuda.current_stream().wait_stream(side)
        g.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g.graph, pool=getattr(self, "graph_pool", None)):
            g.out = self._decode(g.slots, g.tokens, g.pos)
        self.graph_pool = g.graph.pool()  # the buckets share one memory pool
        return g

    def _decode(self, slots, tokens, pos):
        return self.cache.decode(self.model, slots, tokens, pos)


if __name__ == "__main__":
    # Self-check: a tiny random model; prefill + decode logprobs equal the training forward's.
    from model_dsv4 import ModelArgs, Transformer
    torch.manual_seed(0)
    model = Transformer(ModelArgs(), dtype=torch.float32)
    engine = Engine(model, max_batch=8, max_len=256)
    prompts = [torch.randint(2, 4096, (n,)).tolist() for n in (5, 37, 64, 90)]
    t0 = time.time()
    reqs = engine.generate(prompts, SamplingParams(max_new_tokens=48, ignore_eos=True, seed=1))
    n_tok = sum(len(r.output_ids) for r in reqs)
    print(f"generated {n_tok} tokens for {len(reqs)} prompts in {time.time() - t0:.1f}s")
    worst = 0.0
    for r in reqs:
        ids = torch.tensor(r.input_ids + r.output_ids)[None]
        ref = model(ids)[0, len(r.input_ids) - 1:-1].log_softmax(-1).gather(-1, ids[0, len(r.input_ids):, None])[:, 0]
        worst = max(worst, (ref - torch.tensor(r.output_logprobs)).abs().max().item())
    print(f"engine logprobs vs full forward: max |diff| = {worst:.2e}")
    assert worst < 1e-4
