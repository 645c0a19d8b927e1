"""Bad input: a few thousand generated hostile HTTP requests against one embedded server (tiny model), then the
access rules; random config keys and values; and the repo never unpickles what it did not write itself."""
import json
import random
import re
import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import server
from model_dsv4 import ModelArgs, Transformer
from server import ENDPOINTS, SAMPLING_KEYS
from helpers.script import run_script

ROOT = Path(__file__).resolve().parents[1]
KEY = "fuzz-key"
ARGS = ModelArgs(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, head_dim=32,
                 qk_rope_head_dim=16, q_lora_rank=16, o_groups=1, o_lora_rank=16, sliding_window=8,
                 compress_ratios=[0, 4], index_n_heads=2, index_head_dim=16, index_topk=2, n_routed_experts=4,
                 num_experts_per_tok=2, moe_intermediate_size=16, num_hash_layers=1, hc_mult=2, hc_sinkhorn_iters=2,
                 num_nextn_predict_layers=0)
N_REQUESTS = 3000


@pytest.fixture(scope="module")
def srv():
    s = server.start(Transformer(ARGS, dtype=torch.float32), port=0, dtype=torch.float32, device="cpu", api_key=KEY,
                     max_batch=16, max_len=48)
    yield s
    s.close()


def good():
    return {"input_ids": [1, 2, 3], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 4, "temperature": 1.0}}


def junk(rng, depth=0):
    """A random JSON value, of any type, sometimes absurd."""
    makers = [lambda: None, lambda: True, lambda: -1, lambda: 0, lambda: 10 ** rng.randrange(1, 40), lambda: -2 ** 63,
              lambda: rng.random() * 1e308, lambda: "", lambda: "\x00ü" * 3, lambda: "a" * rng.randrange(10000),
              lambda: [junk(rng, depth + 1) for _ in range(rng.randrange(4))],
              lambda: {rng.choice(["n", "rid", "input_ids", "mode", "x"]): junk(rng, depth + 1)}]
    return makers[rng.randrange(12 if depth < 3 else 10)]()


def body(rng):
    """(method, path, JSON or bytes, kind): most go to /generate, each a valid request with a few things broken."""
    r = rng.random()
    if r < 0.5:
        b = good()
        for _ in range(rng.randrange(1, 4)):
            where, sp = rng.random(), b["sampling_params"] if isinstance(b.get("sampling_params"), dict) else {}
            if where < 0.3:
                sp[rng.choice(sorted(SAMPLING_KEYS) + ["bogus"])] = junk(rng)
            elif where < 0.5:
                sp["max_new_tokens"] = rng.choice([-1, 0, 47, 10 ** 18, 2 ** 63, "5", 5.5, True, None])
            elif where < 0.7:
                b["input_ids"] = rng.choice([[junk(rng)], [[1]] * rng.choice([3, 5000]), [[1, 2]] * 3, [2 ** 70], [-3],
                                             [[]], list(range(100)), "1 2 3"])
                sp["n"] = rng.choice([1, 2, 5000, 0])
            elif where < 0.85:
                b.pop(rng.choice(list(b)), None)
            else:
                key = rng.choice(["rid", "return_logprob", "sampling_params", "stream", "logprob_start_len", "text"])
                b[key] = junk(rng)
        return "POST", "/generate", b, "generate"
    if r < 0.65:  # any endpoint, a random body; /pause_generation only with a bad mode (a good one stops /generate)
        path = rng.choice([p for p in ENDPOINTS if p not in ("pause_generation", "init_weights_update_group")])
        b = junk(rng) if rng.random() < 0.5 else {k: junk(rng) for k in rng.sample(["name", "model_path", "names",
                                                                                      "new_version", "group_name"], 2)}
        return rng.choice(["POST", "GET"]), f"/{path}", b, "endpoint"
    if r < 0.72:
        return "POST", "/pause_generation", {"mode": rng.choice(["", "stop", 3, None])}, "endpoint"
    if r < 0.82:  # nested deeper than any parser's stack, or just under it
        d = rng.choice([50, 900, 990, 5000, 100000])
        return "POST", "/generate", (b"[" * d + b"]" * d * rng.randrange(2)), "nested"
    if r < 0.92:
        return rng.choice(["DELETE", "HEAD", "OPTIONS", "PATCH", "FOO"]), rng.choice(
            ["/", "/generate", "/../../etc/passwd", "/%00", "/health?x=1", "/" + "a" * 5000]), b"", "method"
    return "POST", "/generate", bytes(rng.randrange(256) for _ in range(rng.randrange(1, 300))), "bytes"


def send(url, method, path, data, headers=None, key=KEY, half_close=False):
    """One request on a raw socket -> the status code, or None when the connection ended without an answer."""
    data = data if isinstance(data, bytes) else json.dumps(data).encode()
    head = {"Content-Length": str(len(data)), **({"Authorization": f"Bearer {key}"} if key else {}), **(headers or {})}
    raw = f"{method} {path} HTTP/1.1\r\n".encode() + b"".join(f"{k}: {v}\r\n".encode() for k, v in head.items())
    host, port = url[7:].split(":")
    with socket.create_connection((host, int(port)), timeout=60) as s:
        try:
            s.sendall(raw + b"\r\n" + data)
            if half_close:  # what a client that stops early looks like
                s.shutdown(socket.SHUT_WR)
            answer = b""
            while chunk := s.recv(65536):
                answer += chunk
        except ConnectionError:  # reset, broken pipe: the server closed without reading everything
            return None
    m = re.match(rb"HTTP/1\.[01] (\d{3})", answer)
    return int(m.group(1)) if m else None


def raw_line(url, line):
    """A request whose first line is garbage."""
    host, port = url[7:].split(":")
    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.sendall(line)
        s.shutdown(socket.SHUT_WR)
        m = re.match(rb"HTTP/1\.[01] (\d{3})", s.recv(65536))
        return int(m.group(1)) if m else None


@pytest.mark.slow
def test_fuzz_http_bodies_headers_and_methods(srv):
    rng, url = random.Random(0), srv.url
    cases = [body(rng) for _ in range(N_REQUESTS)]
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda c: send(url, c[0], c[1], c[2]), cases))
        # headers: a wrong, negative, absurd or missing length, a chunked body, a body cut short, no key
        heads = [({"Content-Length": v}, False) for v in ("abc", "-5", "1e3", "", str(10 ** 30))] + \
                [({"Transfer-Encoding": "chunked"}, False), ({"Content-Length": "500"}, True)]
        got_h = [send(url, "POST", "/generate", b"{}", h, half_close=hc) for h, hc in heads]
        lines = [bytes(rng.randrange(33, 256) for _ in range(rng.randrange(1, 200))) + b"\r\n\r\n" for _ in range(200)]
        got_l = list(pool.map(lambda line: raw_line(url, line), lines))
    bad = [(c[0], c[1], str(c[2])[:200], s) for c, s in zip(cases, got) if s is None or s >= 500]
    assert not bad, f"{len(bad)} of {len(cases)} answered 5xx or not at all, e.g. {bad[:5]}"
    kinds = {k: sorted({s for c, s in zip(cases, got) if c[3] == k}) for k in {c[3] for c in cases}}
    print(kinds)  # which statuses each kind of request met
    assert 200 in kinds["generate"] and 413 in kinds["generate"] and kinds["nested"] == [400]
    assert got_h == [400, 400, 400, 400, 413, 411, 400], got_h
    assert all(s is not None and 400 <= s < 500 for s in got_l), got_l
    # afterwards: still healthy, still generating
    assert send(url, "GET", "/health", b"", key=None) == 200 and send(url, "POST", "/generate", good()) == 200
    assert send(url, "POST", "/generate", good(), key=None) == 401
    assert send(url, "POST", "/generate", good(), key="x") == 401


def test_oversized_bodies_are_refused(srv):
    for n in (server.MAX_BODY + 1, 10 ** 12):  # answered before reading: a reset may beat the answer, never a crash
        assert send(srv.url, "POST", "/generate", b"", {"Content-Length": str(n)}) in (413, None)
    assert send(srv.url, "POST", "/generate", b"[" * (server.MAX_BODY + 1)) in (413, None)
    assert send(srv.url, "POST", "/generate", good()) == 200


def test_beyond_localhost_weight_updates_need_the_key():
    model = Transformer(ARGS, dtype=torch.float32)
    s = server.start(model, port=0, background=False)
    assert s.server_address[0] == "127.0.0.1"  # the default
    s.server_close()
    s.app.close()
    for key in (None, KEY):
        s = server.start(model, host="0.0.0.0", port=0, device="cpu", api_key=key, max_len=48)
        url = f"http://127.0.0.1:{s.server_address[1]}"
        try:
            for path in ["/update_weight_version", "/pause_generation", "/update_weights_from_disk",
                         "/begin_weight_update", "/update_weights_from_tensor"]:  # refused before the body is parsed
                assert send(url, "POST", path, {"new_version": "evil"}, key=None) == (403 if key is None else 401), path
            assert send(url, "POST", "/generate", good(), key=key) == 200 and send(url, "GET", "/health", b"") == 200
            status = send(url, "POST", "/update_weight_version", {"new_version": "v"}, key=key)
            assert status == (403 if key is None else 200)
        finally:
            s.close()


def test_config_fuzz_is_a_usage_error_naming_the_key(monkeypatch):
    from test_configurator import DEFAULTS, run
    rng = random.Random(0)
    for _ in range(1000):
        key = rng.choice(list(DEFAULTS))
        key = key if rng.random() < 0.5 else key[:-1] if rng.random() < 0.5 else key + rng.choice("s_x")
        text = rng.choice(["1", "-3", "2.5", "1e999", "True", "None", "'x'", "[1,", "(1, 2)", "__import__('os')",
                           "", "{}", "bfloat16", "ü" * 50])
        try:
            ns = run(monkeypatch, f"--{key}={text}")
        except ValueError as e:
            assert f"'{key}'" in str(e), e
            if key not in DEFAULTS:
                assert "did you mean" in str(e) or "--help" in str(e)
            continue
        assert key in DEFAULTS and (DEFAULTS[key] is None or type(ns[key]) is type(DEFAULTS[key]))
    with pytest.raises(ValueError, match="config file config/nope.py: FileNotFoundError"):
        run(monkeypatch, "config/nope.py")


@pytest.mark.parametrize("args,expect", [(["--max_step=3"], "unknown config key 'max_step'.*did you mean max_steps"),
                                         (["--weight_sync=tensr"],
                                          "weight_sync='tensr': choose one of disk, distributed, tensor"),
                                         (["--n_microbatches=0"], "n_microbatches=0: must be positive"),
                                         (["--rollout_max_batch=-3"], "rollout_max_batch=-3: must be positive"),
                                         (["--max_steps=-1"], "max_steps=-1: must be at least 0")])
def test_train_grpo_exits_2_on_bad_config(args, expect):
    code, _, err = run_script("train_grpo.py", *args)  # in this process: the check comes before anything is built
    assert code == 2 and re.search(expect, err), err[-2000:]


def test_nothing_unpickles_foreign_bytes():
    """torch.load only with weights_only=True; no pickle loads; pickle only in tensor_payload.py (its allow-list)."""
    for path in [*ROOT.glob("*.py"), *ROOT.glob("tests/**/*.py")]:
        text = path.read_text()
        allowed = ("tensor_payload.py", "test_tensor_sync.py", "test_flattened_bucket.py")  # the tests build payloads
        assert not re.search(r"\b(pickle|ForkingPickler)\.(loads?|Unpickler)\(", text) and (
            path.name in allowed or not re.search(r"^\s*(import|from) pickle", text, re.M)), path
        for call in re.findall(r"torch\.load\([^\n]*", text):
            assert "weights_only=True" in call or path.name == "test_bad_input.py", (path, call)
