"""Spans of one pipeline step on the simulator's tracks and the dispatch thread's, written as a Chrome trace
(Perfetto) by both pipeline runtimes; and the compute time of a step's forwards and backwards, which both report
beside the simulator's split."""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

from mobius.files import write_text_atomic

from partition.sim.timeline import TRACKS

log = logging.getLogger(__name__)


TRACE_TRACKS = (*TRACKS, "dispatch")  # the simulator's, then the dispatch thread's own time on each action but
# compute (host time: issuing copies, messages, the tied ends' sum, the reduce), which only the runtime draws


class StepTrace:
    """Spans of one step's work on the simulator's tracks (compute, h2d, d2h, cpu) and the dispatch thread's:
    CUDA events on the GPU (turned into times once the step has finished), ``perf_counter`` otherwise."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.t0 = time.perf_counter()
        self.spans: list[tuple[str, str, object, object]] = []
        self.lock = threading.Lock()
        if self.cuda:
            self.ref = torch.cuda.Event(enable_timing=True)
            self.ref.record(torch.cuda.current_stream(device))

    def mark(self, stream: "torch.cuda.Stream | None" = None) -> object:
        if self.cuda and stream is not None:
            e = torch.cuda.Event(enable_timing=True)
            e.record(stream)
            return e
        return time.perf_counter()

    def add(self, track: str, name: str, start: object, end: object) -> None:
        with self.lock:
            self.spans.append((track, name, start, end))

    def _seconds(self, m: object) -> float:
        if isinstance(m, float):
            return m - self.t0
        return self.ref.elapsed_time(m) / 1e3

    def events(self, pid: int) -> list[dict]:
        """Chrome-trace events (call after the step's work has finished)."""
        tracks = TRACE_TRACKS
        out = [{"name": "thread_name", "ph": "M", "pid": pid, "tid": t, "args": {"name": n}}
               for t, n in enumerate(tracks)]
        for track, name, a, b in self.spans:
            start, end = self._seconds(a), self._seconds(b)
            out.append({"name": name, "ph": "X", "ts": start * 1e6, "dur": max(0.0, end - start) * 1e6, "pid": pid,
                        "tid": tracks.index(track)})
        return out


class ComputeSpans:
    """A step's compute actions, each from after the waits for its inputs to its end on the compute stream
    (CUDA events, read once the step's work has finished; host time on the CPU), by phase and by what they
    compute (an action's kind and stage: its micro-batches should take one time)."""

    def __init__(self, device: torch.device):
        self.cuda, self.device = device.type == "cuda", device
        self.spans: dict[str, list[tuple[object, object]]] = {"forward": [], "backward": []}
        self.alike: dict[tuple[str, int], list[tuple[object, object]]] = {}  # (kind, stage) -> its spans
        self.last: tuple[object, object] | None = None  # the span added last (a step trace's compute span)
        self.host_s = 0.0  # the dispatch thread's time from each mark() to its add() (on a GPU: launching the work)
        self._marked = 0.0

    def mark(self) -> object:
        """Now on the compute stream: where an action's own work starts."""
        self._marked = time.perf_counter()
        return self._now()

    def _now(self) -> object:
        if not self.cuda:
            return time.perf_counter()
        e = torch.cuda.Event(enable_timing=True)
        e.record(torch.cuda.current_stream(self.device))
        return e

    def add(self, phase: str, start: object, kind: str, stage: int) -> None:
        """The action (``kind`` of ``stage``, or op) begun at ``start`` ends now (``phase``: forward; backward: FB,
        recompute, backward)."""
        self.last = (start, self._now())
        self.spans[phase].append(self.last)
        self.alike.setdefault((kind, stage), []).append(self.last)
        self.host_s += time.perf_counter() - self._marked

    def seconds(self, phase: str) -> float:
        return sum(self._durations(self.spans[phase]))

    def spread(self) -> float:
        """How much one compute's time varies inside the step: the standard deviation over the mean of the
        computes of one kind and stage, pooled over those with two or more (0 without any). The simulator draws
        each at the mean; a plan without slack pays every slow one at the next hand-over."""
        squares, free = 0.0, 0
        for spans in self.alike.values():
            times = self._durations(spans)
            mean = sum(times) / len(times)
            if len(times) > 1 and mean > 0:
                squares += sum((t / mean - 1.0) ** 2 for t in times)
                free += len(times) - 1
        return (squares / free) ** 0.5 if free else 0.0

    def stats(self, rank: int, world: int) -> dict[str, float]:
        """The step's compute for the sum over the workers: ``forward_s``, ``backward_s`` (their sums are the
        workers' total), ``launch_s``, ``compute_spread``, and each phase once per worker under ``forward_s@r``
        (``backward_s@r``): this worker's seconds under its rank, 0 under the others' (:func:`by_worker` reads
        them back from the sum)."""
        mine = {phase: self.seconds(phase) for phase in ("forward", "backward")}
        out = {f"{phase}_s": s for phase, s in mine.items()}
        out.update({f"{phase}_s@{r}": s if r == rank else 0.0 for phase, s in mine.items() for r in range(world)})
        return {**out, "launch_s": self.host_s, "compute_spread": self.spread()}

    def _durations(self, spans: list[tuple[object, object]]) -> list[float]:
        if not self.cuda:
            return [b - a for a, b in spans]
        if self.last is not None:
            self.last[1].synchronize()  # the latest end on the compute stream: every span has ended
        return [a.elapsed_time(b) / 1e3 for a, b in spans]


class HeldTrace:
    """A traced step's trace (``parallel.trace_step``), written when the step after it has run beside the traced
    step's CPU updates, so that the traced step is a steady one; at once when the traced step is the run's last
    (``last_step``, ``train.max_steps``). The step that writes it waits for the updates first (``write``: a collective,
    every worker calls it in the same step), so it is no steady step: :meth:`step_ran` says so."""

    def __init__(self, last_step: int):
        self.last_step = last_step
        self.held: tuple[StepTrace, int] | None = None  # the trace and its step (1-based)

    def step_ran(self, trace: StepTrace | None, step: int, write: Callable[[StepTrace, int], None]) -> bool:
        """Step ``step`` (0-based) has run, traced into ``trace`` or not: write the trace held from the step before,
        and hold this one (write it now, at the run's last step). Whether this step waited to write one."""
        waited = self.held is not None
        if self.held is not None:
            write(*self.held)
            self.held = None
        if trace is not None and step + 1 < self.last_step:
            self.held = (trace, step + 1)
        elif trace is not None:
            write(trace, step + 1)
            waited = True
        return waited


def by_worker(total: dict[str, float], world: int) -> dict[str, list[float]]:
    """Each worker's forward and backward seconds in rank order (``forward_by_worker``, ``backward_by_worker``),
    from the workers' summed :meth:`ComputeSpans.stats`."""
    return {f"{phase}_by_worker": [round(total[f"{phase}_s@{r}"], 4) for r in range(world)]
            for phase in ("forward", "backward")}


class DispatchTime:
    """The dispatch thread's time in one step, apart from its computes (``computed``): what held it (waits for
    uploads, reloads and its inputs, ``held_s``) and its own time on each action outside the two."""

    def __init__(self, computed: ComputeSpans):
        self.computed, self.held_s = computed, 0.0

    def held_since(self, t0: float) -> float:
        """The thread was held from ``t0`` until now: those seconds, counted."""
        held = time.perf_counter() - t0
        self.held_s += held
        return held

    def take(self, waiting: dict, key: tuple[str, int, int]) -> torch.Tensor:
        """The message whose receive was posted under ``key`` (taken out of ``waiting``), its wait for the sender
        and a CPU worker's copy out of the mailbox counted as held."""
        t0 = time.perf_counter()
        x = waiting.pop(key)()
        self.held_since(t0)
        return x

    def run(self, handler: Callable[[Any], None], action: Any) -> tuple[float, float, float]:
        """``handler(action)`` on the dispatch thread: its start, its end and the thread's own time in it."""
        t0, held, inside = time.perf_counter(), self.held_s, self.computed.host_s
        handler(action)
        t1 = time.perf_counter()
        return t0, t1, (t1 - t0) - (self.held_s - held) - (self.computed.host_s - inside)


def write_step_trace(trace: StepTrace, comm: Any, rank: int, device: torch.device, out_dir: str, step: int) -> None:
    """Gather every worker's spans of the traced step (a collective: every worker calls it) and write them as one
    Chrome trace, ``trace-step<step>.json`` in ``out_dir`` (rank 0), on one clock: each worker's spans from where
    the earliest worker began the step (``perf_counter`` is the host's monotonic clock, which the workers of one
    host share; a GPU's from its reference event, recorded when the worker began)."""
    events = trace.events(rank + 1)
    events.insert(0, {"name": "process_name", "ph": "M", "pid": rank + 1,
                      "args": {"name": f"worker {rank} ({device})"}})
    gathered = comm.all_gather_object((trace.t0, events))
    if rank == 0:
        origin = min(t0 for t0, _ in gathered)
        for t0, part in gathered:
            for e in part:
                if "ts" in e:
                    e["ts"] += (t0 - origin) * 1e6
        out = Path(out_dir) / f"trace-step{step}.json"
        write_text_atomic(out, json.dumps({"traceEvents": [e for _, part in gathered for e in part],
                                           "displayTimeUnit": "ms",
                                           "otherData": {"generator": "mobius runtime", "step": step}}))
        log.info("wrote %s (open it in https://ui.perfetto.dev)", out)
