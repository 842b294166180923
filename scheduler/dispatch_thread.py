"""What both pipeline dispatchers (the swapped :class:`~scheduler.executor.Executor`, the round-robin's
``scheduler.roundrobin_engine._Dispatch``) share around their dispatch thread, and zero mode's engine where it does the
same: each action run timed and traced (:func:`dispatch_action`); the background threads and copy streams beside
the dispatch thread, whose first failure it raises, and the optimizer thread it waits for (:class:`Background`);
copies between host and device on a stream of their own (:func:`copy_after`, :func:`event_now`,
:func:`batches_on`), each a span of the step's trace (:func:`traced`)."""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator, TypeVar

import torch

from partition.schedule import COMPUTE, Action
from scheduler.trace import ComputeSpans, DispatchTime, StepTrace
from scheduler.updater import CpuUpdater

T = TypeVar("T")


def dispatch_action(handler: Callable[[Action], None], action: Action, computed: ComputeSpans, clock: DispatchTime,
                    trace: StepTrace | None) -> tuple[float, float, float]:
    """``handler(action)`` on the dispatch thread: its start, its end and the thread's own time in it
    (:meth:`DispatchTime.run`); on ``trace`` a compute action's span from where its own work began (after its
    waits for inputs), any other's on the dispatch track."""
    computed.last = None
    t0, t1, own = clock.run(handler, action)
    if trace is not None:
        if action.kind not in COMPUTE:
            trace.add("dispatch", str(action), t0, t1)
        elif computed.last is not None:
            trace.add("compute", str(action), *computed.last)
    return t0, t1, own


class Background:
    """A worker's threads and copy streams beside its dispatch thread and compute stream: a one-thread pool per
    name in ``threads``, a CUDA stream per name in ``streams`` (None on the CPU), and the CPU optimizer thread
    (``updater``). A job's failure is kept (the first one) and raised on the dispatch thread by :meth:`check`, as
    ``what`` failed; it also wakes whoever waits on ``wake``."""

    def __init__(self, device: torch.device, threads: tuple[str, ...] = (), streams: tuple[str, ...] = (),
                 what: str = "a background task failed", wake: threading.Condition | None = None):
        self.device, self.cuda = device, device.type == "cuda"
        self.pools = {name: ThreadPoolExecutor(1, thread_name_prefix=name) for name in threads}
        self.streams = {name: torch.cuda.Stream(device) if self.cuda else None for name in streams}
        self.updater = CpuUpdater()
        self.failure: BaseException | None = None
        self.what, self.wake = what, wake

    def submit(self, thread: str, job: Callable[..., T], *args: Any) -> Future:
        """``job(*args)`` on ``thread``, with this worker's device current; its failure is kept (:meth:`fail`) and
        raised by the future too."""
        def run() -> T:
            try:
                if self.cuda:
                    torch.cuda.set_device(self.device)  # the thread's current device
                return job(*args)
            except BaseException as e:
                self.fail(e)
                raise
        return self.pools[thread].submit(run)

    def fail(self, e: BaseException) -> None:
        """Keep ``e`` unless a failure came first, and wake whoever waits on ``wake``."""
        if self.wake is None:
            self.failure = self.failure or e
            return
        with self.wake:
            self.failure = self.failure or e
            self.wake.notify_all()

    def check(self) -> None:
        """Raise on the dispatch thread what failed on a background thread (a copy, a CPU update)."""
        if self.failure is not None:
            raise RuntimeError(f"{self.what}: {type(self.failure).__name__}: {self.failure}") from self.failure
        self.updater.check()

    def sync(self) -> None:
        """Wait for every queued CPU update, and surface a failure of any job."""
        self.updater.sync()
        self.check()

    def close(self) -> None:
        """Run what the threads have queued, then end them."""
        for pool in self.pools.values():
            pool.shutdown(wait=True)
        self.updater.close()


@contextlib.contextmanager
def traced(trace: StepTrace | None, track: str, name: str, stream: torch.cuda.Stream | None = None) -> Iterator[None]:
    """The block as a span of ``trace`` (if any) on ``track``: from its start to its end on ``stream`` (CUDA
    events), or on the host's clock."""
    start = trace.mark(stream) if trace is not None else None
    yield
    if trace is not None:
        trace.add(track, name, start, trace.mark(stream))


def copy_after(stream: torch.cuda.Stream | None, after: torch.cuda.Event | None, copy: Callable[[], T],
               trace: StepTrace | None = None, track: str = "", name: str = "") -> tuple[T, torch.cuda.Event | None]:
    """``copy()`` (tensor copies) on ``stream`` once ``after`` has happened there, as a span of ``trace`` on
    ``track``: its result and an event at its end. On the CPU (``stream`` None) it runs now, and the event is
    None."""
    if stream is None:
        with traced(trace, track, name):
            return copy(), None
    with torch.cuda.stream(stream):
        if after is not None:
            stream.wait_event(after)
        with traced(trace, track, name, stream):
            out = copy()
            done = torch.cuda.Event()
            done.record(stream)
    return out, done


def event_now(device: torch.device) -> torch.cuda.Event | None:
    """An event at the current stream's work so far (None on the CPU, where it has all run)."""
    if device.type != "cuda":
        return None
    e = torch.cuda.Event()
    e.record(torch.cuda.current_stream(device))
    return e


def batches_on(device: torch.device, ts: list[torch.Tensor]) -> list[torch.Tensor]:
    """A step's token ids (or targets) on ``device``, copied when the step begins: pinned and asynchronous on a
    GPU, where a copy from pageable memory first waits for the stream's queued work, so that the host would stall
    at every micro-batch; CPU workers use them as they are."""
    if device.type != "cuda":
        return ts
    return [t.pin_memory().to(device, non_blocking=True) for t in ts]
