"""The host side of both runtimes: the optimizer thread, the end of a step, the statistics' sum.

* :class:`CpuUpdater` -- one thread that runs host-side AdamW jobs (a pipeline stage's
  :class:`~mobius.optim.FlatAdamW`, an offloaded zero chunk's) in the order they are queued, each
  once its gradients are in host memory, but a job queued ``first`` (under ``train.update: delayed``
  the compute copy that the next step's uploads wait for) ahead of every other waiting job, as soon as
  what it comes ``after`` holds (the pipeline's: its stage's earlier updates have run); it times
  them, keeps the first failure for the dispatch thread to raise, and marks each job's store ready
  when done (or failed).
* :func:`sum_over_ranks` -- the step's named statistics summed over the ranks of a process group.
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
import time
from concurrent.futures import Future
from typing import Callable, Iterable, Protocol

import torch
import torch.distributed as dist


class Waitable(Protocol):
    """What a job waits for before it starts: a CUDA event of its gradients' copy."""

    def synchronize(self) -> None: ...


class Settable(Protocol):
    """What a job signals when it has finished or failed: an event, or several (``set`` them all)."""

    def set(self) -> None: ...


class Events:
    """Several events set as one (a job's end releases everything that waits on it)."""

    def __init__(self, *events: threading.Event):
        self.events = events

    def set(self) -> None:
        for e in self.events:
            e.set()


_UPDATE_CORES: frozenset[int] | None = None  # where this process's optimizer threads run (None: where the OS puts them)


def set_update_cores(cores: Iterable[int] | None) -> None:
    """Keep the optimizer threads this process starts from now on, and the torch threads their updates run on, on
    ``cores`` (``parallel.cpu_pinning``); None: wherever the OS places them. For the whole process, like
    ``torch.set_num_threads``."""
    global _UPDATE_CORES
    _UPDATE_CORES = frozenset(cores) if cores is not None else None


class CpuUpdater:
    """One optimizer thread: jobs run one at a time, in the order :meth:`submit` queues them (those queued
    ``first`` before the others that wait); on the cores :func:`set_update_cores` gave, where it gave some (the
    threads its AdamW's parallel loops start inherit them)."""

    def __init__(self) -> None:
        self.queue: queue.PriorityQueue = queue.PriorityQueue()  # (0 first / 1 / 2 stop, order, future, job,
        # after: a first job's condition to run, or None)
        self.order = itertools.count()
        self.thread = threading.Thread(target=self._serve, name="cpu-adam", daemon=True)
        self.thread.start()
        self.jobs: list[Future] = []
        self.failure: BaseException | None = None
        self._lock = threading.Lock()
        self._seconds = 0.0  # in updates since the last take(), waits for gradients excluded
        self._params = 0  # parameters those updates covered

    def submit(self, update: Callable[[], int], arrived: Waitable | None, done: Settable,
               on_timed: Callable[[float, float], None] | None = None, first: bool = False,
               after: Callable[[], bool] | None = None) -> None:
        """Queue ``update`` (it returns how many parameters it updated) to run once ``arrived`` has
        happened, after the jobs queued before it (``first``: before every job not queued ``first`` that has
        not begun, from the moment ``after()`` holds, which only jobs of this thread may make true);
        ``done`` is set when it has finished or failed; ``on_timed(start, end)`` reports its span (for a step
        trace)."""
        assert after is None or first, "only a job queued first waits for a condition"
        self.jobs = [j for j in self.jobs if not j.done()]
        job: Future = Future()
        self.queue.put((0 if first else 1, next(self.order), job, (update, arrived, done, on_timed), after))
        self.jobs.append(job)

    def _serve(self) -> None:
        if _UPDATE_CORES is not None:
            os.sched_setaffinity(0, _UPDATE_CORES)  # (Linux: the calling thread's)
        held: list[tuple] = []  # first jobs whose condition did not hold yet, in queue order
        while True:
            item = next((h for h in held if h[4]()), None)
            if item is not None:
                held.remove(item)
            else:
                item = self.queue.get()  # (a held job waits for a job of this thread: the queue holds one)
                if item[3] is None:
                    return
                if item[4] is not None and not item[4]():
                    held.append(item)
                    continue
            self._run(*item[3])
            item[2].set_result(None)

    def _run(self, update: Callable[[], int], arrived: Waitable | None, done: Settable,
             on_timed: Callable[[float, float], None] | None) -> None:
        t0, updated = time.perf_counter(), 0
        try:
            if arrived is not None:
                arrived.synchronize()
            t0 = time.perf_counter()
            updated = update()
            if on_timed is not None:
                on_timed(t0, time.perf_counter())
        except BaseException as e:  # raised by check() on the dispatch thread
            self.failure = self.failure or e
        finally:
            with self._lock:
                self._seconds += time.perf_counter() - t0
                self._params += updated
            done.set()

    def sync(self) -> None:
        """Wait for every queued job; raise the first failure."""
        for j in self.jobs:
            j.result()
        self.jobs = []
        self.check()

    def check(self) -> None:
        if self.failure is not None:
            raise RuntimeError(f"a CPU update failed: {type(self.failure).__name__}: {self.failure}") \
                from self.failure

    def take(self) -> tuple[float, int]:
        """Seconds spent in updates and parameters updated since the last call."""
        with self._lock:
            out = (self._seconds, self._params)
            self._seconds, self._params = 0.0, 0
            return out

    def close(self) -> None:
        """Run what is queued, then end the thread."""
        self.queue.put((2, next(self.order), None, None, None))
        self.thread.join()


def sum_over_ranks(stats: dict[str, float], group: dist.ProcessGroup | None = None) -> dict[str, float]:
    """Named statistics summed over the ranks (every rank reports the same names); one rank: as given."""
    names = sorted(stats)
    vec = torch.tensor([stats[k] for k in names], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(vec, group=group)
    return dict(zip(names, vec.tolist()))
