"""
Rollouts over SGLang's native HTTP API (0.5.23). The trainer has one code path: it
always talks HTTP, to real SGLang servers at scale or to the embedded server (server.py) on CPU and in CI.

    client = RolloutClient("http://10.0.0.1:30000,http://10.0.0.2:30000")
    groups = client.generate(prompts, n=8, sampling={"temperature": 0.8, "max_new_tokens": 4096}, seed=step)
    client.update_weights_from_disk(path, "step-12")      # the trainer's weight syncs: weight_sync.py

    python server.py --model out/ckpt --port 30000     # the embedded server (server.py)
    python rollout.py                                  # self-check: tiny model, server, client, seconds

Only the standard library: requests run as blocking http.client calls in threads (asyncio.to_thread under
a semaphore), so there is no aiohttp/requests dependency.
"""
import asyncio
import atexit
import hashlib
import http.client
import json
import os
import socket
import subprocess
import sys
import time
import uuid
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from urllib.parse import urlsplit

from replay import FIELDS as REPLAY_FIELDS, FLAGS as REPLAY_FLAGS, decode as decode_ids

# Connection refused or reset, timeouts, a response cut short: the server, not the request, is at fault.
RETRYABLE = (OSError, http.client.HTTPException)

# Training rollouts keep top_p 1 and top_k -1: the returned logprobs are over the full vocabulary (as the
# trainer's are), so any truncation would make the two sides disagree. The last two keys shape only the
# detokenized text: keep it whole, stop token included, as output_ids always are.
DEFAULT_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 128, "stop_token_ids": [],
                    "skip_special_tokens": False, "no_stop_trim": True}


def sample_seed(seed, prompt_idx, sample_idx):
    """The sampling seed of one sample, a pure function of (seed, prompt, sample): a rerun draws the same
    tokens whichever server takes the request. 31 bits, so any backend takes it as a plain int."""
    digest = hashlib.blake2b(f"{seed}/{prompt_idx}/{sample_idx}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (1 << 31)


def allow_open_files(n):
    """Raise this process's soft limit on open files to n where the hard limit allows (many systems start at 1,024):
    each request in flight holds a socket, on the client and on the server."""
    import resource  # Unix only, as the rest of the stack
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < n:
        resource.setrlimit(resource.RLIMIT_NOFILE, (n if hard == resource.RLIM_INFINITY else min(n, hard), hard))


def background(fn, *args):
    """fn(*args) in a daemon thread (a call stuck on a dead peer must not keep the trainer alive) -> Future."""
    fut = Future()

    def run():
        try:
            fut.set_result(fn(*args))
        except BaseException as e:
            fut.set_exception(e)
    threading.Thread(target=run, daemon=True).start()
    return fut


class Unreachable(RuntimeError):
    """No server answered a request in 1 + retries attempts (connection trouble, 5xx): the servers, not the request."""


def error_message(payload):
    """The text of an error body: {"error": "..."} (SGLang's contract errors, 401), {"error": {"message": ...}},
    {"success": false, "message": ...} (weight updates), or whatever a proxy sent, cut short."""
    if isinstance(payload, dict):
        err = payload.get("error", payload.get("message", payload))
        payload = err.get("message", err) if isinstance(err, dict) else err
    return str(payload)[:500]


def parse_sample(url, out, body=None):
    """One /generate response -> the sample the trainer uses. The logprob entries [logprob, token_id, text]
    must name exactly the output tokens: the trainer pairs them up by position. The replay fields the request
    `body` asked for (replay.py) come as int32 [prompt + output - 1, -1] under their meta_info names."""
    mi = out["meta_info"]
    entries = mi.get("output_token_logprobs") or []
    if [e[1] for e in entries] != out["output_ids"] or any(e[0] is None for e in entries):
        raise RuntimeError(f"{url}: request {mi['id']}: output_token_logprobs {entries} do not match "
                           f"output_ids {out['output_ids']}")
    sample = {"output_ids": out["output_ids"], "logprobs": [float(e[0]) for e in entries],
              "finish_reason": mi["finish_reason"], "weight_version": mi.get("weight_version"),
              "prompt_tokens": mi["prompt_tokens"], "completion_tokens": mi["completion_tokens"], "url": url}
    for f in [f for f, key in REPLAY_FIELDS.items() if (body or {}).get(key)]:
        if mi.get(f) is None:  # SGLang leaves the field out when it was not started with the flag
            raise RuntimeError(f"{url}: request {mi['id']}: no meta_info.{f} (start SGLang with {REPLAY_FLAGS[f]})")
        try:
            sample[f] = decode_ids(mi[f], mi["prompt_tokens"] + len(out["output_ids"]) - 1)
        except ValueError as e:  # not base64, or not whole rows
            raise RuntimeError(f"{url}: request {mi['id']}: meta_info.{f}: {e}") from e
    return sample


class Progress:
    """done/total and tokens/s on stderr: on a terminal one `\\r` line redrawn 5 times a second; in a log a line every
    `every` seconds and one at the end, only for a phase that lasts that long, so that short ones leave no trace."""
    def __init__(self, total, desc, every=10.0):
        self.total, self.desc, self.done, self.tokens = total, desc, 0, 0
        self.t0 = self.last = time.time()
        self.tty, self.every = sys.stderr.isatty(), every

    def update(self, tokens, count=1):
        self.done, self.tokens, now = self.done + count, self.tokens + tokens, time.time()
        end, period = self.done == self.total, 0.2 if self.tty else self.every
        if self.total and (now - self.last > period or end and (self.tty or now - self.t0 > period)):
            self.last, dt = now, now - self.t0
            print(f"{chr(13) if self.tty else ''}{self.desc}: {self.done}/{self.total} | {self.tokens} tokens | "
                  f"{self.tokens / max(dt, 1e-6):.0f} tok/s | {dt:.1f}s", end="\n" if end or not self.tty else "",
                  file=sys.stderr, flush=True)


class RolloutClient:
    """Samples from /generate on one or more servers, and fans the admin calls out to all of them.

    Load balancing: the URL with the fewest outstanding requests, ties taken in turn. A connection error or
    a 5xx takes a URL out of rotation for backoff * 2^(k-1) seconds after its k-th failure in a row (at most
    max_backoff), and the request moves to another URL; a request that failed 1 + `retries` times raises,
    naming every URL and its last error. generate() starts with a health check of every URL. A 4xx is a
    bad request, not a bad server: it raises at once. URLs in `stale` (a weight sync did not reach them,
    weight_sync.py) get no requests until a full sync does, however healthy they are.

    Real SGLang (0.5.23) answers the same calls; the rest needs its launch flags:
      --enable-deterministic-inference: without it SGLang ignores sampling_seed, and a rerun draws other tokens;
      --enable-return-routed-experts (routing_replay), --enable-return-indexer-topk (indexer_replay; SGLang fills it on
          CUDA / NPU only): without them meta_info lacks the field and generate() raises, naming the flag. replay.py
          reads their byte layout as SGLang's source writes it.
    Only with the embedded server (server.py): its logprobs are the trainer's forward's (within fp32 rounding; both
    sides set_invariant: bit for bit), its experts and indexer picks the trainer's own on the same sequence in fp32
    (tests/test_replay.py), and a sample's tokens a function of its seed alone, whatever the batch."""

    def __init__(self, urls, api_key=None, timeout=3600.0, max_concurrency=256, retries=4, backoff=0.5,
                 max_backoff=30.0):
        urls = urls.split(",") if isinstance(urls, str) else urls
        self.urls = list(dict.fromkeys(u.strip().rstrip("/") for u in urls if u.strip()))
        if not self.urls:
            raise ValueError("RolloutClient: no server URLs given")
        self.api_key, self.timeout, self.max_concurrency = api_key, timeout, max_concurrency
        allow_open_files(max_concurrency + 1024)
        self.retries, self.backoff, self.max_backoff = retries, backoff, max_backoff
        self.outstanding, self.last_error = dict.fromkeys(self.urls, 0), dict.fromkeys(self.urls)
        self.fails = dict.fromkeys(self.urls, 0)  # failures in a row
        self.down_until = dict.fromkeys(self.urls, 0.0)  # time.monotonic() before which a URL is skipped
        self.turn, self.stale = 0, set()
        self.ready = False  # every server answered /health once (wait_ready)

    # ------------------------------------------------------------------ HTTP
    def _http(self, url, method, path, body=None, timeout=None):
        """One blocking request on a fresh connection (no pooled socket to go stale between rollouts):
        (status, JSON body, or text when it is not JSON). Connection trouble raises one of RETRYABLE."""
        u = urlsplit(url)
        conn_class = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
        conn = conn_class(u.hostname, u.port, timeout=timeout or self.timeout)
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        try:
            conn.request(method, u.path + path, None if body is None else json.dumps(body).encode(), headers)
            resp = conn.getresponse()
            raw = resp.read()
        finally:
            conn.close()
        try:
            return resp.status, json.loads(raw) if raw else None
        except ValueError:
            return resp.status, raw.decode(errors="replace")

    def _call(self, url, method, path, body=None, timeout=None):
        """_http that does not raise -> (JSON body or None, error or None). An error: connection trouble, a status
        other than 200, or a weight update's {"success": false}."""
        try:
            status, out = self._http(url, method, path, body, timeout)
        except RETRYABLE as e:
            return None, f"{type(e).__name__}: {e}"
        failed = status != 200 or (isinstance(out, dict) and out.get("success") is False)
        return out, f"HTTP {status}: {error_message(out)}" if failed else None

    def _mark_down(self, url, err):
        """Out of rotation for a backoff. The failures of requests that were already in flight when the URL
        went down are the same incident: they do not count again."""
        self.last_error[url] = str(err)
        now = time.monotonic()
        if now >= self.down_until[url]:
            self.fails[url] += 1
            self.down_until[url] = now + min(self.backoff * 2 ** (self.fails[url] - 1), self.max_backoff)

    def _unreachable(self, what):
        lines = "".join(f"\n  {u}: {self.last_error[u]}" for u in self.urls)
        return Unreachable(f"rollout servers unreachable: {what}; last error per server:{lines}")

    # ------------------------------------------------------------------ generation
    def generate(self, prompts, n, sampling, seed, desc="rollout", prompt_keys=None, replay=(), partial=False):
        """n samples for each prompt (a list of token ids) -> [prompt][sample] dicts with output_ids, logprobs,
        finish_reason, weight_version, prompt_tokens, completion_tokens, url and attempts (1: the first try answered),
        and the replay fields asked for ("routed_experts", "indexer_topk": replay.py) as int32 tensors, a row a
        position (parse_sample). A group is one request: SGLang's batch form, the prompt n times, each sample with
        its own rid and sampling_seed from (seed, prompt key, sample index) (SGLang's own n > 1 would replace our
        rids and seeds); the key is the prompt's index here unless prompt_keys names it (the trainer passes stream
        positions, so samples do not depend on how prompts were split over DP ranks). One request a group, not one a
        sample: n times fewer HTTP round trips and handler threads, and a server sees the group's shared prompt at
        once. A request that fails 1 + retries times raises, unless partial: then its group's samples are None and
        the others come back (an eval scores what it got and says what it lost; training wants whole groups).
        max_concurrency counts samples.
        A plain function: it runs its own asyncio loop, so it cannot be called from inside a running one."""
        if sampling.get("n", 1) != 1:
            raise ValueError("sampling['n'] must stay 1: pass n to generate() instead")
        params, tag = {**DEFAULT_SAMPLING, **sampling}, f"{desc}-{uuid.uuid4().hex[:8]}"
        keys = prompt_keys if prompt_keys is not None else list(range(len(prompts)))
        asks = {"return_logprob": True, **{REPLAY_FIELDS[f]: True for f in replay}}
        bodies = [{"input_ids": [list(p)] * n, "rid": [f"{tag}-{i}-{j}" for j in range(n)], **asks,
                   "sampling_params": [{**params, "sampling_seed": sample_seed(seed, keys[i], j)} for j in range(n)]}
                  for i, p in enumerate(prompts)]
        if not any(ok for u, ok in self.health().items() if u not in self.stale):
            raise self._unreachable(f"no server passed GET /health, or holds the current weights (stale: "
                                    f"{sorted(self.stale)})")
        return asyncio.run(self._generate_all(bodies, n, desc, partial))

    async def _generate_all(self, bodies, n, desc, partial):
        groups = max(1, self.max_concurrency // n)  # requests in flight
        # to_thread runs on the loop's default executor, whose min(32, cpus + 4) threads would cap concurrency
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(groups))
        limit, bar = asyncio.Semaphore(groups), Progress(len(bodies) * n, desc)

        async def one(body):
            async with limit:
                try:
                    samples = await self._generate_one(body)
                except Unreachable as e:  # a 4xx or a bad answer is a RuntimeError: it always raises
                    if not partial:
                        raise
                    print(f"{desc}: lost request {body['rid'][0]}..: {e}", file=sys.stderr, flush=True)
                    samples = [None] * n
            bar.update(sum(s["completion_tokens"] for s in samples if s), n)
            return samples
        # TODO: on a hard failure the other requests still run to completion before the error surfaces
        return await asyncio.gather(*(one(b) for b in bodies))

    async def _generate_one(self, body):
        for attempt in range(1, 2 + self.retries):
            url = await self._pick()
            self.outstanding[url] += 1
            try:
                status, out = await asyncio.to_thread(self._http, url, "POST", "/generate", body)
            except RETRYABLE as e:  # TODO: after a timeout, /abort_request the rid there before moving on
                status, out = None, f"{type(e).__name__}: {e}"
            finally:
                self.outstanding[url] -= 1
            if status == 200:
                self.fails[url] = 0
                if not isinstance(out, list) or len(out) != len(body["rid"]):
                    raise RuntimeError(f"{url}/generate: a batch of {len(body['rid'])} answered with "
                                       f"{type(out).__name__} {str(out)[:200]}")
                return [{**parse_sample(url, o, body), "attempts": attempt} for o in out]
            if status is not None and status < 500:
                raise RuntimeError(f"{url}/generate: HTTP {status}: {error_message(out)}")
            self._mark_down(url, out if status is None else f"HTTP {status}: {error_message(out)}")
        raise self._unreachable(f"request {body['rid'][0]}.. failed {1 + self.retries} times")

    async def _pick(self):
        """The URL for the next attempt, waiting out the backoffs when every URL is out."""
        while True:
            now = time.monotonic()
            fresh = [u for u in self.urls if u not in self.stale]
            up = [u for u in fresh if self.down_until[u] <= now]
            if up:
                self.turn += 1
                k = self.turn % len(up)
                return min(up[k:] + up[:k], key=self.outstanding.get)  # min keeps the first of equals: turns
            await asyncio.sleep(min(self.down_until[u] for u in fresh) - now)

    # ------------------------------------------------------------------ admin, on every server
    def wait_ready(self, timeout=600.0, server=None):
        """Until every URL passes GET /health (a server loading a big checkpoint takes minutes); RuntimeError
        naming each URL that did not, after `timeout` seconds. server: an EmbeddedServer to give up on at once
        when its process has exited."""
        deadline = time.monotonic() + timeout
        while not all(self.health(timeout=10.0).values()):
            if server is not None and server.exit_code() is not None:
                raise SystemExit(f"error: the embedded rollout server exited with {server.exit_code()}")
            if time.monotonic() > deadline:
                raise self._unreachable(f"not every server ready after {timeout:.0f} s")
            time.sleep(1.0)
        self.ready = True

    def health(self, timeout=30.0):
        """GET /health on every URL -> {url: ok}. A passing URL is back in rotation; a failing one is out for
        a backoff, its error in last_error."""
        errors = {u: fut.result()[1] for u, fut in self.each("/health", method="GET", timeout=timeout).items()}
        for url, err in errors.items():
            if err is None:
                self.fails[url], self.down_until[url] = 0, 0.0
            else:
                self._mark_down(url, err)
        return {u: err is None for u, err in errors.items()}

    def each(self, path, body=None, method="POST", urls=None, timeout=None, bodies=None):
        """The same call on every server (or on those in urls) at once, each in a daemon thread of its own (a call
        stuck on a dead server must not keep the trainer alive) -> {url: Future of (JSON answer or None, error or
        None)}. bodies: {url: its body}, in place of one body for all. No retries, and nothing raises: the caller
        decides what a failure means (weight_sync.py: a sync that failed there; _fanout below: an error)."""
        if urls is None:
            urls = self.urls
        if bodies is None:
            bodies = dict.fromkeys(urls, body)
        return {u: background(self._call, u, method, path, bodies[u], timeout) for u in urls}

    def _fanout(self, method, path, body=None):
        """each(), waited for -> {url: response}. An admin call that failed on one server leaves the servers out of
        step, so it raises, naming every URL that failed and why."""
        results = {u: fut.result() for u, fut in self.each(path, body, method).items()}
        failed = "".join(f"\n  {u}: {err}" for u, (_, err) in results.items() if err)
        if failed:
            raise RuntimeError(f"{method} {path} failed on:{failed}")
        return {u: out for u, (out, _) in results.items()}

    def model_info(self):
        return self._fanout("GET", "/model_info")  # weight_version, model_path, ...

    def begin_weight_update(self):
        return self._fanout("POST", "/begin_weight_update", {})

    def end_weight_update(self):
        return self._fanout("POST", "/end_weight_update", {})

    def update_weights_from_disk(self, path, weight_version=None):
        return self._fanout("POST", "/update_weights_from_disk", {"model_path": path, "weight_version": weight_version})

    def update_weight_version(self, version, abort_all_requests=True):
        return self._fanout("POST", "/update_weight_version",
                            {"new_version": version, "abort_all_requests": abort_all_requests})

    def get_weights_by_name(self, name, truncate_size=100):
        return self._fanout("POST", "/get_weights_by_name", {"name": name, "truncate_size": truncate_size})

    def post_all(self, path, body):
        """Any other POST endpoint on every server, raising on a failure (weight_sync.py calls each() itself: it has
        failure rules of its own)."""
        return self._fanout("POST", path, body)


class LocalClient:
    """RolloutClient.generate over an in-process engine.Engine, with the servers' per-sample seeds: the same samples
    the embedded server would draw from the same weights (train_sft.py's held-out evaluation)."""
    def __init__(self, engine):
        self.engine = engine

    def generate(self, prompts, n, sampling, seed, desc="", prompt_keys=None, partial=False):
        from engine import SamplingParams
        keys = prompt_keys or range(len(prompts))
        params = [SamplingParams(temperature=sampling.get("temperature", 1.0), top_p=sampling.get("top_p", 1.0),
                                 max_new_tokens=sampling["max_new_tokens"], seed=sample_seed(seed, k, j))
                  for k in keys for j in range(n)]
        reqs = self.engine.generate([p for p in prompts for _ in range(n)], params)
        return [[{"output_ids": r.output_ids, "logprobs": r.output_logprobs, "finish_reason": r.finish_reason,
                  "attempts": 1}
                 for r in reqs[i * n:(i + 1) * n]] for i in range(len(prompts))]


class EmbeddedServer:
    """The embedded server (`python server.py`) as a child process on a free local port, for a trainer
    given no SGLang URLs. Killed when the trainer exits, a crash included; it also exits when the trainer is gone
    (--parent-pid)."""
    def __init__(self, model_dir, flags):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url, self.proc = f"http://127.0.0.1:{self.port}", None
        server_py = os.path.join(os.path.dirname(os.path.abspath(__file__)), "server.py")
        self.cmd = [sys.executable, server_py, "--model", model_dir, "--port", str(self.port), "--parent-pid",
                    str(os.getpid()), *flags]
        atexit.register(lambda: self.proc is not None and self.proc.poll() is None and self.proc.kill())

    def start(self, version):
        """(Re)start it from the weights in model_dir, stamping `version` on its samples."""
        print(f"starting the embedded rollout server: {' '.join(self.cmd)} --weight-version {version}", flush=True)
        self.proc = subprocess.Popen(self.cmd + ["--weight-version", version], start_new_session=True)  # a Ctrl-C
        return self  # reaches the trainer only

    def exit_code(self):
        """None while it runs."""
        return self.proc.poll()


# -----------------------------------------------------------------------------

if __name__ == "__main__":
    # Self-check on CPU in seconds: a tiny random model behind the embedded server, started as the trainer starts it
    # (EmbeddedServer: `python server.py`); the client's logprobs equal the training forward's, and the seeds make a
    # rerun draw the same tokens.
    import tempfile
    import torch
    from checkpoint import save_pretrained
    from model_dsv4 import ModelArgs, Transformer
    t0 = time.time()
    model = Transformer(ModelArgs(vocab_size=512, num_hidden_layers=4, compress_ratios=[0, 4, 16, 0],
                                  num_nextn_predict_layers=0, num_hash_layers=1), dtype=torch.float32)
    with tempfile.TemporaryDirectory() as d:
        save_pretrained(model, d)
        srv = EmbeddedServer(d, ["--dtype", "float32", "--device", "cpu", "--max-batch", "16", "--max-len", "256"])
        client = RolloutClient(srv.start("default").url)
        client.wait_ready(timeout=300, server=srv)  # it has read the weights: the directory may go
    prompts = [torch.randint(2, 512, (n,)).tolist() for n in (3, 20, 41)]
    sampling = {"temperature": 0.7, "max_new_tokens": 24}
    groups = client.generate(prompts, n=4, sampling=sampling, seed=0)
    worst = 0.0
    for prompt, group in zip(prompts, groups):
        for s in group:
            ids = torch.tensor(prompt + s["output_ids"])[None]
            with torch.no_grad():
                logits = model(ids)[0, len(prompt) - 1:-1] / sampling["temperature"]
            ref = logits.log_softmax(-1).gather(-1, ids[0, len(prompt):, None])[:, 0]
            worst = max(worst, (ref - torch.tensor(s["logprobs"])).abs().max().item())
    again = client.generate(prompts, n=4, sampling=sampling, seed=0)
    same = [[s["output_ids"] for s in g] for g in groups] == [[s["output_ids"] for s in g] for g in again]
    n_tok = sum(s["completion_tokens"] for g in groups for s in g)
    print(f"{len(prompts)} prompts x 4 samples, {n_tok} tokens from {srv.url}; weight_version "
          f"{groups[0][0]['weight_version']}; server vs forward logprobs max |diff| {worst:.2e}; "
          f"same seeds, same tokens: {same}")
    srv.proc.terminate()
    srv.proc.wait(timeout=30)  # its "stopped" line before the verdict, which stays the last line
    assert worst < 1e-4 and same, "self-check failed"
    print(f"self-check passed in {time.time() - t0:.1f}s")
