"""The library files' own self-checks, which the README offers as a first look (`python model_dsv4.py`, ...): each runs
in a subprocess and must exit 0 with its closing line. And the layout's rules: imports only go down, the fast paths'
package imports nothing of the project, no file of ours hides an installed package, pyproject installs every file."""
import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNELS = "dsv4_kernels"


@pytest.mark.slow
@pytest.mark.parametrize("script,last", [("model_dsv4.py", "self-check passed"),
                                         ("checkpoint.py", "self-check passed"),
                                         ("engine.py", "engine logprobs vs full forward"),
                                         ("rollout.py", "self-check passed")])
def test_self_check_passes(script, last):
    # as a user runs it: no TRITON_INTERPRET=1 inherited (dsv4_kernels sets Triton's interpreter itself; inherited
    # from the start, it crashed torch's custom-op calls now and then)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, script], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert last in out.stdout.strip().splitlines()[-1], out.stdout[-2000:]


def our_modules():
    """{module name: path} of every Python file of the project: the top level and the kernels' package."""
    mods = {f[:-3]: os.path.join(ROOT, f) for f in os.listdir(ROOT) if f.endswith(".py")}
    for f in os.listdir(os.path.join(ROOT, KERNELS)):
        if f.endswith(".py"):
            mods[KERNELS if f == "__init__.py" else f"{KERNELS}.{f[:-3]}"] = os.path.join(ROOT, KERNELS, f)
    return mods


def import_graph():
    """{module: the project's modules it imports anywhere in its file (functions and __main__ blocks too)}."""
    mods, graph = our_modules(), {}
    for name, path in mods.items():
        package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package if node.level else ""
                mod = ".".join(p for p in (base, node.module) if p)
                targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
            else:
                continue
            for t in targets:  # the longest prefix that is one of ours: `from dsv4_kernels.fast import x`
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != name:
                    deps.add(t)
        graph[name] = deps
    return graph


def test_imports_form_a_dag_and_kernels_import_nothing_of_ours():
    graph = import_graph()
    assert {"model_dsv4", "train_grpo", KERNELS, f"{KERNELS}.fast"} <= set(graph)  # the walk found the files
    assert "dsv4_kernels.fast" in graph["model_dsv4"] and "model_dsv4" in graph["parallel"]  # and their imports
    outside = {m: sorted(d for d in deps if not d.startswith(KERNELS))
               for m, deps in graph.items() if m.startswith(KERNELS)}
    assert not any(outside.values()), f"the kernels' package imports the project: {outside}"
    state, cycle = {}, []  # depth-first search; state 1 = on the current path, 2 = done

    def visit(m, path):
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycle.extend(path[path.index(d):] + [m, d] if d in path else [m, d])
            elif d not in state:
                visit(d, path + [m])
        state[m] = 2
    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    assert not cycle, f"import circle: {' -> '.join(cycle)}"


def test_the_dag_check_sees_a_circle(tmp_path, monkeypatch):
    """The check above on a planted circle: a -> b -> a is reported."""
    (tmp_path / KERNELS).mkdir()
    (tmp_path / KERNELS / "__init__.py").write_text("")
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from a import g\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(tmp_path))
    graph = import_graph()
    assert graph["a"] == {"b"} and graph["b"] == {"a"}


def test_no_module_of_ours_shadows_an_installed_package():
    """Our files are top-level modules, first on sys.path wherever they run: one named as an installed package's import
    name hides that package from everything that imports it (transformers imports the `kernels` package, which is why
    the fast paths' package is dsv4_kernels)."""
    from importlib.metadata import packages_distributions
    theirs = {name: dists for name, dists in packages_distributions().items() if "nano-dsv4-rl" not in dists}
    ours = [m for m in our_modules() if "." not in m]
    assert ours and not {m: theirs[m] for m in ours if m in theirs}


def test_pyproject_installs_every_module():
    """pyproject.toml's py-modules names every top-level file and packages the kernels: a partial list installs a
    model that does not import."""
    import re
    with open(os.path.join(ROOT, "pyproject.toml")) as f:  # (tomllib is 3.11's; the project runs on 3.10)
        text = f.read()
    listed = re.findall(r'"(\w+)"', re.search(r"^py-modules = \[(.*?)\]", text, re.S | re.M).group(1))
    assert sorted(listed) == sorted(f[:-3] for f in os.listdir(ROOT) if f.endswith(".py"))
    assert re.search(rf'^packages = \["{KERNELS}"\]', text, re.M)
