"""A script's usage errors, checked in this process: `run_script("train_grpo.py", "--max_steps=-1")` runs the file as
`python train_grpo.py --max_steps=-1` would, from the repository root or `cwd`, and returns (exit code, stdout,
stderr). The scripts check their arguments before they build anything, so this costs a fraction of a second where a
new Python process spends ~3 s importing torch. Only for runs that stop at the check (or a dry run): a run that goes
on would train here."""
import contextlib
import io
import os
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_script(script, *argv, cwd=ROOT):
    out, err = io.StringIO(), io.StringIO()
    argv0, here, code = sys.argv, os.getcwd(), 0
    sys.argv = [os.path.join(ROOT, script), *argv]
    try:
        os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as e:  # sys.exit(2), argparse's error(), or sys.exit("message"), which Python prints and exits 1
        code = e.code
        if isinstance(code, str):
            err.write(code + "\n")
            code = 1
        code = code or 0
    finally:
        sys.argv = argv0
        os.chdir(here)
    return code, out.getvalue(), err.getvalue()
