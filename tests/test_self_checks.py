"""The library files' own self-checks, which the README offers as a first look (`python model_dsv4.py`, `python
engine.py`, `python rollout.py`): each runs in a subprocess and must exit 0 with its closing line. model_dsv4.py's
had failed unnoticed (its causality check asked for bit-identical logits, which the CPU's BLAS does not give when the
experts' GEMM shapes change; session 23)."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("script,last", [("model_dsv4.py", "self-check passed"),
                                         ("engine.py", "engine logprobs vs full forward"),
                                         ("rollout.py", "self-check passed")])
def test_self_check_passes(script, last):
    # as a user runs it: without a TRITON_INTERPRET=1 set before the start (inherited, it had model_dsv4.py fail in
    # torch's custom-op call with "ValueError: vector::reserve", a crash that comes and goes with the garbage
    # collector's timing; kernels_triton no longer leaves it to child processes: session 25, bench/RESULTS.md)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, script], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert last in out.stdout.strip().splitlines()[-1], out.stdout[-2000:]


def test_no_module_of_ours_shadows_an_installed_package():
    """The repo's files are top-level modules, first on sys.path wherever they run: a file named as an installed
    package's import name hides that package from everything that imports it. transformers 5.25 came to install
    and import the `kernels` package, and got our kernels.py (now kernels_torch.py): every test that loaded
    transformers failed with an ImportError (session 31)."""
    from importlib.metadata import packages_distributions
    theirs = {name: dists for name, dists in packages_distributions().items() if "nano-dsv4-rl" not in dists}
    ours = [f[:-3] for f in os.listdir(ROOT) if f.endswith(".py")]
    assert ours and not {m: theirs[m] for m in ours if m in theirs}


def test_pyproject_installs_every_module():
    """pyproject.toml's py-modules names every top-level file: model_dsv4 imports kernels_torch, mhc, the Triton files
    and (lazily) the engine, so a list of two (session 31 found it so) installed a model that did not import."""
    import re
    with open(os.path.join(ROOT, "pyproject.toml")) as f:  # (tomllib is 3.11's; the project runs on 3.10)
        listed = re.findall(r'"(\w+)"', re.search(r"^py-modules = \[(.*?)\]", f.read(), re.S | re.M).group(1))
    assert sorted(listed) == sorted(f[:-3] for f in os.listdir(ROOT) if f.endswith(".py"))
