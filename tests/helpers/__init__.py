"""What the tests share that is not a test: the subprocess runners (fault_run.py, parallel_run.py, sync_run.py, each
also run as a script) and grpo_base.py's base checkpoint and entry-point runner."""
