"""The ``mobius`` command: thin entry points over the library.

Every user-facing failure is a :class:`mobius.errors.MobiusError`; it is printed as one line
(``mobius: error: ...``) and the process exits with code 2, never with a traceback -- as is a write the
machine refuses that no check foresaw (a full disk, a read-only filesystem). A stop signal ends the
run with ``mobius: stopped by SIG...`` and exit code 128 + its number. Under ``torchrun``
(``torchrun ... -m mobius train run.yaml``) each process logs with its rank (rank 0 at INFO, the others
warnings only), any failure is also recorded for torchrun's report of the root cause (what
``torch.distributed.elastic``'s ``@record`` does) with its traceback, and the process leaves at once,
so that a thread blocked on a lost peer cannot keep it alive.
"""

from __future__ import annotations

import argparse
import errno
import faulthandler
import importlib
import logging
import os
import signal
import sys

from mobius import __version__
from mobius.app.library_warnings import one_line_warnings
from mobius.app.settings import Torchrun
from mobius.app.supervise import ECHOES, Interrupted, Signalled, claim_exit
from mobius.errors import MobiusError

DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EISDIR}
# sub-command name -> (module in mobius.commands exposing configure(parser) and run(args) -> int, its summary)
COMMANDS = {
    "train": ("mobius.commands.train", "train or fine-tune a model from a YAML config"),
    "plan": ("mobius.commands.plan", "show which mode runs, how the model is partitioned and placed, and the "
                                     "predicted step time"),
    "topo": ("mobius.commands.topo", "show, map and benchmark the GPU topology"),
    "profile": ("mobius.commands.profile", "measure the run's units here and write them as a profile file"),
    "data": ("mobius.commands.data", "show what a run trains on: records as rendered with their targets marked, and "
                                     "the totals"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``mobius`` parser. Only ``command``'s module is imported and its arguments added; the others are
    listed by name and summary, so that ``mobius --help`` and ``--version`` import nothing heavy (torch
    takes 1.5-3 s to import)."""
    parser = argparse.ArgumentParser(prog="mobius", description="Fine-tune large Llama, Qwen, Mistral, OPT and "
                                                                "GPT-2 models on commodity GPU servers.")
    parser.add_argument("--version", action="version", version=f"mobius {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, summary) in COMMANDS.items():
        p = sub.add_parser(name, help=summary)  # (its description: the module's configure)
        if name == command:
            importlib.import_module(module).configure(p)
    return parser


def _command(argv: list[str]) -> str | None:
    """The sub-command ``argv`` names: its first word that is not an option (``mobius``'s own options take
    no values)."""
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    _stacks_on_sigusr1()
    try:
        parser = build_parser(_command(argv))
        args, extra = parser.parse_known_args(argv)
        _logging(args.verbose)
        one_line_warnings()
        if args.command is None:
            parser.print_help()
            return 2
        if extra and not getattr(args, "accepts_overrides", False):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = extra
        return int(args.func(args) or 0)
    except Interrupted as e:
        print(f"mobius: {e}", file=sys.stderr)
        return e.exit_code
    except MobiusError as e:
        return _failed(e, f"mobius: error: {e}", 2)
    except Signalled as e:
        print(f"mobius: stopped by {signal.Signals(e.signum).name}", file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:
        print("mobius: interrupted", file=sys.stderr)
        return 130
    except OSError as e:
        if e.errno not in DISK_ERRNOS:  # the machine refused a write: the user can act on it
            raise
        return _failed(e, f"mobius: error: {e.strerror}" + (f": {e.filename}" if e.filename else ""), 2)
    except Exception as e:
        rank = _rank()
        if rank is None:
            raise
        return _failed(e, f"mobius: error: {_worker_failure(rank, e)}", 1)


def _stacks_on_sigusr1() -> None:
    """``kill -USR1 PID`` prints every thread's stack on stderr, for a process that seems stuck (where stderr
    is a file: not under a test's capture)."""
    try:
        faulthandler.register(signal.SIGUSR1, file=sys.stderr.fileno(), all_threads=True)
    except (AttributeError, OSError, ValueError):  # no SIGUSR1 (Windows), or no file behind stderr
        pass


def _rank() -> int | None:
    """This process's rank when torchrun started it."""
    try:
        run = Torchrun.from_env()
    except MobiusError:
        return int(os.environ["RANK"])
    return None if run is None else run.rank


def _logging(verbose: bool) -> None:
    level = logging.DEBUG if verbose else logging.INFO
    rank = _rank()
    if rank is None:
        logging.basicConfig(level=level, format="%(message)s")
    else:
        logging.basicConfig(level=level if rank == 0 or verbose else logging.WARNING,
                            format=f"[rank {rank}] %(message)s")


def _worker_failure(rank: int, e: Exception) -> str:
    """One line for a rank that failed: the exception, or that it lost a peer (another rank failed first)."""
    text = f"{type(e).__name__}: {e}".splitlines()[0]
    if any(echo in str(e) for echo in ECHOES):
        return f"rank {rank} lost its connection to another rank, which failed or was stopped ({text})"
    return f"rank {rank} failed: {text}"


def _failed(e: BaseException, line: str, code: int) -> int:
    """Print the one line; under torchrun also record ``e`` for its report and leave now."""
    if _rank() is None:
        print(line, file=sys.stderr)
        return code
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    claim_exit()  # (a thread that watches this rank's peers or parent may be ending it already)
    print(line, file=sys.stderr)
    get_error_handler().record_exception(e)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
