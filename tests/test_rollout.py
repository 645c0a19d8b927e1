"""The embedded server against SGLang's protocol and the training forward; the client's failover."""
import http.client
import json
import os
import socket
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
import torch.distributed as dist

from conftest import randomize_
from checkpoint import from_pretrained, save_pretrained
from model_dsv4 import ModelArgs, Transformer
from parallel import init_weight_update_group
import rollout
from rollout import RolloutClient

KEY = "test-key"
ARGS = ModelArgs(vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=2, head_dim=32,
                 qk_rope_head_dim=16, q_lora_rank=32, o_groups=1, o_lora_rank=32, sliding_window=8,
                 compress_ratios=[0, 4, 8], index_n_heads=2, index_head_dim=32, index_topk=4, n_routed_experts=4,
                 num_experts_per_tok=2, moe_intermediate_size=32, num_hash_layers=1, hc_mult=2, hc_sinkhorn_iters=3,
                 num_nextn_predict_layers=0)
PROMPTS = [[5, 9, 2], list(range(10, 31)), [7] * 40]  # shorter than a compression window, longer than the window


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Two checkpoints of the same shape with different (non-trivial) weights."""
    paths = [str(tmp_path_factory.mktemp(f"ckpt{seed}")) for seed in (0, 1)]
    for seed, path in enumerate(paths):
        save_pretrained(randomize_(Transformer(ARGS, dtype=torch.float32), 4, 2, seed), path)
    return paths


@pytest.fixture(scope="module")
def url(ckpts):
    proc = subprocess.Popen([sys.executable, "server.py", "--model", ckpts[0], "--port", "0", "--dtype",
                             "float32", "--device", "cpu", "--max-batch", "16", "--max-len", "128", "--api-key", KEY],
                            cwd=os.path.join(os.path.dirname(__file__), ".."), stdout=subprocess.PIPE, text=True)
    line = next((l for l in proc.stdout if "ready at http://" in l), "")  # model loaded, port bound
    assert line, "the server did not start (its stderr is above)"
    yield line.split("ready at ")[1].split()[0]
    proc.terminate()  # SIGTERM
    assert proc.wait(timeout=15) == 0  # SIGTERM stops cleanly


def call(url, path, body=None, method="POST", key=KEY):  # -> (status, JSON or text)
    conn = http.client.HTTPConnection(*url.removeprefix("http://").split(":"), timeout=60)
    data = body if isinstance(body, bytes) or body is None else json.dumps(body)
    conn.request(method, path, data, {"Authorization": f"Bearer {key}"} if key else {})
    raw = (resp := conn.getresponse()).read()
    return resp.status, json.loads(raw) if raw[:1] in (b"{", b"[") else raw.decode()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gen_body(prompt, seed, max_new=12, T=0.8, **extra):
    return {"input_ids": prompt, "return_logprob": True, "sampling_params": {
        "temperature": T, "max_new_tokens": max_new, "ignore_eos": True, "sampling_seed": seed}, **extra}


def close(a, b):
    """Two /generate answers: the same tokens, logprobs equal to fp32 rounding."""
    pairs = zip(a["meta_info"]["output_token_logprobs"], b["meta_info"]["output_token_logprobs"])
    return a["output_ids"] == b["output_ids"] and all(abs(x[0] - y[0]) <= 1e-5 for x, y in pairs)


@torch.no_grad()
def forward_logprobs(model, prompt, output, T):
    """What the trainer computes: log_softmax(logits / T) at the output tokens (T = 1 when greedy)."""
    ids = torch.tensor(prompt + output)[None]
    logits = model(ids)[0, len(prompt) - 1:-1] / (T if T > 0 else 1.0)
    return logits.log_softmax(-1).gather(-1, ids[0, len(prompt):, None])[:, 0]


def test_generate_response_layout(url):
    status, out = call(url, "/generate", gen_body(PROMPTS[0], 1, rid="r1"))
    mi = out["meta_info"]
    assert status == 200 and mi["id"] == "r1" and mi["finish_reason"] == {"type": "length", "length": 12}
    assert (mi["prompt_tokens"], mi["completion_tokens"], mi["output_token_logprobs_length"]) == (3, 12, 12)
    assert mi["cached_tokens"] == 0 and mi["weight_version"] == "default" and len(out["output_ids"]) == 12
    assert all(isinstance(lp, float) and t == o and text is None
               for (lp, t, text), o in zip(mi["output_token_logprobs"], out["output_ids"]))
    status, out = call(url, "/generate", {**gen_body(PROMPTS[:2], 1), "rid": "b"})  # a batch: a JSON list
    assert status == 200 and [o["meta_info"]["id"] for o in out] == ["b_0", "b_1"]
    status, info = call(url, "/server_info", method="GET")  # SGLang's tp_size, and the process's peak memory in GB
    tensors, held = info["internal_states"][0]["peak_memory_gb"]
    assert status == 200 and info["tp_size"] == 1 and 0.05 < tensors <= held < 64, info


@pytest.mark.parametrize("T", [0.7, 0.0], ids=["sampled", "greedy"])
def test_logprobs_equal_training_forward(url, ckpts, T):
    model = from_pretrained(ckpts[0], dtype=torch.float32)
    groups = RolloutClient(url, api_key=KEY).generate(PROMPTS, 2, {"temperature": T, "max_new_tokens": 20}, seed=3)
    for prompt, group in zip(PROMPTS, groups):
        for s in group:
            assert s["url"] == url and s["weight_version"] == "default" and len(s["logprobs"]) == s["completion_tokens"]
            diff = (forward_logprobs(model, prompt, s["output_ids"], T) - torch.tensor(s["logprobs"])).abs().max()
            assert diff <= 1e-5, f"server vs training forward: {diff:.2e}"


@pytest.mark.slow
def test_concurrent_requests_equal_one_by_one(url):
    bodies = [gen_body(PROMPTS[i % 3], seed=i, max_new=16) for i in range(8)]
    alone = [call(url, "/generate", b)[1] for b in bodies]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda b: call(url, "/generate", b)[1], bodies))
    assert all(close(a, b) for a, b in zip(alone, together))


def test_bad_requests_then_still_serving(url):
    ok = gen_body(PROMPTS[0], 0, max_new=4)
    with_sp = lambda **kv: {**ok, "sampling_params": {**ok["sampling_params"], **kv}}
    bad = [b"{not json", b"[1, 2]", b'{"input_ids": [1], "x": NaN}', with_sp(bogus=1),  # unknown key: 400, as SGLang
           with_sp(json_schema="{}"), with_sp(stop=["</s>"]), with_sp(temperature="hot"), with_sp(top_p=0),
           with_sp(max_new_tokens=200), {**ok, "input_ids": [1, 256]}, {**ok, "input_ids": [-1]},  # 200: > max_len
           {**ok, "input_ids": []}, {**ok, "input_ids": [1.5]}, {"text": "hello"}, {**ok, "stream": True}]
    for body in bad:
        status, out = call(url, "/generate", body)
        assert status == 400 and out["error"]["message"], (body, status, out)
    assert call(url, "/generate", ok, key=None)[0] == 401 and call(url, "/generate", ok, key="wrong")[0] == 401
    assert call(url, "/health", method="GET", key=None)[0] == 200  # probes need no key, as in SGLang
    assert call(url, "/generate", method="GET")[0] == 405 and call(url, "/nope")[0] == 404
    head = b"POST /generate HTTP/1.0\r\nAuthorization: Bearer %s\r\nContent-Length: %d\r\n\r\n"
    with socket.create_connection(url[7:].split(":")) as s:  # a huge body is refused before it is read
        s.sendall(head % (KEY.encode(), 10 ** 10))
        assert s.recv(16).startswith(b"HTTP/1.0 413")
    assert "begin_weight_update" in call(url, "/update_weights_from_distributed", {})[1]["message"]  # no session
    assert [call(url, f"/{x}_weight_update", {})[0] for x in ("end", "begin", "begin", "end")] == [400, 200, 400, 200]
    body = json.dumps(gen_body(PROMPTS[2], 0, max_new=80)).encode()
    with socket.create_connection(url[7:].split(":")) as s:  # a client that leaves mid-request
        s.sendall(head % (KEY.encode(), len(body)) + body)
    status, out = call(url, "/generate", ok)
    assert status == 200 and len(out["output_ids"]) == 4


def test_weight_version_and_updates(url, ckpts):
    client = RolloutClient(url, api_key=KEY)
    body = gen_body(PROMPTS[1], 5, max_new=8, T=0.0)
    before = call(url, "/generate", body)[1]
    assert client.update_weight_version("step-1")[url]["new_version"] == "step-1"
    info = client.model_info()[url]
    assert info["weight_version"] == "step-1" and info["is_generation"] and info["model_path"] == ckpts[0]
    assert call(url, "/generate", body)[1]["meta_info"]["weight_version"] == "step-1"
    status, out = call(url, "/update_weights_from_disk", {"model_path": "/no/such/dir", "weight_version": "x"})
    assert status == 400 and out["success"] is False and close(call(url, "/generate", body)[1], before)  # unchanged
    row = client.get_weights_by_name("embed.weight", 2)[url]
    assert len(row) == 2 and len(row[0]) == ARGS.hidden_size  # 2 rows of a 2-D tensor
    client.update_weights_from_disk(ckpts[1], weight_version="step-2")
    after, new_row = call(url, "/generate", body)[1], client.get_weights_by_name("embed.weight", 2)[url]
    assert after["meta_info"]["weight_version"] == "step-2" and new_row != row
    ref = forward_logprobs(from_pretrained(ckpts[1], dtype=torch.float32), PROMPTS[1], after["output_ids"], 0.0)
    assert (ref - torch.tensor([e[0] for e in after["meta_info"]["output_token_logprobs"]])).abs().max() <= 1e-5
    # sglang_api.md §2.2, with this process as the trainer: rank 0 of a gloo group, sending one tensor
    port, pool = free_port(), ThreadPoolExecutor(1)
    joined = pool.submit(client.post_all, "/init_weights_update_group", {  # blocks until rank 0 joins too
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2, "backend": "gloo"})
    group = init_weight_update_group("127.0.0.1", port, 0, 2, "weight_update_group", "gloo")
    joined.result()
    client.begin_weight_update()
    new = torch.full((ARGS.vocab_size, ARGS.hidden_size), 0.25)
    sent = pool.submit(client.post_all, "/update_weights_from_distributed", {
        "names": ["embed.weight"], "dtypes": ["float32"], "shapes": [list(new.shape)], "weight_version": "step-3"})
    dist.broadcast(new, src=0, group=group)
    sent.result()
    client.end_weight_update()
    assert client.get_weights_by_name("embed.weight", 1)[url] == [[0.25] * ARGS.hidden_size] and \
        client.model_info()[url]["weight_version"] == "step-3"
    client.post_all("/destroy_weights_update_group", {"group_name": "weight_update_group"})
    dist.destroy_process_group(group)
    client.update_weights_from_disk(ckpts[0], weight_version="default")  # back, for the other tests


class Flaky(BaseHTTPRequestHandler):
    """Healthy to /health, 503 to /generate: a server that fails only under load."""
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_error(503)


def test_client_failover(url):
    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]  # nothing listens there
    flaky = ThreadingHTTPServer(("127.0.0.1", 0), Flaky)
    threading.Thread(target=flaky.serve_forever, daemon=True).start()
    flaky_url = "http://%s:%d" % flaky.server_address
    client = RolloutClient([dead[0], flaky_url, url], api_key=KEY, backoff=0.05)
    groups = client.generate(PROMPTS, n=3, sampling={"max_new_tokens": 6}, seed=0)
    flaky.shutdown()
    assert [len(g) for g in groups] == [3, 3, 3] and all(s["url"] == url for g in groups for s in g)
    assert "Connection refused" in client.last_error[dead[0]] and "HTTP 503" in client.last_error[flaky_url]
    with pytest.raises(RuntimeError, match="unreachable") as err:
        RolloutClient(dead, backoff=0.05).generate(PROMPTS, n=1, sampling={}, seed=0)
    assert all(u in str(err.value) for u in dead)


def test_progress_in_a_log_prints_a_line_every_period(capsys, monkeypatch):
    """Not a terminal: a phase longer than the period prints a line with the rate every period and one at its end; a
    shorter one prints nothing (a log file keeps one line per step)."""
    clock = iter([0.0, 4.0, 11.0, 15.0, 23.0, 25.0])  # the constructor, then one reading per update
    monkeypatch.setattr(rollout.time, "time", lambda: next(clock))
    bar = rollout.Progress(5, "step 3 rollout")
    for _ in range(5):
        bar.update(100)
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["step 3 rollout: 2/5 | 200 tokens | 18 tok/s | 11.0s",
                     "step 3 rollout: 4/5 | 400 tokens | 17 tok/s | 23.0s",
                     "step 3 rollout: 5/5 | 500 tokens | 20 tok/s | 25.0s"], lines
    clock = iter([0.0, 1.0, 2.0])
    short = rollout.Progress(2, "eval")
    short.update(5), short.update(5)
    assert capsys.readouterr().err == ""
