"""Worker processes under torch.distributed.elastic's agent (what ``torchrun`` itself uses), so that
a run can neither hang on a dead worker nor outlive its parent.

:func:`run_workers` starts ``n`` processes on this machine running ``fn(*args)`` with a
torchrun-compatible environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``, rendezvous through a c10d store on localhost) and returns each rank's result. The
agent watches them every 0.1 s: when one fails (an exception, host or CUDA out of memory, kill -9, a
gloo or NCCL error that ends it) it stops all the others (SIGTERM, SIGKILL after
:data:`SHUTDOWN_S`), and :func:`run_workers` raises :class:`WorkerFailed` naming the rank and the
cause -- the exception's message (each worker records it in an error file, the way ``@record``
does) or the signal. Ctrl-C and SIGTERM to this process stop every worker the same way and raise
:class:`Interrupted`. A worker that fails exits at once (``os._exit``) rather than waiting for its
threads, so a thread blocked on a dead peer cannot keep it alive.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable

from mobius.errors import MobiusError

log = logging.getLogger(__name__)
MONITOR_S = 0.1  # how often the agent looks at its workers
SHUTDOWN_S = 5  # grace before SIGKILL when stopping workers
TORCH_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher")
FAILURE_FILE = "mobius-failure.json"
ECHOES = ("closed by peer", "reset by peer", "remote worker", "Broken pipe", "communicator was aborted",
          "remote process")  # how a worker fails when another one is gone


class WorkerFailed(MobiusError):
    """A worker ended the run; the message names its rank and why."""


class Interrupted(MobiusError):
    """The run was stopped by a signal (Ctrl-C, SIGTERM); ``signum`` says which."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}; every worker was stopped")
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def run_workers(fn: Callable[..., Any], args: tuple, workers: int, log_level: int = logging.INFO) -> dict[int, Any]:
    """Run ``fn(*args)`` in ``workers`` supervised processes; ``{rank: result}``."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    run_id = f"mobius-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory(prefix="mobius-workers-") as logs, _quiet_torch():
        grace = {"shutdown_timeout": SHUTDOWN_S} if "shutdown_timeout" in LaunchConfig.__dataclass_fields__ else {}
        config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=workers, rdzv_backend="c10d",
                              rdzv_endpoint="127.0.0.1:0", run_id=run_id, max_restarts=0, monitor_interval=MONITOR_S,
                              start_method="spawn", logs_specs=DefaultLogsSpecs(log_dir=logs, redirects=Std.NONE,
                                                                                tee=Std.NONE),
                              **grace)  # torch < 2.12 has no shutdown_timeout: its agent waits 30 s at most
        try:
            return elastic_launch(config, _worker_entry)(fn, args, log_level)
        except ChildFailedError as e:
            raise WorkerFailed(_root_cause(logs, e, workers)) from None
        except SignalException as e:
            raise Interrupted(int(e.sigval)) from None


class _quiet_torch:
    """The agent logs every failure with a traceback; mobius reports it in one line instead."""

    def __enter__(self) -> None:
        self.levels = {name: logging.getLogger(name).level for name in TORCH_LOGGERS}
        for name in TORCH_LOGGERS:
            logging.getLogger(name).setLevel(logging.CRITICAL)

    def __exit__(self, *exc: object) -> None:
        for name, level in self.levels.items():
            logging.getLogger(name).setLevel(level)


def _root_cause(logs: str, error: Any, workers: int) -> str:
    """One line: which rank ended the run, and why. Workers that fail because a peer is gone
    ("connection reset by peer") are echoes: the cause is a worker that raised something else, or
    one killed by a signal (the agent may report it, or it simply left no error behind), or,
    failing those, the first echo."""
    recorded = []
    for path in Path(logs).rglob(FAILURE_FILE):
        try:
            recorded.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    causes = sorted((f for f in recorded if not any(e in f["message"] for e in ECHOES)), key=lambda f: f["time"])
    if causes:
        return f"worker rank {causes[0]['rank']} failed: {causes[0]['message']}"
    log.debug("worker failures: %s", {r: (f.exitcode, f.message) for r, f in error.failures.items()})
    killed = sorted(rank for rank, f in error.failures.items() if f.exitcode < 0)
    if killed:
        f = error.failures[killed[0]]
        return f"worker rank {killed[0]} was killed ({f.signal_name()}); the other workers were stopped"
    silent = sorted(set(range(workers)) - {f["rank"] for f in recorded} - set(error.failures))
    if recorded and silent:
        return (f"worker rank {silent[0]} died without an error (killed by a signal, e.g. SIGKILL or the "
                f"out-of-memory killer); the other workers were stopped")
    if recorded:
        first = min(recorded, key=lambda f: f["time"])
        return f"worker rank {first['rank']} failed: {first['message']}"
    rank, f = min(error.failures.items())
    return f"worker rank {rank} exited with code {f.exitcode}; the other workers were stopped"


def _worker_entry(fn: Callable[..., Any], args: tuple, log_level: int) -> Any:
    """(In each worker) run ``fn``; on any failure record it for the agent and leave at once."""
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    rank = int(os.environ["RANK"])
    logging.basicConfig(level=log_level if rank == 0 else max(log_level, logging.WARNING),
                        format=f"[rank {rank}] %(message)s", force=True)
    handler = get_error_handler()
    handler.initialize()
    try:
        return fn(*args)
    except BaseException as e:  # noqa: BLE001 -- every failure is reported, then the process ends
        handler.record_exception(e)
        _record_failure(rank, e)
        log.debug("worker rank %d failed", rank, exc_info=True)
        os._exit(130 if isinstance(e, KeyboardInterrupt) else 1)


def _record_failure(rank: int, e: BaseException) -> None:
    """Beside the agent's error file: the rank, the exact time and the message a user should read."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not error_file:
        return
    message = str(e) if isinstance(e, MobiusError) else f"{type(e).__name__}: {e}".rstrip(": ")
    if isinstance(e, KeyboardInterrupt):
        message = "interrupted"
    Path(error_file).parent.joinpath(FAILURE_FILE).write_text(
        json.dumps({"rank": rank, "time": time.time(), "message": message.splitlines()[0] if message else ""}))
