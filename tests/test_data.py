"""Data that a clone has: the configs point at nothing outside the repository, the shipped AIME sets load whole, a
relative data path is found from any working directory, and data that is not there stops train_grpo.py before it
trains a base or builds a model, naming the key and what to give instead."""
import hashlib
import json
import os
import re

import pytest

from eval_aime import INT_RE, load_problems
from helpers.script import run_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(f for f in os.listdir(os.path.join(ROOT, "config")) if f.endswith(".py"))
HUB_NAME = re.compile(r"[\w.-]+/[\w.-]+")  # owner/name, as the datasets package takes it


def read_config(path):
    """The assignments of a config file, as configurator.py runs it."""
    ns = {}
    exec(open(path).read(), ns)
    return {k: v for k, v in ns.items() if not k.startswith("_")}


def outside(key, value):
    """Why a config value points outside the repository, or None. A URL is no path; init_from may name the user's
    checkpoint anywhere (the seed run's weights are not shipped); data and eval_data are a built-in task, a hub name or
    a file in the repository."""
    if not isinstance(value, str) or "://" in value:
        return None
    if ".." in value.replace("\\", "/").split("/"):
        return f"{key}={value!r} climbs out of the repository"
    if os.path.isabs(value) and key != "init_from":
        return f"{key}={value!r} is an absolute path"
    if key in ("data", "eval_data") and value not in ("math", "toy"):
        in_repo = os.path.isfile(os.path.join(ROOT, value))
        if not in_repo and (value.endswith((".jsonl", ".parquet")) or not HUB_NAME.fullmatch(value)):
            return f"{key}={value!r} is neither a file in the repository nor a hub dataset name"
    if key in ("model_config", "sft_config") and not os.path.isfile(os.path.join(ROOT, value)):
        return f"{key}={value!r} is not a file in the repository"
    return None


def test_outside_flags_paths_beside_the_checkout():
    """The check itself, on values a config once held and on ones it may hold."""
    assert outside("eval_data", "../shared/data/aime2024/aime2024.jsonl") == (
        "eval_data='../shared/data/aime2024/aime2024.jsonl' climbs out of the repository")
    assert "absolute" in outside("data", "/data/dapo.jsonl")
    assert "neither" in outside("eval_data", "data/aime2026.jsonl")
    assert "not a file" in outside("model_config", "config/models/nope.json")
    fine = [("eval_data", "data/aime2025.jsonl"), ("data", "BytedTsinghua-SIA/DAPO-Math-17k"),
            ("init_from", "/data/DeepSeek-V4-Flash"), ("rollout_url", "http://r-0:30000"), ("data", "math")]
    assert [outside(k, v) for k, v in fine] == [None] * 5


@pytest.mark.parametrize("name", CONFIGS)
def test_config_points_at_nothing_outside_the_repository(name):
    cfg = read_config(os.path.join(ROOT, "config", name))
    assert cfg, name
    bad = [why for k, v in cfg.items() for why in [outside(k, v)] if why]
    assert not bad, f"config/{name}: {bad}"


@pytest.mark.parametrize("year,first,last", [(2024, ("2024-I-1", "204"), ("2024-II-15", "315")),
                                             (2025, ("2025-I-1", "70"), ("2025-II-15", "240"))])
def test_shipped_aime_sets_load_whole(year, first, last):
    path = os.path.join(ROOT, "data", f"aime{year}.jsonl")
    probs = load_problems(path, split="test")
    assert len(probs) == 30 and len({p["id"] for p in probs}) == 30
    assert all(INT_RE.fullmatch(p["answer"]) and 0 <= int(p["answer"]) <= 999 for p in probs)
    assert (probs[0]["id"], probs[0]["answer"]) == first and (probs[-1]["id"], probs[-1]["answer"]) == last
    assert not any(c in p["problem"] for p in probs for c in "\t\f")  # the escape fix (data/README.md)
    readme = open(os.path.join(ROOT, "data", "README.md")).read()
    assert hashlib.sha256(open(path, "rb").read()).hexdigest() in readme  # the file its provenance describes


def test_fixed_escapes_read_as_latex():
    probs = {p["id"]: p["problem"] for p in load_problems(os.path.join(ROOT, "data", "aime2025.jsonl"))}
    assert "\\tfrac mn" in probs["2025-II-4"] and "\\triangle ABC" in probs["2025-II-5"]
    assert "\\frac{25}{11}" in probs["2025-II-13"]


def test_relative_path_from_the_working_directory_then_the_repository(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert len(load_problems("data/aime2024.jsonl")) == 30  # not here: the repository's copy
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "aime2024.jsonl").write_text(json.dumps({"id": "mine", "problem": "1+1?", "answer": 2}) + "\n")
    assert [p["id"] for p in load_problems("data/aime2024.jsonl")] == ["mine"]  # here: the working directory wins
    with pytest.raises(ValueError, match=r"eval_data='data/aime2026.jsonl': no such file in the working directory .* "
                                         r"or the repository .*give --eval_data="):
        load_problems("data/aime2026.jsonl", key="eval_data")


@pytest.mark.parametrize("key,value,says", [
    ("data", "nowhere/dapo.jsonl", "no such file"),
    ("eval_data", "data/aime2026.parquet", "no such file"),
    ("data", "nobody/no-such-dataset", "hub dataset name, which needs the datasets package and network")])
def test_missing_data_stops_before_the_base_and_the_model(tmp_path, key, value, says):
    code, out, err = run_script("train_grpo.py", f"--out_dir={tmp_path / 'out'}", f"--{key}={value}")  # in this process
    assert code == 2, out[-2000:] + err[-2000:]
    err = err.strip().splitlines()[-1]
    assert err.startswith(f"error: {key}={value!r}: ") and says in err and f"give --{key}=<a .jsonl" in err, err
    assert "no base in" not in out and "building the model" not in out
    assert not os.path.exists(tmp_path / "out")  # nothing trained, nothing written


@pytest.mark.slow
def test_shipped_eval_data_found_from_another_directory_and_dry_run_reads_none(tmp_path):
    """The seed config's dry run plans memory without reading its data (a hub name: no network here). The shipped
    eval_data is found from another directory: the run gets past the data to the (planted) bad init_from."""
    code, out, err = run_script("train_grpo.py", f"--out_dir={tmp_path / 'out'}", "config/mi355x.py", "--dry_run=True")
    assert code == 0 and "Memory plan" in out, err[-2000:]
    code, _, err = run_script("train_grpo.py", f"--out_dir={tmp_path / 'out'}", "--data=toy",
                              "--eval_data=data/aime2025.jsonl", "--eval_limit=3", "--init_from=nowhere", cwd=tmp_path)
    assert code == 2 and "init_from='nowhere' is not a checkpoint directory" in err, err[-2000:]
