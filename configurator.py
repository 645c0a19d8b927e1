# Poor man's configurator, after nanoGPT's. The entry script defines every default as a module global and runs
#   exec(open('configurator.py').read())
# so this file rewrites those globals in place. Example:
#   python train_grpo.py config/cpu_tiny.py --max_steps=2 --lr=3e-4
# An argument without '--' is a config file of plain assignments; '--key=value' is an override. Files are
# applied in order, then overrides in order, so an override wins wherever it sits on the command line.
# Bad config raises ValueError; train_grpo.py catches it and exits 2 (a usage error, not a crash).
# (Comments, not a docstring: a docstring here would overwrite the entry script's __doc__.)
_before = set(globals())  # to leave the caller's namespace as we found it (train_grpo.py logs its globals)
import ast, difflib, os, sys

# Valid keys: the plain-valued globals that existed before we ran. Not config_keys, which the entry
# script may build from these same names before calling us.
_defaults = {k: v for k, v in globals().items() if not k.startswith('_') and k != 'config_keys'
             and (v is None or isinstance(v, (int, float, bool, str, tuple, list)))}
_master = int(os.environ.get('RANK', 0)) == 0  # under torchrun every rank parses; only rank 0 talks

def _set(key, val, where):
    if key not in _defaults:
        near = difflib.get_close_matches(key, _defaults, n=3)
        hint = f"did you mean {', '.join(near)}?" if near else "run with --help to list the keys"
        raise ValueError(f"unknown config key '{key}' in {where}; {hint}")
    default = _defaults[key]  # type from the entry script's default, not from an earlier override
    if type(default) is float and type(val) is int:
        val = float(val)  # --lr=1 means 1.0
    if default is not None and type(val) is not type(default):  # exact: True is no int, 1 is no bool
        raise ValueError(f"config key '{key}' in {where} expects {type(default).__name__}, "
                         f"got {val!r} ({type(val).__name__})")
    globals()[key] = val
    if _master: print(f"config: {key} = {val!r}  ({where})")

def _parse(text, default):
    try:
        val = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text  # a bare word or a path: bfloat16, /data/DeepSeek-V4-Flash
    # a str default takes the text as written: --wandb_project=2024 is '2024', not an int
    return text if isinstance(default, str) and not isinstance(val, str) else val

_args = sys.argv[1:]
if '--help' in _args or '-h' in _args:
    if _master: print('\n'.join(f"--{k}={v!r}" for k, v in _defaults.items()))
    sys.exit(0)
for _arg in [a for a in _args if not a.startswith('--')] + [a for a in _args if a.startswith('--')]:
    if not _arg.startswith('--'):
        # run the file on a copy of the namespace, then apply what it added or rebound, so that a typo
        # such as `max_step = 10` fails instead of creating a new global; _names (and __doc__) stay private
        _ns, _snap = dict(globals()), dict(globals())
        try:  # a missing or broken file is a usage error too
            exec(open(_arg).read(), _ns)
        except Exception as _e: raise ValueError(f"config file {_arg}: {type(_e).__name__}: {_e}") from None
        for _k, _v in _ns.items():
            if not _k.startswith('_') and (_k not in _snap or _v is not _snap[_k]):
                _set(_k, _v, _arg)
    else:
        _key, _eq, _text = _arg[2:].partition('=')  # first '=' only: --data=a=b gives 'a=b'
        if not _eq: raise ValueError(f"expected --key=value, got '{_arg}'")
        _set(_key, _parse(_text, _defaults.get(_key)), 'command line')
for _name in [n for n in globals() if n not in _before]: del globals()[_name]
del _name
