"""The embedded server under load: more /generate requests in flight than select() can watch (a descriptor numbered
1024 or more), as an eval of 1,600 samples against rollout_max_batch 1024 has. Each is answered 200 with a whole
sample at the first try, and the server's log holds no traceback. bench/server_load.py times 4,000."""
import json
import os
import resource
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from checkpoint import save_pretrained
from conftest import randomize_
from model_dsv4 import ModelArgs, Transformer
from eval_aime import evaluate, summary
from rollout import RolloutClient, Unreachable
from tasks import ByteTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = ModelArgs(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, head_dim=32,
                 qk_rope_head_dim=16, q_lora_rank=32, o_groups=1, o_lora_rank=32, sliding_window=8,
                 compress_ratios=[0, 4], index_n_heads=2, index_head_dim=32, index_topk=4, n_routed_experts=4,
                 num_experts_per_tok=2, moe_intermediate_size=32, num_hash_layers=1, hc_mult=2, hc_sinkhorn_iters=3,
                 num_nextn_predict_layers=0)


def post(url, path, body):
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200


@pytest.mark.slow
def test_1500_requests_in_flight_each_answered_whole(tmp_path):
    save_pretrained(randomize_(Transformer(ARGS, dtype=torch.float32), 4, 2, 0), str(tmp_path))
    log = open(tmp_path / "server.log", "w+")
    proc = subprocess.Popen([sys.executable, "server.py", "--model", str(tmp_path), "--port", "0",
                             "--dtype", "float32", "--device", "cpu", "--max-batch", "32", "--max-len", "64"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        url = next(line for line in proc.stdout if "ready at" in line).split("ready at ")[1].split()[0]
        peak, done = [0], threading.Event()

        def count_descriptors():  # the server's open files, sampled: the test must reach past 1023
            while not done.wait(0.05):
                peak[0] = max(peak[0], len(os.listdir(f"/proc/{proc.pid}/fd")))
        threading.Thread(target=count_descriptors, daemon=True).start()
        prompts = [[5, 9, 2 + i % 50] for i in range(1500)]
        # paused while they arrive, so that all 1,500 sockets are open together however fast the box drains them
        post(url, "/pause_generation", {"mode": "in_place"})
        out = {}
        sender = threading.Thread(target=lambda: out.update(groups=RolloutClient(url, max_concurrency=1500).generate(
            prompts, 1, {"max_new_tokens": 8, "ignore_eos": True}, seed=0)))
        sender.start()
        deadline = time.time() + 120
        while peak[0] < 1500 and time.time() < deadline:
            time.sleep(0.1)
        post(url, "/continue_generation", {})
        sender.join()
        groups = out["groups"]
        done.set()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    samples = [s for g in groups for s in g]
    assert len(samples) == 1500 and all(s["completion_tokens"] == 8 == len(s["output_ids"]) for s in samples)
    assert all(s["attempts"] == 1 for s in samples), sum(s["attempts"] > 1 for s in samples)
    log.seek(0)
    assert "Traceback" not in log.read() and peak[0] > 1024, peak[0]


def test_the_client_raises_a_low_open_files_limit():
    """A soft limit of 1,024 (many systems' default) would fail the 1,025th request in flight with EMFILE."""
    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] <= 1024:
        pytest.skip("the hard limit on open files is 1,024 here: nothing to raise it to")
    code = ("import resource as r; r.setrlimit(r.RLIMIT_NOFILE, (1024, r.getrlimit(r.RLIMIT_NOFILE)[1])); "
            "from rollout import RolloutClient; RolloutClient('http://127.0.0.1:1', max_concurrency=2000); "
            "print(r.getrlimit(r.RLIMIT_NOFILE)[0])")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert int(out) >= min(3024, resource.getrlimit(resource.RLIMIT_NOFILE)[1]) > 1024, out


class Flaky(BaseHTTPRequestHandler):
    """/generate answers one token, except: a 503 every time for problem 1's requests, a 503 the first time for
    problem 2's (rids are {tag}-{problem}-{sample}). /health passes."""
    seen = set()

    def log_message(self, *a):
        pass

    def answer(self, status, body=b""):
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self.answer(200)

    def do_POST(self):  # a group a request: SGLang's batch form, a rid a sample
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        problem, first = body["rid"][0].split("-")[-2], body["rid"][0] not in self.seen
        self.seen.add(body["rid"][0])
        if problem == "1" or problem == "2" and first:
            return self.answer(503)
        self.answer(200, json.dumps([{"output_ids": [7], "meta_info": {
            "id": rid, "finish_reason": {"type": "length"}, "prompt_tokens": len(ids), "completion_tokens": 1,
            "weight_version": "0", "output_token_logprobs": [[-0.5, 7, None]]}}
            for rid, ids in zip(body["rid"], body["input_ids"])]).encode())


def test_a_failed_request_is_counted_never_silent(capsys):
    """Requests the servers fail after the client's retries: a rollout raises; an eval scores the problems whose
    samples all came back and says in its record and its line how many requests it lost and how many it retried."""
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Flaky)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    client = RolloutClient("http://%s:%d" % srv.server_address, retries=1, backoff=0.01)
    with pytest.raises(Unreachable):
        client.generate([[1, 2]] * 3, 4, {}, seed=0)
    problems = [{"id": str(i), "prompt": f"{i}=", "answer": "4"} for i in range(3)]
    res = evaluate(client, ByteTokenizer(), problems, 4, {"max_new_tokens": 1}, chat=False)
    srv.shutdown()
    assert (res["failed_requests"], res["retried_requests"], res["n_problems"]) == (4, 4, 2), res
    assert [q["id"] for q in res["per_problem"]] == ["0", "2"]
    assert "4 requests retried | 4 requests FAILED" in summary(res) and "lost request" in capsys.readouterr().err
