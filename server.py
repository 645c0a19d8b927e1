"""
The embedded rollout server: the subset of SGLang's native HTTP API that the trainer uses, with SGLang's
JSON shapes, on the standard library's ThreadingHTTPServer. Generation is
engine.py's: one scheduler thread runs engine.run_forever and batches whatever the handler threads submit.

    python server.py --model out/ckpt --port 30000 --dtype float32 --device cpu
    srv = server.start(model_or_checkpoint_dir, port=0); srv.url; srv.close()     # in-process (trainer, tests)

Weight updates (sessions, disk, process-group and tensor updates, quantized serving): server_weights.py.

Not implemented: text prompts and stop strings (no tokenizer), streaming, input/top logprobs, penalties and
constrained decoding (400 with a message), custom weight loaders (400).
"""
import contextlib
import functools
import hmac
import ipaddress
import json
import math
import os
import select
import signal
import socket
import threading
import time
import traceback
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import torch

import compile_policy
import replay
from engine import Engine, SamplingParams
from kernel_check import choose as choose_kernels
from checkpoint import from_pretrained
from memory_plan import peak_gb
from quant import quant_format, quantize_tensor, scale_name
from server_weights import BadRequest, Weights, check, is_int, read_raw

MAX_BODY = 64 << 20  # bytes; a batch of 64 prompts x 4096 tokens is ~2 MB of JSON
MAX_TENSOR_BODY = 4 << 30  # /update_weights_from_tensor from a client we would answer: CPU tensors travel as base64
MAX_ITEMS = 4096  # sequences one /generate may ask for (prompts x n): more is a 413, not an out-of-memory
# sampling_params keys SGLang knows (api_types._FIELDS_SamplingParams): any other key is a 400, as there
SAMPLING_KEYS = {"max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "stop_regex",
                 "ignore_eos", "n", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
                 "min_new_tokens", "frequency_penalty", "presence_penalty", "repetition_penalty", "sampling_seed",
                 "json_schema", "regex", "ebnf", "structural_tag", "choice", "logit_bias", "stream_interval",
                 "custom_params", "beam_width", "watermark"}
SUPPORTED = {"max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "ignore_eos", "n", "sampling_seed",
             # these shape the detokenized text only, and there is none: accepted, no effect
             "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "stream_interval"}
NEUTRAL = {"repetition_penalty": 1, "beam_width": 1}  # else null, false, 0, "", [] or {} mean "off"
SAMPLING_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "n": 1, "max_new_tokens": 128, "stop_token_ids": [],
                     "ignore_eos": False}  # SGLang's, for a key not given or null
# top-level fields that would ask for something we cannot give; other unknown fields are ignored, as SGLang does
UNSUPPORTED = ["text", "input_embeds", "stream", "top_logprobs_num", "token_ids_logprob", "return_hidden_states",
               "return_sampling_mask", "return_prompt_token_ids", "session_params",
               "session_id", "lora_path", "image_data", "video_data", "audio_data", "custom_logit_processor"]

GET, POST = ("GET",), ("POST",)
ENDPOINTS = {"generate": ("POST", "PUT"), "health": GET, "health_generate": GET, "model_info": GET,
             "flush_cache": ("GET", "POST"), "pause_generation": POST, "continue_generation": POST,
             "abort_request": POST, "begin_weight_update": POST, "end_weight_update": POST,
             "update_weights_from_disk": POST, "init_weights_update_group": POST,
             "update_weights_from_distributed": POST, "destroy_weights_update_group": POST,
             "update_weights_from_tensor": POST, "get_weights_by_name": ("GET", "POST"), "update_weight_version": POST,
             "server_info": GET}
# every endpoint but these changes the served weights or stops generation: a server that listens beyond localhost
# answers them only with --api-key set (403 otherwise), so nobody on the network can swap the model
UNGUARDED = {"generate", "health", "health_generate", "model_info", "get_weights_by_name", "server_info"}
GUARDED = {f"/{name}" for name in ENDPOINTS if name not in UNGUARDED}


def is_num(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def parse_json(raw):
    """A request body -> dict ({} when empty). NaN and Infinity are not JSON, though Python's parser takes them."""
    def not_json(constant):
        raise ValueError(f"{constant} is not JSON")
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw, parse_constant=not_json)
    except (ValueError, RecursionError) as e:
        raise BadRequest(f"malformed JSON: {e}")
    check(isinstance(body, dict), "the request body must be a JSON object")
    return body


class Server:
    """What the handler threads share: the model, the engine and its scheduler thread, the weight-update session
    and process groups. One method per endpoint: (JSON body, handler) -> JSON-able answer (None: an empty body)."""

    def __init__(self, model, model_path="", api_key=None, max_batch=64, max_len=4096, quant="none", record=()):
        self.model, self.model_path, self.api_key, self.max_len = model, model_path, api_key, max_len
        self.engine = Engine(model, max_batch=max_batch, max_len=max_len, record=record)  # record: replay.py's
        self.vocab = self.engine.vocab_size
        self.stop = threading.Event()
        self.loop = threading.Thread(target=self.engine.run_forever, args=(self.stop,), daemon=True, name="scheduler")
        self.admin = threading.Lock()  # one pause / weight update at a time
        self.weights = Weights(model, self.engine, self.admin, quant)  # the weight endpoints (server_weights.py)
        self.rids_lock, self.running_rids = threading.Lock(), set()
        self.local = True  # listening on loopback only (start sets it)
        self.routes = {f"/{name}": (methods, getattr(self, name, None) or getattr(self.weights, name))
                       for name, methods in ENDPOINTS.items()}
        self.routes["/get_model_info"] = self.routes["/model_info"]  # the older name, still in use

    def close(self):
        """Abort what is queued or running (its clients get "abort" answers or a 503), stop the scheduler."""
        self.engine.abort_all()
        self.stop.set()
        self.loop.join(timeout=10)

    # ------------------------------------------------------------------ /generate
    def sampling(self, sp, prompt_len):
        """One sampling_params object -> (engine SamplingParams, n); a 400 names the offending key."""
        check(isinstance(sp, dict), f"sampling_params must be an object, got {sp!r}")
        unknown = sorted(set(sp) - SAMPLING_KEYS)
        check(not unknown, f"sampling_params: unknown key(s) {unknown}")
        for k, v in sp.items():
            check(k in SUPPORTED or v in (None, False, 0, "", [], {}) or v == NEUTRAL.get(k),
                  f"sampling_params.{k}={v!r} is not supported by the embedded server (no tokenizer, no grammar "
                  f"backend, no penalties): send token ids and stop_token_ids")
        given = {k: v for k, v in sp.items() if v is not None}  # null means the default, as in SGLang
        sp = {**SAMPLING_DEFAULTS, **given}
        T = sp["temperature"]
        top_p = sp["top_p"]
        top_k = sp["top_k"]
        n = sp["n"]
        max_new = sp["max_new_tokens"]
        stop = sp["stop_token_ids"]
        seed = sp.get("sampling_seed")
        check(is_num(T) and T >= 0, f"sampling_params.temperature must be a number >= 0, got {T!r}")
        check(is_num(top_p) and 0 < top_p <= 1, f"sampling_params.top_p must be in (0, 1], got {top_p!r}")
        check(is_int(top_k) and (top_k == -1 or top_k >= 1), f"sampling_params.top_k must be -1 or >= 1, got {top_k!r}")
        check(is_int(max_new) and max_new >= 0, f"sampling_params.max_new_tokens must be an int >= 0, got {max_new!r}")
        check(is_int(n) and 1 <= n <= 1024, f"sampling_params.n must be an int in [1, 1024], got {n!r}")
        check(isinstance(stop, list) and all(map(is_int, stop)), "sampling_params.stop_token_ids: a list of ints")
        check(seed is None or is_int(seed) and 0 <= seed < 2 ** 63, f"sampling_params.sampling_seed must be an int "
              f"in [0, 2^63), got {seed!r}")
        check(isinstance(sp["ignore_eos"], bool), "sampling_params.ignore_eos must be a bool")
        check(prompt_len + max_new <= self.max_len, f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new}) "
              f"exceeds the server's max_len ({self.max_len})")
        return SamplingParams(temperature=float(T), top_p=float(top_p), top_k=top_k, max_new_tokens=max_new,
                              stop_token_ids=tuple(stop), ignore_eos=sp["ignore_eos"], seed=seed), n

    def generate(self, body, handler):
        asked = sorted(k for k in UNSUPPORTED if body.get(k) not in (None, False, 0, "", []))
        check(not asked, f"not supported by the embedded server: {asked} (send input_ids; non-streaming; "
              f"output token logprobs only)")
        check(body.get("logprob_start_len", -1) in (-1, None), "logprob_start_len: only -1 (output only) is supported")
        ids = body.get("input_ids")
        batch = isinstance(ids, list) and len(ids) > 0 and all(isinstance(p, list) for p in ids)
        prompts = ids if batch else [ids]
        for p in prompts:
            check(isinstance(p, list) and p and all(is_int(t) and 0 <= t < self.vocab for t in p),
                  f"input_ids must be a non-empty list of token ids in [0, {self.vocab}), or a list of such lists")
        B = len(prompts)
        if B > MAX_ITEMS:
            raise BadRequest(f"{B} prompts in one request: at most {MAX_ITEMS} sequences", 413)
        sps = body.get("sampling_params") or {}
        if not isinstance(sps, list):  # one for every prompt
            sps = [sps] * B
        lps = body.get("return_logprob") or False
        if not isinstance(lps, list):
            lps = [lps] * B
        rids = body.get("rid")
        if rids is None:
            rids = [uuid.uuid4().hex for _ in range(B)]
        elif isinstance(rids, str):  # SGLang expands a batch's str rid to rid_i
            rids = [f"{rids}_{i}" for i in range(B)] if batch else [rids]
        check(len(sps) == B and len(lps) == B and all(isinstance(x, bool) for x in lps),
              f"sampling_params / return_logprob: give one, or a list of {B}")
        check(isinstance(rids, list) and all(isinstance(r, str) for r in rids) and len(set(rids)) == len(rids) == B,
              f"rid: give a string, or a list of {B} distinct strings")
        items = []  # (prompt, params, rid, return_logprob); n > 1 expands prompt-major with fresh rids, as SGLang
        for p, sp, rid, lp in zip(prompts, sps, rids, lps):
            params, n = self.sampling(sp, len(p))
            if len(items) + n > MAX_ITEMS:
                raise BadRequest(f"more than {MAX_ITEMS} sequences (prompts x n) in one request", 413)
            items += [(p, params, rid if n == 1 else uuid.uuid4().hex, lp) for _ in range(n)]
        rids = [rid for _, _, rid, _ in items]
        record, start = replay.asked(body, self.engine.record, items, check)
        with self.rids_lock:  # engine.abort(rid) must not hit someone else's request
            taken = sorted(self.running_rids.intersection(rids))
            check(not taken, f"rid(s) already running: {taken}")
            self.running_rids.update(rids)
        t0, reqs = time.time(), []
        try:
            for p, params, rid, _ in items:
                reqs.append(self.engine.submit(p, params, rid, record) if params.max_new_tokens > 0 else None)
            self.wait(list(filter(None, reqs)), handler)
        except BaseException:  # the client left, or the loop died: free the batch slots
            for r in filter(None, reqs):
                self.engine.abort(r.rid)
            raise
        finally:
            with self.rids_lock:
                self.running_rids.difference_update(rids)
        out = [self.response(rid, req, p, lp, t0, start) for (p, _, rid, lp), req in zip(items, reqs)]
        return out if batch or len(out) > 1 else out[0]

    def wait(self, reqs, handler):
        """Until every request is done, or the client hung up (499: nothing is sent), or the scheduler thread
        died (503 rather than a hang), each looked at every 2 s. Not more often: every waiting handler thread wakes
        to look, and with thousands of requests in flight, waking several times a second, they starve the scheduler
        thread of the GIL (bench/server_load.py measures it)."""
        for req in reqs:
            while not req.done.wait(2.0):
                if not self.loop.is_alive():
                    raise BadRequest("the scheduler loop is not running (see the server log)", 503)
                if handler.client_gone():
                    raise BadRequest("client disconnected", 499)

    def response(self, rid, req, prompt, return_logprob, t0, routed_experts_start_len=0):
        """SGLang's response layout (sglang_api.md §1.3); a max_new_tokens=0 item never reached the engine."""
        ids = list(req.output_ids) if req else []
        mi = {"id": rid, "finish_reason": req.finish_reason if req else {"type": "length", "length": 0},
              "prompt_tokens": len(prompt), "completion_tokens": len(ids), "cached_tokens": 0, "reasoning_tokens": 0,
              "weight_version": req.weight_version if req else self.engine.weight_version, "num_retractions": 0,
              "e2e_latency": round(time.time() - t0, 4)}  # no weight_versions spans: the engine stamps one version
        if return_logprob:
            mi["input_token_logprobs"] = []
            mi["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(req.output_logprobs if req else [], ids)]
            mi["output_token_logprobs_length"] = len(ids)
        return {"output_ids": ids, "meta_info": {**mi, **replay.meta_info(req, routed_experts_start_len)}}

    # ------------------------------------------------------------------ status and control
    def health(self, body, handler):
        if not self.loop.is_alive() or self.stop.is_set():  # starting or shutting down, as SGLang's 503
            raise BadRequest("the scheduler loop is not running", 503)

    def health_generate(self, body, handler):
        rid = f"health-{uuid.uuid4().hex}"
        req = self.engine.submit([0], SamplingParams(max_new_tokens=1), rid)
        if not req.done.wait(20):
            self.engine.abort(rid)
            raise BadRequest("no token within 20 s (paused, or the scheduler is stuck)", 503)

    def model_info(self, body, handler):
        return {"model_path": self.model_path, "served_model_name": self.model_path, "tokenizer_path": None,
                "is_generation": True, "preferred_sampling_params": None, "weight_version": self.engine.weight_version,
                "load_format": "auto", "model_type": "deepseek_v4", "architectures": ["DeepseekV4ForCausalLM"]}

    def server_info(self, body, handler):
        """SGLang's /server_info, as far as the embedded server has it: one rank (tp_size), and in internal_states its
        process's peak memory in GB (memory_plan.peak_gb: tensors, and what it holds from the device), since start."""
        tensors, held = peak_gb(self.engine.device)
        return {"tp_size": 1, "version": "nano-dsv4-rl", "internal_states": [{"peak_memory_gb": [tensors, held]}]}

    def flush_cache(self, body, handler):
        check(self.engine.flush(), "Cache not flushed: requests are running or queued")
        return "Cache flushed.\n"

    def pause_generation(self, body, handler):
        mode = body.get("mode", "abort")
        check(mode in ("abort", "retract", "in_place"), f"mode must be abort, retract or in_place, got {mode!r}")
        with self.admin:
            if mode == "abort":  # let the loop finish the aborted requests (it does not step while paused)
                self.engine.abort_all()
                deadline = time.time() + 10
                while not self.engine.flush() and time.time() < deadline:
                    time.sleep(0.01)
            # retract and in_place alike: requests keep their cache and resume as they were
            self.engine.pause()
        return {"message": "Generation paused successfully.", "status": "ok"}

    def continue_generation(self, body, handler):
        with self.admin:
            self.engine.resume()
        return {"message": "Generation continued successfully.", "status": "ok"}

    def abort_request(self, body, handler):
        if body.get("abort_all"):
            self.engine.abort_all()
        elif isinstance(body.get("rid"), str) and body["rid"]:
            self.engine.abort(body["rid"])


# -----------------------------------------------------------------------------
# HTTP plumbing

class Handler(BaseHTTPRequestHandler):
    """One thread per connection (HTTP/1.0: one request each). Whatever a request does, it gets an answer,
    and the server lives on."""
    timeout = 120  # seconds a client may take to send its request: a stalled upload frees its thread
    default_request_version = "HTTP/1.0"  # so that the answer to a garbled request line has a status line too

    def __getattr__(self, name):  # do_GET, do_POST, any method: dispatch answers 405 or 404, not http.server's 501
        if name.startswith("do_"):
            return functools.partial(self.dispatch, name[3:])
        raise AttributeError(name)

    def log_message(self, *args):  # one line per request would drown the log; errors print their traceback
        pass

    def dispatch(self, method):
        app, path = self.server.app, urlsplit(self.path).path
        try:
            # refused or not, the body is read first: answering early and closing a socket that still holds unread
            # bytes sends a reset, which can destroy the answer before the client reads it
            refused = self.refused(app, path)
            limit = MAX_BODY
            if path == "/update_weights_from_tensor" and not refused:
                limit = MAX_TENSOR_BODY
            raw = self.read_body(limit)
            if refused:
                raise refused
            if path not in app.routes:
                raise BadRequest(f"no endpoint {path}", 404)
            methods, endpoint = app.routes[path]
            if method not in methods:
                raise BadRequest(f"{path} takes {' or '.join(methods)}", 405)
            status, payload = 200, endpoint(parse_json(raw), self)
        except BadRequest as e:
            status, payload = e.status, e.payload or {"error": {"message": str(e)}}
        except RecursionError:  # JSON nested deeper than Python's stack (parsed, then printed in a message)
            status, payload = 400, {"error": {"message": "the request body is nested too deeply"}}
        except Exception as e:  # a bug of ours: say so, keep serving
            traceback.print_exc()
            status, payload = 500, {"error": {"message": f"{type(e).__name__}: {e}"}}
        if status != 499:
            self.reply(status, payload)

    def refused(self, app, path):
        """The 401 / 403 this request gets, or None. As SGLang: health checks are open (probes need no secret),
        everything else needs the key; without one, what changes weights only from localhost."""
        auth = self.headers.get("Authorization", "")
        if app.api_key and not path.startswith("/health") and not (
                auth[:7].lower() == "bearer " and hmac.compare_digest(auth[7:], app.api_key)):
            return BadRequest("Unauthorized", 401, {"error": "Unauthorized"})
        if path in GUARDED and not app.api_key and not app.local:
            return BadRequest(f"{path} is refused: this server listens on {self.server.server_address[0]}, "
                              f"beyond localhost, without --api-key", 403)

    def read_body(self, limit):
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            raise BadRequest("chunked request bodies are not supported: send Content-Length", 411)
        try:
            n = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            raise BadRequest(f"bad Content-Length {self.headers.get('Content-Length')!r}")
        check(n >= 0, f"bad Content-Length {n}")
        if n > limit:  # answered unread, so a big body can cost no memory
            raise BadRequest(f"request body of {n} bytes is over the {limit}-byte limit", 413)
        raw = self.rfile.read(n)
        check(len(raw) == n, "request body cut short")
        return raw

    def reply(self, status, payload):
        if isinstance(payload, str):
            data, ctype = payload.encode(), "text/plain; charset=utf-8"
        else:
            data, ctype = (b"" if payload is None else json.dumps(payload).encode()), "application/json"
        with contextlib.suppress(OSError):  # the client hung up: there is no one to tell
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    def client_gone(self):
        """True once the client has closed its end. A waiting client sends nothing more, so a readable socket
        that reads EOF means it left. poll, not select: select takes no descriptor numbered 1024 or more, and a
        server with a thousand requests in flight holds more sockets than that."""
        try:
            poller = select.poll()
            poller.register(self.connection, select.POLLIN)
            return bool(poller.poll(0)) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True


class HTTPServer(ThreadingHTTPServer):
    request_queue_size = 8192  # the listen backlog (the kernel caps it at net.core.somaxconn): a burst of requests
    # beyond it loses SYNs, and their clients reconnect only after TCP backoffs of 1, 3, 7, 15 s ...
    daemon_threads = True

    @property
    def url(self):
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def close(self):
        """Stop serving (call it from another thread than serve_forever's), then stop the scheduler."""
        self.shutdown()
        self.server_close()
        self.app.close()


def start(model, host="127.0.0.1", port=30000, dtype=torch.bfloat16, device=None, api_key=None, max_batch=64,
          max_len=4096, background=True, quant="none", fp8_emu=False, invariant=False, record=(), kernels="auto",
          compile="off", load_format="auto"):
    """Serve a model_dsv4.Transformer, or a checkpoint directory loaded with from_pretrained. Returns the
    HTTPServer (its .url, .close()), serving from a thread of its own, or not yet with background=False.
    quant 'fp8' / 'fp8_fp4' serves as SGLang serves a block-FP8 checkpoint, W8A8: the weights FP8 (FP4), every
    FP8 linear's input FP8 per token per 128, and V4's KV and indexer rounding (model.set_fp8_emulation).
    fp8_emu: the same activation numerics on unquantized weights. invariant:
    path-invariant numerics on this side (model.set_invariant: every sum in fp64). record: replay.py's to keep."""
    path = model if isinstance(model, str) else ""
    if path:
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        model = from_pretrained(path, device=device, dtype=dtype, weights=load_format != "dummy")
    kernels = choose_kernels(kernels, model.args, next(model.parameters()).device, model.dtype)  # kernel_check.py
    model.set_kernels(kernels).set_invariant(invariant)  # invariant: every sum in fp64, and the reference kernels
    if fp8_emu or quant != "none":
        model.set_fp8_emulation(True)
    httpd = HTTPServer((host, port), Handler)
    httpd.app = app = Server(model, path, api_key, max_batch, max_len, quant, record)
    if compile != "off":  # the caller set compile_policy.use_compile (the cache, dynamo's limits)
        compile_policy.compile_model(model)
        compile_policy.compile_engine(app.engine)
    app.local = ipaddress.ip_address(httpd.server_address[0]).is_loopback
    if not app.local and not api_key:
        print(f"warning: listening on {host} without --api-key: /generate is open to the network, and the "
              f"weight-update and control endpoints answer 403", flush=True)
    w = app.weights
    if w.qformats:  # the quantized state: the checkpoint's own (official format), else quantized here, once
        stored = read_raw(path, w.qformats) if path and load_format != "dummy" else {}
        named = {}
        for k, v in model.state_dict().items():
            if quant_format(k, quant):
                pair = {n: stored[n] for n in (k, scale_name(k)) if n in stored}
                if len(pair) != 2 or pair[k].dtype != w.qformats[k][1]:
                    pair = quantize_tensor(k, v.float(), quant)
                named.update(pair)
        w.load(w.checked(named, every=False), None, flush=False, rebuild=True)
    httpd.app.loop.start()
    if background:
        threading.Thread(target=httpd.serve_forever, daemon=True, name="http").start()
    return httpd


def exit_with(pid):
    """Stop this process (as SIGTERM does) once process `pid` has exited. Our parent's exit shows at once (we
    are re-parented, even while it is an unreaped zombie); any other process's once it is gone."""
    child = os.getppid() == pid
    while True:
        time.sleep(1.0)
        if child and os.getppid() != pid:
            break
        try:
            os.kill(pid, 0)  # signal 0 only asks whether the process exists
        except ProcessLookupError:
            break
        except PermissionError:  # it exists, and belongs to someone else
            pass
    signal.raise_signal(signal.SIGTERM)


def serve(args):
    """`python server.py ...` (the command line below): one ready line with the URL, then serve until Ctrl-C or
    SIGTERM."""
    compile_policy.use_compile(args.compile, args.compile_cache)  # before the engine: its first decode steps compile
    httpd = start(args.model, args.host, args.port, getattr(torch, args.dtype), args.device, args.api_key,
                  args.max_batch, args.max_len, background=False, quant=args.quant, fp8_emu=args.fp8_emu,
                  invariant=args.invariant, record=args.record, kernels=args.kernels, compile=args.compile,
                  load_format=args.load_format)
    httpd.app.engine.weight_version = args.weight_version  # SGLang's --weight-version: what its samples carry
    if args.compile == "layers":  # compile and capture every batch bucket now, not in the first rollout
        t0, done, stop = time.time(), [], threading.Event()

        def tick():  # a line every 10 s: the first buckets compile each layer kind, minutes on a cold cache
            while not stop.wait(10):
                print(f"decode warm-up: {len(done)} batch buckets done in {time.time() - t0:.0f} s", flush=True)
        threading.Thread(target=tick, daemon=True, name="warm-up-progress").start()
        seconds = httpd.app.engine.warm_up(lambda n, total, bucket: done.append(bucket))
        stop.set()
        print(f"decode compiled for every batch bucket in {seconds:.0f} s", flush=True)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM stops as Ctrl-C does
    if args.parent_pid:  # an embedded server outliving its trainer would hold the port and the memory
        threading.Thread(target=exit_with, args=(args.parent_pid,), daemon=True, name="parent-watch").start()
    what = f"model {os.path.abspath(args.model)}, {args.dtype}, quant {args.quant}"
    if args.quant != "none":
        what += " (w8a8: fp8 activations)"
    elif args.fp8_emu:
        what += " + fp8 emulation"
    if args.invariant:
        what += ", invariant"
    if args.compile != "off":
        what += f", compile {args.compile}"
    print(f"rollout server ready at {httpd.url} ({what}, {httpd.app.engine.device}, pid {os.getpid()})", flush=True)
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        httpd.server_close()
        httpd.app.close()
        with contextlib.suppress(OSError):  # whoever read our stdout is gone (the parent that started us, say)
            print("rollout server stopped", flush=True)


# -----------------------------------------------------------------------------

if __name__ == "__main__":
    import argparse
    from rollout import allow_open_files  # the client's limit too: a socket per request in flight
    p = argparse.ArgumentParser(description="The embedded SGLang-compatible rollout server")
    p.add_argument("--model", required=True, help="checkpoint directory (checkpoint.save_pretrained layout)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000, help="0 picks a free port (printed on the ready line)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"], help="dummy: random weights from "
                   "--model's config.json alone, until the first weight update (a trainer's first sync)")
    p.add_argument("--quant", default="none", choices=["none", "fp8", "fp8_fp4"],
                   help="serve from the official FP8 (and FP4 routed experts) tensors, W8A8 as SGLang does")
    p.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: cuda if available")
    p.add_argument("--fp8-emu", action="store_true", help="--quant's activation numerics on unquantized weights")
    p.add_argument("--invariant", action="store_true", help="path-invariant numerics (compare_logprobs --invariant)")
    p.add_argument("--kernels", default="auto", help="auto | fast | reference | path names, comma-separated: the fast "
                   "paths to take (kernel_check.py; auto checks them on this GPU)")
    p.add_argument("--compile", default="off", choices=["off", "layers"],
                   help="torch.compile each layer's prefill and decode step, the head and the sampler (GPU only)")
    p.add_argument("--compile-cache", default="out/compile_cache", help="inductor's and Triton's compile caches "
                   "(TORCHINDUCTOR_CACHE_DIR wins; an embedded server inherits its trainer's)")
    p.add_argument("--enable-return-routed-experts", dest="record", action="append_const", const="routed_experts",
                   default=[], help="record each token's experts, for return_routed_experts (routing replay)")
    p.add_argument("--enable-return-indexer-topk", dest="record", action="append_const", const="indexer_topk",
                   help="record each CSA layer's indexer picks, for return_indexer_topk (indexer replay, replay.py)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--max-len", type=int, default=4096)
    p.add_argument("--weight-version", default="default", help="the version stamped on samples until an update")
    p.add_argument("--parent-pid", type=int, default=None, help="exit when this process (the trainer) is gone")
    args = p.parse_args()
    if args.invariant and args.compile != "off":
        p.error("--invariant runs eager (a Python dispatch mode per op): leave --compile off")
    if args.compile == "layers" and (args.device == "cpu" or not torch.cuda.is_available()):
        p.error("--compile layers needs a GPU: inductor's C++ code for the decode step does not build on the CPU")
    allow_open_files(65536)  # a socket per request in flight
    serve(args)
