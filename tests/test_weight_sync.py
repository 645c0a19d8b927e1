"""Weight sync (weight_sync.py) into running embedded servers (subprocesses): logprobs after a step and a sync,
PP2 x EP2 senders of every transport (tests/helpers/sync_run.py), FP8 / FP4 serving in the official format, a server
killed mid-sync. The tensor transport's own tests: test_tensor_sync.py."""
import copy
import glob
import json
import os
import subprocess
import sys
from collections import Counter

import pytest
import torch

import parallel
import weight_sync as wsync
from conftest import randomize_, start_servers, stop
from checkpoint import save_pretrained
from model_dsv4 import ModelArgs, Transformer
from helpers.parallel_run import ARGS as RUN_ARGS
from quant import quant_format, quantize_tensor, quantized_meta
from rollout import RolloutClient

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
ARGS = ModelArgs(**RUN_ARGS)  # window, CSA and HCA layers, 2 hash layers, 8 experts, an MTP layer
GRID = parallel.init_distributed()  # the trainer of most tests: one process
PROMPTS = [[5, 9, 2], list(range(10, 31)), [7] * 40]
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # the servers and ranks run with one thread too


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ckpt"))
    save_pretrained(randomize_(Transformer(copy.deepcopy(ARGS), dtype=torch.float32), 8, 2, seed=0), path)
    return path


@pytest.fixture(scope="module")
def servers(ckpt):
    servers = start_servers(ckpt, n=2)
    yield servers  # test_server_killed_mid_sync replaces the second one
    stop(servers)


@pytest.fixture(params=["fp8", "fp8_fp4"])
def quant_server(request, ckpt):
    servers = start_servers(ckpt, quant=request.param)  # from a full-precision checkpoint: quantized at startup
    yield request.param, servers[0][1]
    stop(servers)


def trained(step_seed):
    """The servers' starting weights (seed 0) after one AdamW step on a batch of its own."""
    model = randomize_(Transformer(copy.deepcopy(ARGS), dtype=torch.float32), 8, 2, seed=0)
    ids = torch.randint(0, ARGS.vocab_size, (4, 48), generator=torch.Generator().manual_seed(step_seed))
    torch.nn.functional.cross_entropy(model(ids)[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
    torch.optim.AdamW(model.parameters(), lr=1e-2).step()
    return model


def logprob_diff(url, model, version=None):
    """Greedy samples from the server; max |server logprob - the model's forward logprob| over their tokens."""
    worst, groups = 0.0, RolloutClient(url).generate(PROMPTS, 1, {"temperature": 0, "max_new_tokens": 6}, 0)
    for prompt, (s,) in zip(PROMPTS, groups):
        assert version is None or s["weight_version"] == version
        ids = torch.tensor(prompt + s["output_ids"])[None]
        with torch.no_grad():
            ref = model(ids)[0, len(prompt) - 1:-1].log_softmax(-1).gather(-1, ids[0, len(prompt):, None])[:, 0]
        worst = max(worst, (ref - torch.tensor(s["logprobs"])).abs().max().item())
    return worst


@pytest.mark.parametrize("mode,flatten", [("disk", False), ("distributed", True), ("distributed", False)])
def test_step_then_sync_logprobs_equal(mode, flatten, servers, tmp_path):
    """flatten: one broadcast per bucket (load_format "flattened_bucket") or one per tensor."""
    model = trained(step_seed=len(mode) + flatten)
    urls = [u for _, u in servers]
    assert logprob_diff(urls[0], model) > 1e-3  # the servers do not hold these weights yet
    stats = wsync.sync(model, GRID, RolloutClient(urls), ARGS, tmp_path / "w", mode=mode, version=f"{mode}-1",
                       bucket_mb=0.25, verify=True, flatten=flatten)
    sd = model.state_dict()  # every tensor is sent, each once
    assert sorted(stats["names"]) == sorted(sd) and stats["bytes"] == sum(v.nbytes for v in sd.values())
    assert mode == "disk" or stats["buckets"] > 2 and stats["max_bucket_bytes"] <= 1 << 18
    diffs = [logprob_diff(u, model, f"{mode}-1") for u in urls]
    print(f"{mode}: {stats['bytes'] / 1e6:.1f} MB in {stats['seconds']:.2f} s; server vs trainer logprobs "
          f"max |diff| {max(diffs):.1e}")
    assert max(diffs) <= 1e-5


@pytest.mark.slow
def test_pp2_ep2_send_every_tensor_once_and_servers_equal(servers, tmp_path):
    urls = [u for _, u in servers]
    # under torchrun, as the trainer runs: its agent store must not capture the weight-update group's rendezvous
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
                        "tests/helpers/sync_run.py", str(tmp_path), "2", "2", ",".join(urls)], cwd=ROOT,
                       capture_output=True, text=True, timeout=180, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    sent = [json.load(open(f)) for f in glob.glob(f"{tmp_path}/sent.rank*.json")]
    full = parallel.build_stage(ARGS, GRID, dtype=torch.float32, seed=7).state_dict()  # what the 4 ranks hold
    for mode in ("disk", "tensor", "distributed"):
        assert Counter(n for s in sent for n in s[mode]) == Counter(list(full)), mode
    for name, want in full.items():  # both servers hold exactly the trainer's tensors
        got = RolloutClient(urls).get_weights_by_name(name, truncate_size=1 << 30)
        assert all(torch.equal(torch.tensor(got[u]), want.float()) for u in urls), name


def spec_dequant(q, s):
    """The official codec's rules written out: e8m0 byte b means 2^(b-127); FP8 has one scale per 128x128 block;
    FP4 packs element 2j in the low nibble of byte j, element 2j+1 in the high one, one scale per 32 inputs."""
    scale = 2.0 ** (s.view(torch.uint8).double() - 127)
    if q.dtype == torch.float8_e4m3fn:
        return q.double() * scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:q.shape[0], :q.shape[1]]
    b, table = q.view(torch.uint8).long(), [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    return torch.tensor(table, dtype=torch.double)[torch.stack([b & 15, b >> 4], -1).flatten(1)] * \
        scale.repeat_interleave(32, 1)


def test_quant_table_follows_the_spec():
    """§4.5: which tensors are FP8 / FP4 (attn.wkv is, the compressors' wkv are not); §4.2: V4-Flash wire shapes."""
    fp8 = "layers.2.attn.wq_a.weight layers.2.attn.wkv.weight layers.2.attn.wo_a.weight mtp.0.h_proj.weight " \
          "layers.2.attn.indexer.wq_b.weight layers.1.ffn.shared_experts.w2.weight"
    plain = "embed.weight head.weight layers.2.attn.compressor.wkv.weight layers.2.attn.indexer.weights_proj.weight " \
            "layers.2.attn.indexer.compressor.wgate.weight layers.0.ffn.gate.weight layers.0.attn_norm.weight " \
            "layers.0.hc_attn_fn layers.0.ffn.gate.tid2eid layers.3.ffn.gate.bias"
    for m in ("fp8", "fp8_fp4"):
        assert {quant_format(n, m) for n in fp8.split()} == {"fp8"}
        assert {quant_format(n, m) for n in plain.split()} == {None}
    routed = "mtp.0.ffn.experts.5.w3.weight"
    assert [quant_format(routed, m) for m in ("none", "fp8", "fp8_fp4")] == [None, "fp8", "fp4"]
    w1, e8m0 = "layers.3.ffn.experts.0.w1.", torch.float8_e8m0fnu
    assert quantized_meta(w1 + "weight", (2048, 4096), torch.bfloat16, "fp8_fp4") == [
        (w1 + "weight", (2048, 2048), torch.int8), (w1 + "scale", (2048, 128), e8m0)]
    assert quantized_meta("layers.3.attn.wq_b.weight", (32768, 1024), torch.bfloat16, "fp8")[1][1:] == ((256, 8), e8m0)


@pytest.mark.slow
def test_quantized_serving(quant_server, tmp_path):
    (quant, url), model = quant_server, trained(step_seed=3)
    client = RolloutClient(url)
    with pytest.raises(wsync.SyncError, match=f"serves {quant}: send quant.py's format"):  # not silently cast
        wsync.sync(model, GRID, client, ARGS, tmp_path / "plain", mode="disk", quant="none")
    for mode in ("distributed", "disk"):
        wsync.sync(model, GRID, client, ARGS, tmp_path / "w", mode=mode, version=f"{mode}-q", quant=quant,
                   bucket_mb=0.25, verify=True)  # verify: the first rows of every tensor, as sent
        ref = copy.deepcopy(model)  # the trainer's weights through the spec's dequantisation, FP8 activations: W8A8
        ref.load_state_dict({n: spec_dequant(*quantize_tensor(n, t, quant).values()) if quant_format(n, quant) else t
                             for n, t in ref.state_dict().items()})
        exact, vs_trainer = logprob_diff(url, ref.set_fp8_emulation(True), f"{mode}-q"), logprob_diff(url, model)
        w8a16 = logprob_diff(url, ref.set_fp8_emulation(False))  # the server does round its activations
        print(f"{quant} ({mode}): server vs dequantised trainer {exact:.1e} (W8A16: {w8a16:.1e}), vs the "
              f"full-precision trainer {vs_trainer:.1e} (max |diff| of logprobs)")
        assert exact <= 1e-5 and 1e-5 < vs_trainer < {"fp8": 1.0, "fp8_fp4": 3.0}[quant] and w8a16 > 1e-5
        if quant == "fp8":  # train_quant='fp8' computes from full-precision weights what the server does
            assert logprob_diff(url, copy.deepcopy(model).set_fp8_training(True)) <= 1e-5
        model = trained(step_seed=4)  # the disk sync sends other weights
    w = "layers.3.ffn.experts.6.w2.weight"  # what the server stores is quant.py's output, whole
    q, s = quantize_tensor(w, model.state_dict()[w], quant).values()
    got = client.get_weights_by_name(w, 1 << 30)[url], client.get_weights_by_name(w[:-6] + "scale", 1 << 30)[url]
    assert torch.equal(torch.tensor(got[0]), q.float())
    assert torch.equal(torch.tensor(got[1], dtype=torch.double), 2.0 ** (s.view(torch.uint8).double() - 127))


@pytest.mark.slow
def test_server_killed_mid_sync(servers, ckpt, tmp_path, monkeypatch):
    (_, url_a), (proc_b, url_b) = servers
    client, model = RolloutClient([url_a, url_b]), trained(step_seed=5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    post, calls = wsync.post, []

    def kill_at_second_bucket(client_, urls, path, *rest):
        calls.append(path)
        if calls.count("/update_weights_from_distributed") == 2:
            proc_b.kill()
            proc_b.wait()
        return post(client_, urls, path, *rest)
    monkeypatch.setattr(wsync, "post", kill_at_second_bucket)
    with pytest.raises(wsync.SyncError) as err:
        wsync.sync(model, GRID, client, ARGS, tmp_path, mode="distributed", version="k-1", bucket_mb=0.25, timeout=30)
    monkeypatch.undo()
    print(err.value)  # what the trainer prints
    assert f"down now: ['{url_b}']" in str(err.value) and url_b in err.value.urls
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the trainer's weights untouched
    assert client.stale == {url_a, url_b}  # both hold part of k-1: no rollouts from either
    with pytest.raises(RuntimeError, match="holds the current weights"):
        client.generate(PROMPTS, 1, {"max_new_tokens": 2}, 0)
    wsync.sync(model, GRID, client, ARGS, tmp_path, mode="distributed", version="k-2", timeout=30)  # B still down
    assert client.stale == {url_b} and logprob_diff(url_a, model, "k-2") <= 1e-5
    servers[1] = start_servers(ckpt, ports=[url_b.rsplit(":", 1)[1]])[0]  # B is back, with its old weights
    samples = client.generate(PROMPTS, 1, {"max_new_tokens": 2}, 0)
    assert client.stale == {url_b} and {s["url"] for (s,) in samples} == {url_a}  # B waits for a full sync
    wsync.sync(model, GRID, client, ARGS, tmp_path, mode="distributed", version="k-3", verify=True, timeout=30)
    assert client.stale == set() and logprob_diff(url_b, model, "k-3") <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["tensor"])  # train_grpo with 'distributed': test_faults.py (a server killed mid-sync)
def test_train_grpo_syncs_into_fp8_server(mode, tmp_path):
    """The trainer's path: an fp8 embedded server, a verified sync after each step (2 steps)."""
    cmd = [sys.executable, "train_grpo.py", f"--out_dir={tmp_path}", *"--max_steps=2 --n_prompts=2 --n_samples=2 "
           "--max_new_tokens=4 --init_from=scratch --model_config=config/models/tiny.json --data=toy --eval_interval=0 "
           f"--checkpoint_interval=0 --dynamic_sampling=False --weight_sync={mode} --rollout_quant=fp8 "
           "--weight_sync_verify=True --weight_sync_bucket_mb=1".split()]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0 and "weight sync, attempt" not in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]
    # the server starts from the config alone and takes version 1 in a sync before step 0; each step's sync adds one
    recs = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [(r["weight_version"], r["stale_samples"]) for r in recs] == [(2, 0), (3, 0)]
