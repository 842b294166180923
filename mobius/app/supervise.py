"""Worker processes under torch.distributed.elastic's agent (what ``torchrun`` itself uses), so that
a run can neither hang on a dead worker nor outlive its parent.

:func:`run_workers` starts ``n`` processes on this machine running ``fn(*args)`` with a
torchrun-compatible environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``, rendezvous through a c10d store on localhost) and returns each rank's result. The
agent watches them every 0.1 s: when one fails (an exception, host or CUDA out of memory, kill -9, a
gloo or NCCL error that ends it) it stops all the others (SIGTERM, SIGKILL after
:data:`SHUTDOWN_S`), and :func:`run_workers` raises :class:`WorkerFailed` naming the rank and the
cause -- the exception's message (each worker records it in an error file, the way ``@record``
does) or the signal. A worker that fails exits at once (``os._exit``) rather than waiting for its
threads, so a thread blocked on a dead peer cannot keep it alive.

Stopping: Ctrl-C, SIGTERM and SIGHUP to this process stop every worker the same way -- the agent
sends them SIGTERM (:func:`_stops_as_sigterm`), and a signal that comes while the workers are being
launched waits until every one is (:func:`_launches_whole`) -- and raise
:class:`Interrupted`; outside the workers' lifetime :func:`stop_on_signals` turns them into
:class:`Signalled`, so that every phase ends through the run's ``finally`` clauses with one line.
A terminal's Ctrl-C and hang-up reach every process of its foreground group, workers included: they
are born with those signals blocked and then ignore them (:func:`leave_stopping_to_parent`), since
this process stops them -- no worker prints a traceback, however early in its start-up the signal
comes. The multiprocessing resource tracker is started here the same way (it then survives a
hang-up and cleans up what killed workers leave without a word). Each worker watches its parent
(this process, or torchrun's agent) and ends as soon as it is gone, however it ended, so that the fork
server and the resource tracker, which live while a worker does, end too; a rank torchrun started
keeps the terminal's signals and stops on them by itself (:func:`end_when_orphaned`). However else this
process ends (a run done, refused, failed or stopped), it ends the fork server before it exits, and the
resource tracker ends with it (:func:`end_fork_server`).

Workers are forks of multiprocessing's fork server, started once per process with torch and mobius
imported (:func:`_fork_server_running`): a worker then starts in milliseconds instead of importing
torch for 2 s of CPU. A fork inherits the server's environment, so each worker takes the run's
environment as it is at launch, with the agent's per-rank variables on top (:func:`_adopt`).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import signal
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator, NoReturn

from mobius.app.library_warnings import one_line_warnings
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


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # each stops a run, with one line
TERMINAL_SIGNALS = {signal.SIGINT, signal.SIGHUP, signal.SIGQUIT}  # what a terminal sends its whole foreground group
ORPHAN_CHECK_S = 1.0  # how often a worker looks for its parent
START_METHOD = "forkserver"
PRELOAD = ["mobius.app.launch"]  # what the fork server imports once (torch and every module a worker runs)
_IMPORT_ENV = dict(os.environ)  # this process's environment when it imported this module
_EXIT = threading.RLock()  # held by the thread that ends this process at once, with its one line (claim_exit)


def claim_exit() -> None:
    """Become the one thread that ends this process now (its one line, then ``os._exit``): a thread that
    comes second waits here until the process is gone, so that a process ends with one line."""
    _EXIT.acquire()


def leave(line: str) -> NoReturn:
    """End this process now with ``line`` on stderr (one write: other processes report at the same moment, and
    print's separate write of the newline let their lines run together), unless another thread is ending it."""
    claim_exit()
    os.write(2, f"{line}\n".encode())
    os._exit(1)


class Signalled(KeyboardInterrupt):
    """A stop signal (Ctrl-C, SIGTERM, SIGHUP) that reached this process; like Ctrl-C's
    KeyboardInterrupt, no ``except Exception`` swallows it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


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
    with tempfile.TemporaryDirectory(prefix="mobius-workers-") as logs, _quiet_torch(), \
            _terminal_signals_to_this_process(), _signals_kept(), _launches_whole(), \
            _stops_as_sigterm() as received:
        fields = LaunchConfig.__dataclass_fields__
        grace = {"shutdown_timeout": SHUTDOWN_S} if "shutdown_timeout" in fields else {}
        if "signals_to_handle" in fields:  # (older torch reads the environment: _stops_as_sigterm)
            grace["signals_to_handle"] = "SIGTERM"  # the others raise its SIGTERM: _stops_as_sigterm
        config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=workers, rdzv_backend="c10d",
                              rdzv_endpoint="127.0.0.1:0", run_id=run_id, max_restarts=0, monitor_interval=MONITOR_S,
                              start_method=START_METHOD, logs_specs=DefaultLogsSpecs(log_dir=logs, redirects=Std.NONE,
                                                                                tee=Std.NONE),
                              **grace)  # torch < 2.12 has no shutdown_timeout: its agent waits 30 s at most
        try:
            return elastic_launch(config, _worker_entry)(fn, args, log_level, dict(os.environ), os.getpid())
        except ChildFailedError as e:
            raise WorkerFailed(_root_cause(logs, e, workers)) from None
        except SignalException as e:
            raise Interrupted(received[0] if received else int(e.sigval)) from None


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """While a run goes on in this (main) thread: Ctrl-C, SIGTERM and SIGHUP raise :class:`Signalled`
    here (the agent's own handlers take over while workers run: :func:`run_workers`)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: object) -> None:
        raise Signalled(signum)
    old = {s: signal.signal(s, stop) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def _signals_kept() -> Iterator[None]:
    """The agent installs handlers of its own (raising its SignalException) and leaves them: put back
    this process's handlers when the workers are done."""
    old = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        if threading.current_thread() is threading.main_thread():
            for s, handler in old.items():
                signal.signal(s, handler if handler is not None else signal.SIG_DFL)


@contextlib.contextmanager
def _terminal_signals_to_this_process() -> Iterator[None]:
    """While workers start and run, block the terminal's signals in this thread: the processes started
    from it (the workers, the resource tracker) inherit the blocked set, and a helper thread, which does
    not block them, takes them for this process (Python runs the handlers in the main thread all the
    same)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    done = threading.Event()
    threading.Thread(target=done.wait, name="mobius-signals", daemon=True).start()
    signal.pthread_sigmask(signal.SIG_BLOCK, TERMINAL_SIGNALS)
    try:
        _helpers_running()
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, TERMINAL_SIGNALS)
        done.set()


def start_helpers_early() -> None:
    """Start the resource tracker and the fork server now, so that the fork server imports torch and mobius
    (2-2.5 s of CPU) while this process reads its data; the workers' launch then finds them running. The
    terminal's signals are blocked while they start, as :func:`run_workers` starts them (they and the workers
    inherit that), and a signal that comes meanwhile is taken once they run. The fork server ends before this
    process exits, however a run ends, refused before its workers started included (:func:`end_fork_server`)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        return  # (run_workers starts them)
    before = signal.pthread_sigmask(signal.SIG_BLOCK, TERMINAL_SIGNALS)
    try:
        _helpers_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def end_fork_server(owner: int) -> None:
    """End the fork server that process ``owner`` started (when this is that process, not a fork of it), if one
    runs; registered to run when that process exits (:func:`_fork_server_running`), however it ends but by
    ``os._exit`` or a fatal signal. An idle server would end by itself once this process had (it watches its
    "alive" pipe), but one still importing what it preloads -- a run refused before its workers started -- reads
    that pipe only when done, and outlived ``mobius`` by 1-2 s. It holds nothing to clean up (its socket is in
    the abstract namespace; the resource tracker removes what its forks registered), so it is killed and reaped.
    The resource tracker then ends as soon as this process does: the last holder of its pipe."""
    from multiprocessing import forkserver

    server = forkserver._forkserver
    pid = server._forkserver_pid
    if pid is None or os.getpid() != owner:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        server._stop()  # closes its "alive" pipe and reaps it; a later run would start another


def helpers_settled() -> None:
    """Return once the fork server has imported what it preloads (it forks a process only then; this forks
    one that does nothing), so that what is timed next has the cores to itself: on 2 cores a CPU AdamW rate
    measured beside its import came out at half (0.71-0.77 against 1.38-1.54 G params/s), and the planner
    keeps such measurements. The helpers were started by :func:`start_helpers_early`."""
    import multiprocessing

    if START_METHOD == "forkserver":
        nothing = multiprocessing.get_context("forkserver").Process(target=_nothing, daemon=True)
        nothing.start()
        nothing.join()


def _nothing() -> None:
    pass


def _helpers_running() -> None:
    """(The terminal's signals blocked in this thread) the resource tracker and the fork server running."""
    _start_resource_tracker()
    signal.pthread_sigmask(signal.SIG_BLOCK, TERMINAL_SIGNALS)  # starting it unblocks SIGINT in this thread
    _fork_server_running()


@contextlib.contextmanager
def _stops_as_sigterm() -> Iterator[list[int]]:
    """While the agent runs the workers: Ctrl-C, SIGHUP and SIGQUIT stop them as SIGTERM does. The
    agent forwards the signal it got to the workers, and they ignore the terminal's signals
    (:func:`leave_stopping_to_parent`), so it would wait its whole grace period; here the agent
    handles SIGTERM only and these raise its SignalException for SIGTERM. Yields the signals received
    (the first names the stop)."""
    from torch.distributed.elastic.multiprocessing import SignalException

    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def stop(signum: int, frame: object) -> None:
        received.append(signum)
        raise SignalException(f"process {os.getpid()} got signal {signum}", sigval=signal.SIGTERM)
    key, before = "TORCHELASTIC_SIGNALS_TO_HANDLE", os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE")
    os.environ[key] = "SIGTERM"
    old = {s: signal.signal(s, stop) for s in TERMINAL_SIGNALS}
    try:
        yield received
    finally:
        for s, handler in old.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before


@contextlib.contextmanager
def _launches_whole() -> Iterator[None]:
    """A stop signal that arrives while the agent launches the workers waits until it has launched them
    all and holds them: interrupted earlier, the agent would not know the workers already started,
    which would outlive it and fail with a traceback (an ``EOFError`` half-way through a launch, or a
    ``FileNotFoundError`` for a semaphore the agent has removed). The signal is then sent again to
    this process, so its handler runs as it would have and the agent stops every worker."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    start = LocalElasticAgent._start_workers

    def whole(agent: Any, worker_group: Any) -> Any:
        held: list[int] = []
        old = {s: signal.signal(s, lambda signum, frame: held.append(signum)) for s in STOP_SIGNALS}
        try:
            return start(agent, worker_group)
        finally:
            for s, handler in old.items():
                signal.signal(s, handler if handler is not None else signal.SIG_DFL)
            for signum in dict.fromkeys(held):
                os.kill(os.getpid(), signum)

    LocalElasticAgent._start_workers = whole
    try:
        yield
    finally:
        LocalElasticAgent._start_workers = start


def _fork_server_running() -> None:
    """Start multiprocessing's fork server, which imports :data:`PRELOAD` once; its forks inherit the
    signal mask it was started with (blocked: :func:`_terminal_signals_to_this_process`). Once started
    it serves every later run of this process, until the process exits and ends it (:func:`end_fork_server`)."""
    import multiprocessing
    from multiprocessing import forkserver

    if START_METHOD == "forkserver":
        multiprocessing.set_forkserver_preload(PRELOAD)
        forkserver.ensure_running()
        atexit.unregister(end_fork_server)  # (registered once)
        atexit.register(end_fork_server, os.getpid())


def _start_resource_tracker() -> None:
    """Start multiprocessing's resource tracker (the workers share it) with the terminal's signals
    blocked and its stderr on /dev/null: it outlives a hang-up, and cleans up the semaphores of killed
    workers without printing warnings after mobius's last line."""
    from multiprocessing import resource_tracker

    sys.stderr.flush()
    saved = os.dup(2)
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 2)
        os.close(null)
        resource_tracker.ensure_running()
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def leave_stopping_to_parent(rank: int, parent: int) -> None:
    """(In a worker mobius started) ignore the terminal's signals -- the parent stops the workers --
    and end once the parent, process ``parent``, is gone (:func:`end_when_orphaned`)."""
    for s in TERMINAL_SIGNALS:
        signal.signal(s, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, TERMINAL_SIGNALS)
    end_when_orphaned(rank, parent)


def end_when_orphaned(rank: int, named: int | None = None) -> None:
    """End this process at once when the process that started it (mobius, or torchrun's agent) is gone
    (killed with SIGKILL, say), saying so in one line that names process ``named`` (default: the
    parent).

    A worker mobius started is a child of the fork server, which lives on while any of its children
    does (each child holds the server's "alive" pipe), so the worker's parent process says nothing: it
    watches the pipe multiprocessing keeps open from the process that launched it (its parent
    sentinel), which reads end-of-file the moment that process ends, however it ends. A process
    torchrun started has no such pipe and watches its parent process every :data:`ORPHAN_CHECK_S`."""
    import multiprocessing
    from multiprocessing.connection import wait

    launcher = multiprocessing.parent_process()
    parent = os.getppid()

    def watch() -> None:
        if launcher is not None and launcher.sentinel is not None:
            wait([launcher.sentinel])
        else:
            while os.getppid() == parent:
                time.sleep(ORPHAN_CHECK_S)
        leave(f"mobius: worker rank {rank} stopped: its parent process {named or parent} is gone")
    threading.Thread(target=watch, name="mobius-parent-watch", daemon=True).start()


class _quiet_torch:
    """The agent logs every failure with a traceback, and each death signal; mobius reports them in
    one line instead."""

    def __enter__(self) -> None:
        names = [n for n in logging.root.manager.loggerDict if n.startswith(TORCH_LOGGERS)] + list(TORCH_LOGGERS)
        self.levels = {name: logging.getLogger(name).level for name in names}
        for name in names:
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


def _worker_entry(fn: Callable[..., Any], args: tuple, log_level: int, env: dict[str, str], parent: int) -> Any:
    """(In each worker) run ``fn`` in the run's environment ``env``; on any failure record it for the
    agent and leave at once."""
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    _adopt(env)
    rank = int(os.environ["RANK"])
    leave_stopping_to_parent(rank, parent)
    logging.basicConfig(level=log_level if rank == 0 else max(log_level, logging.WARNING),
                        format=f"[rank {rank}] %(message)s", force=True)
    one_line_warnings()
    handler = get_error_handler()
    handler.initialize()
    try:
        return fn(*args)
    except BaseException as e:  # noqa: BLE001 -- every failure is reported, then the process ends
        handler.record_exception(e)
        _record_failure(rank, e)
        log.debug("worker rank %d failed", rank, exc_info=True)
        os._exit(130 if isinstance(e, KeyboardInterrupt) else 1)


def _adopt(env: dict[str, str]) -> None:
    """Make this worker's environment ``env`` (the run's, at launch) plus what the agent set for this
    rank: the variables whose values differ from those this process started with (a fork server's
    child starts with the server's environment, a spawned one with the run's)."""
    agent = {k: v for k, v in os.environ.items() if _IMPORT_ENV.get(k) != v}
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(agent)


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
