"""The host's CPU and memory, shared by the workers' threads: each worker's optimizer thread (CPU AdamW, compute
copies) and summing thread (a middle round's gradient sums added into the host sum) run, while ``k`` of them work
at once, at ``Hardware.cpu_update_rate(updating=k)`` each, a worker's update pausing while its summing thread
adds; CPU workers' compute and copies share the host's ``Hardware.host_cores`` with them."""

from __future__ import annotations

import math
from dataclasses import dataclass

from partition.hardware import Hardware
from partition.sim.clock import Clock
from partition.sim.flows import Flow
from partition.sim.worker_lists import Worker


@dataclass
class HostThread:
    """A worker's thread of host work, timed by its share of the host: the job it runs (None: idle), when that
    began, its work left (parameters' worth of updates), its rate and when it ends at that rate."""

    running: object | None = None
    start: float = 0.0
    left: float = 0.0
    rate: float = 0.0
    busy: float | None = None

    def begin(self, job: object, work: float, t: float) -> None:
        """Run ``job`` of ``work`` from ``t`` (timed by :meth:`Host.share`)."""
        self.running, self.start, self.left, self.busy = job, t, work, t

    def due(self, clock: Clock) -> bool:
        return self.busy is not None and clock.due(self.busy)

    def end(self) -> None:
        self.running, self.busy = None, None


class Host:
    """Each worker's optimizer and summing threads, and the rates the host's CPU and memory give them."""

    def __init__(self, hw: Hardware, half_grads: bool, clock: Clock, workers: int):
        self.hw, self.half_grads, self.clock = hw, half_grads, clock
        self.updating = [HostThread() for _ in range(workers)]  # each worker's optimizer thread
        self.summing = [HostThread() for _ in range(workers)]  # each worker's summing thread

    def share(self, workers: list[Worker], flows: list[Flow]) -> None:
        """The running CPU updates' and summing threads' rates: each one's share of the host while this many
        work on its memory; a worker's update pauses while its summing thread adds (the sums hold up downloads and
        slots, the update only the next step). CPU workers' compute shares the host's cores with them too
        (:meth:`_share_cores`)."""
        t, n_workers = self.clock.t, len(self.updating)
        adding = [w for w in range(n_workers) if self.summing[w].running is not None]
        running = [w for w in range(n_workers) if self.updating[w].running is not None]
        paused = [w for w in running if self.summing[w].running is not None]  # a worker's update yields to its sums
        n = len(running) - len(paused) + len(adding)
        rate = self.hw.cpu_update_rate(self.half_grads, updating=n) if n else 0.0
        for w in running:
            th = self.updating[w]
            th.rate = 0.0 if w in paused else rate
            th.busy = math.inf if w in paused else t + th.left / rate
        for w in adding:
            th = self.summing[w]
            th.rate = rate
            th.busy = t + th.left / rate
        if self.hw.host_cores:
            self._share_cores(n, workers, flows)

    def _share_cores(self, host_jobs: int, workers: list[Worker], flows: list[Flow]) -> None:
        """CPU workers: every thread that wants the host's cores gets its share of them, cores / wanted: the
        workers' computes and copies (every transfer is a memory copy on a worker's thread) run at that share of
        their speed, beside ``host_jobs`` CPU updates and sums (whose rates are measured inside steps, so kept);
        each of them runs on ``Hardware.worker_threads`` threads."""
        computing = [w for w in workers if w.running is not None and w.comp_left > 0]
        copies = sum(1 for f in flows if f.base > 0)  # (each flow's rate on its links alone: Links.allocate)
        demand = (len(computing) + copies + host_jobs) * self.hw.worker_threads
        rate = min(1.0, self.hw.host_cores / demand) if demand else 1.0
        t = self.clock.t
        for w in computing:
            w.comp_rate, w.comp_end = rate, t + w.comp_left / rate
            w.busy_until = w.comp_end + w.running[2]
        for f in flows:
            f.rate = f.base * rate

    def advance(self, dt: float) -> None:
        """``dt`` seconds of every running thread's work."""
        for th in self.updating + self.summing:
            if th.running is not None:
                th.left = max(0.0, th.left - th.rate * dt)

    def ends(self) -> list[float]:
        """When each busy thread's job ends."""
        return [th.busy for th in self.updating + self.summing if th.busy is not None]
