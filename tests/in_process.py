"""``mobius ARGS`` run inside the test's own process (``mobius.cli.main``), returning what a subprocess would:
its exit code, standard output and standard error (the command's log lines included, as the CLI formats them).
A new interpreter costs 2-3 s of CPU importing torch; the commands whose process itself is under test (signals,
workers, torchrun, the interpreter's exit) keep running as subprocesses."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import subprocess
from pathlib import Path

from mobius import cli


def mobius(args: list[str], cwd: str | Path | None = None) -> subprocess.CompletedProcess:
    """``mobius *args`` in this process, in ``cwd`` when given."""
    out, err = io.StringIO(), io.StringIO()
    handler = logging.StreamHandler(err)
    handler.setFormatter(logging.Formatter("%(message)s"))
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if {"-v", "--verbose"} & set(args) else logging.INFO)
    before = os.getcwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = cli.main([str(a) for a in args])
            except SystemExit as e:  # argparse's usage errors, --help and --version
                code = e.code if isinstance(e.code, int) else 1
    finally:
        os.chdir(before)
        root.removeHandler(handler)
        root.setLevel(level)
    return subprocess.CompletedProcess(["mobius", *args], code, out.getvalue(), err.getvalue())
