# configurator.py is exec'd, not imported, so each test execs it into a fresh dict that plays the part of
# train_grpo.py's module globals, with sys.argv patched.
import os
import sys
from pathlib import Path

import pytest

SRC = (Path(__file__).resolve().parents[1] / 'configurator.py').read_text()

DEFAULTS = dict(
    out_dir='out', seed=1337, max_steps=500, dtype='bfloat16', lr=1e-6, grad_clip=1.0,
    recompute=False, dry_run=False, tis_cap=None, data='toy', wandb_project='nano-dsv4-rl',
    stop_strings=['</answer>'], betas=(0.9, 0.98),
)


def run(monkeypatch, *args, **extra):
    ns = dict(DEFAULTS, os=os, helper=lambda: None, config_keys=list(DEFAULTS), **extra)
    monkeypatch.setattr(sys, 'argv', ['train_grpo.py', *map(str, args)])
    monkeypatch.delenv('RANK', raising=False)
    exec(SRC, ns)
    return ns


def write(tmp_path, text, name='cfg.py'):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_no_args_changes_nothing(monkeypatch):
    ns = run(monkeypatch)
    assert {k: ns[k] for k in DEFAULTS} == DEFAULTS


def test_config_file_then_override_wins(monkeypatch, tmp_path):
    cfg = write(tmp_path, "max_steps = 100\nlr = 3e-6\nout_dir = 'out/a'\n")
    ns = run(monkeypatch, cfg, '--max_steps=7')
    assert ns['max_steps'] == 7 and ns['lr'] == 3e-6 and ns['out_dir'] == 'out/a'
    # an override placed before the file still wins: files first, then overrides
    ns = run(monkeypatch, '--max_steps=7', cfg)
    assert ns['max_steps'] == 7


def test_two_config_files_apply_in_order(monkeypatch, tmp_path):
    a = write(tmp_path, "seed = 1\nlr = 2e-6\n", 'a.py')
    b = write(tmp_path, "seed = 2\n", 'b.py')
    ns = run(monkeypatch, a, b)
    assert (ns['seed'], ns['lr']) == (2, 2e-6)


def test_config_file_may_unpack_and_compute(monkeypatch, tmp_path):
    cfg = write(tmp_path, "seed, lr = 3, 2e-6\nmax_steps = seed * 2  # a file sees earlier values\n")
    ns = run(monkeypatch, cfg)
    assert (ns['seed'], ns['lr'], ns['max_steps']) == (3, 2e-6, 6)


def test_split_on_first_equals_only(monkeypatch):
    ns = run(monkeypatch, '--data=hub://x?split=train', '--out_dir=a=b=c')
    assert ns['data'] == 'hub://x?split=train'
    assert ns['out_dir'] == 'a=b=c'


def test_none_default_accepts_any_type(monkeypatch):
    assert run(monkeypatch, '--tis_cap=2.0')['tis_cap'] == 2.0
    assert run(monkeypatch, '--tis_cap=2')['tis_cap'] == 2
    assert run(monkeypatch, '--tis_cap=off')['tis_cap'] == 'off'


def test_int_promoted_to_float(monkeypatch, tmp_path):
    ns = run(monkeypatch, '--lr=1', '--grad_clip=2')
    assert type(ns['lr']) is float and ns['lr'] == 1.0
    assert type(ns['grad_clip']) is float and ns['grad_clip'] == 2.0
    ns = run(monkeypatch, write(tmp_path, "lr = 3\n"))
    assert type(ns['lr']) is float


def test_float_not_demoted_to_int(monkeypatch):
    with pytest.raises(ValueError, match=r"'max_steps'.*int.*2\.5"):
        run(monkeypatch, '--max_steps=2.5')


def test_bool_parsing(monkeypatch):
    ns = run(monkeypatch, '--recompute=True', '--dry_run=False')
    assert ns['recompute'] is True and ns['dry_run'] is False
    for bad in ('1', 'true', 'yes'):  # only Python's True/False, never 1 or a word
        with pytest.raises(ValueError, match=r"'recompute'.*bool"):
            run(monkeypatch, f'--recompute={bad}')


def test_int_default_rejects_bool(monkeypatch):
    with pytest.raises(ValueError, match=r"'seed'.*int"):
        run(monkeypatch, '--seed=True')


def test_wrong_type_names_key_type_and_value(monkeypatch):
    with pytest.raises(ValueError) as e:
        run(monkeypatch, '--max_steps=ten')
    msg = str(e.value)
    assert 'max_steps' in msg and 'int' in msg and "'ten'" in msg


def test_wrong_type_in_config_file(monkeypatch, tmp_path):
    cfg = write(tmp_path, "dry_run = 'yes'\n")
    with pytest.raises(ValueError, match=rf"'dry_run' in {cfg}.*bool"):
        run(monkeypatch, cfg)


def test_containers(monkeypatch):
    ns = run(monkeypatch, "--stop_strings=['a', 'b c']", '--betas=(0.9, 0.95)')
    assert ns['stop_strings'] == ['a', 'b c'] and ns['betas'] == (0.9, 0.95)
    with pytest.raises(ValueError, match=r"'betas'.*tuple"):
        run(monkeypatch, '--betas=[0.9, 0.95]')


def test_unknown_cli_key_suggests_close_match(monkeypatch):
    with pytest.raises(ValueError, match=r"unknown config key 'max_step'.*did you mean max_steps"):
        run(monkeypatch, '--max_step=3')


def test_unknown_cli_key_without_close_match(monkeypatch):
    with pytest.raises(ValueError, match=r"'zzz'.*--help"):
        run(monkeypatch, '--zzz=1')


def test_unknown_key_in_config_file_suggests_close_match(monkeypatch, tmp_path):
    cfg = write(tmp_path, "lr = 1e-6\nrecomput = True\n")
    with pytest.raises(ValueError, match=rf"unknown config key 'recomput' in {cfg}.*recompute"):
        run(monkeypatch, cfg)


def test_non_config_globals_are_not_keys(monkeypatch, tmp_path):
    # modules, functions, _private names and config_keys exist in the namespace but are not settable
    for arg in ('--os=1', '--helper=1', '--config_keys=[]', '--_secret=1'):
        with pytest.raises(ValueError, match='unknown config key'):
            run(monkeypatch, arg, _secret=1)
    with pytest.raises(ValueError, match="unknown config key 'math'"):
        run(monkeypatch, write(tmp_path, "import math\n"))


def test_string_values_with_spaces_and_quotes(monkeypatch):
    ns = run(monkeypatch, '--data=my data/set 1.jsonl', '--out_dir="quoted dir"',
             """--wandb_project="it's a run" """.strip())
    assert ns['data'] == 'my data/set 1.jsonl'
    assert ns['out_dir'] == 'quoted dir'  # quotes are Python quotes, stripped by literal_eval
    assert ns['wandb_project'] == "it's a run"


def test_str_default_keeps_numeric_text(monkeypatch):
    ns = run(monkeypatch, '--wandb_project=2024', '--dtype=float32', '--data=')
    assert ns['wandb_project'] == '2024' and ns['dtype'] == 'float32' and ns['data'] == ''


def test_flag_without_value_is_an_error(monkeypatch):
    with pytest.raises(ValueError, match='--key=value'):
        run(monkeypatch, '--dry_run')


def test_prints_on_rank0_only(monkeypatch, capsys):
    run(monkeypatch, '--max_steps=3')
    assert 'max_steps = 3' in capsys.readouterr().out
    ns = dict(DEFAULTS)
    monkeypatch.setattr(sys, 'argv', ['train_grpo.py', '--max_steps=4'])
    monkeypatch.setenv('RANK', '3')
    exec(SRC, ns)
    assert ns['max_steps'] == 4 and capsys.readouterr().out == ''


def test_help_lists_keys_and_exits(monkeypatch, capsys):
    with pytest.raises(SystemExit) as e:
        run(monkeypatch, '--help')
    out = capsys.readouterr().out
    assert e.value.code == 0 and '--max_steps=500' in out and "--dtype='bfloat16'" in out
    assert '--os' not in out and '--config_keys' not in out


def test_namespace_left_clean(monkeypatch, tmp_path):
    # the caller's own names, __doc__ included, survive; nothing of ours or of the file's privates leaks
    before = set(DEFAULTS) | {'os', 'helper', 'config_keys', '__doc__'}
    cfg = write(tmp_path, '"""A config docstring."""\n_base = 5\nseed = _base\n')
    ns = run(monkeypatch, cfg, '--lr=2e-6', __doc__='train_grpo docstring')
    assert set(ns) - {'__builtins__'} == before
    assert ns['__doc__'] == 'train_grpo docstring' and (ns['seed'], ns['lr']) == (5, 2e-6)
