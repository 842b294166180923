"""The event loop: start what is ready on every worker's engines and the host's threads, share the links and the
host, jump to the next completion; step after step (or once through a program of several steps)."""

from __future__ import annotations

import math

from partition.costs import ModelProfile, StageCost
from partition.evaluate import GB, stage_exprs, tie_seconds
from partition.hardware import Hardware
from partition.schedule import Schedule
from partition.sim.clock import Clock
from partition.sim.compute_streams import ComputeStreams, ComputeTimes
from partition.sim.flows import Links, Sharing
from partition.sim.gradient_sums import GradientSums
from partition.sim.host_sharing import Host
from partition.sim.recorder import Recorder
from partition.sim.result import SimResult
from partition.sim.transfers import Transfers
from partition.sim.updates import CpuUpdates
from partition.sim.worker_lists import Worker
from partition.timing import PipelineShape, StageExprs, memory_peaks


def run_schedule(profile: ModelProfile, costs: list[StageCost], hw: Hardware, worker_gpus: list[int],
                 sched: Schedule, sharing: Sharing, record: bool, draw: int, steps: int) -> SimResult:
    """Simulate ``sched``'s lists (``costs``: its stages' or ops') on ``worker_gpus`` for ``steps`` steps (a program
    of several steps: once); the figures of the last. ``draw`` >= 0 draws the speeds at every step."""
    return Simulation(profile, costs, hw, worker_gpus, sched, sharing, record, draw).run(steps)


class Simulation:
    """One simulation's mechanisms, and the loop that drives them."""

    def __init__(self, profile: ModelProfile, costs: list[StageCost], hw: Hardware, worker_gpus: list[int],
                 sched: Schedule, sharing: Sharing, record: bool, draw: int = -1):
        self.profile, self.costs, self.hw, self.sched = profile, costs, hw, sched
        self.program = sched.steps > 1  # one list of several steps (round-robin): no per-step restart
        self.clock = Clock()
        self.workers = [Worker(w, worker_gpus[w], sched) for w in range(len(worker_gpus))]
        self.recorder = Recorder(hw, sched.num_stages, record, self.clock)
        self.links = Links(hw, sharing, self.clock)
        self.host = Host(hw, sched.options.grad_dtype == "half", self.clock, len(self.workers))
        self.updates = CpuUpdates(profile, costs, sched, self.host.updating, self.clock, self.recorder, self.workers)
        # the tied ends' sum on the host once both are down, unless one worker holds both (tie_in: on the device)
        tie_s = 0.0 if sched.tie_in else tie_seconds(profile, hw)
        self.sums = GradientSums(costs, sched, self.host.summing, tie_s, self.clock, self.recorder, self.updates,
                                 self.workers)
        self.transfers = Transfers(profile, costs, hw, sched, self.clock, self.links, self.updates, self.sums,
                                   self.workers)
        times = ComputeTimes(profile, costs, hw, sched, list(worker_gpus), draw)
        self.compute = ComputeStreams(profile, hw, sched, times, self.clock, self.recorder, self.transfers, self.sums,
                                      self.workers)
        self.step_ends: list[float] = []
        self._new_step()

    def _new_step(self) -> None:
        self.reduced = False
        self.transfers.new_step()
        self.sums.new_step()
        self.recorder.new_step()
        for w in self.workers:
            w.reset()
            w.last_end = self.clock.step_start

    def run(self, steps: int) -> SimResult:
        clock = self.clock
        if self.program:  # the lists hold every step
            self._loop()
            self._check_reduced()
            self.step_ends = [self.sums.step_end[s] for s in range(self.sched.steps)]
            return self.recorder.program_result(self.step_ends, self.sched.steps, len(self.workers))
        while clock.step < steps:
            self._loop()
            self._check_reduced()
            self.step_ends.append(clock.t)
            clock.step += 1
            clock.unheld += 1
            if clock.step < steps:
                clock.step_start = clock.t
                self._new_step()
        return self.recorder.result(self.step_ends, self._peaks())

    def _loop(self) -> None:
        while not self.reduced:
            while self._start_ready():
                pass
            if self._try_reduce():
                return
            self.links.allocate()
            self.host.share(self.workers, self.links.flows)
            t_next = self._next_time()
            assert t_next < math.inf, f"simulation stalled at {self.clock.t:.6f} s in step {self.clock.step}"
            self._advance(t_next)
            self._complete_due()

    def _check_reduced(self) -> None:
        for w in self.workers:
            assert w.ci == len(w.lists.compute) and w.ui == len(w.lists.uploads) and w.di == len(w.lists.d2h), w.w

    # ---- starting work -------------------------------------------------------------------------
    def _start_ready(self) -> bool:
        started = False
        transfers = self.transfers
        for w in self.workers:  # (an engine that is busy or has nothing left is skipped without a call)
            if not w.uploading and w.ui < len(w.lists.uploads):
                started |= transfers.start_upload(w)
            if transfers.tie_pending:
                started |= transfers.start_tie_in(w)
            if w.busy_until is None and w.ci < len(w.lists.compute) and w.woken:
                started |= self.compute.start(w)
            if not w.downloading and w.di in w.d2h_ready:
                started |= transfers.start_d2h(w)
            if w.ri < len(w.lists.reloads):
                started |= transfers.start_reloads(w)
        started |= self.sums.start_tie()
        if self.program:
            started |= self.sums.program_reduces()
        started |= self.updates.start(self.sums.tie_at)
        started |= self.sums.start()
        return started

    # ---- the end of a step ---------------------------------------------------------------------
    def _try_reduce(self) -> bool:
        """REDUCE: every worker has finished its step's work (and, without a barrier, its updates)."""
        for w in self.workers:
            if w.ci < len(w.lists.compute) or w.busy_until is not None or w.ui < len(w.lists.uploads) or w.uploading:
                return False
            if w.di < len(w.lists.d2h) or w.downloading or w.pending_sends or self.sums.summing(w.w):
                return False
            if not (self.sched.barrier or self.updates.delay) and self.updates.pending(w.w):
                return False
        if self.program:
            return self._reduce_program()
        if not self.sums.tie_done(self.clock.step):
            return False
        if any(f.kind == "act" for f in self.links.flows):
            return False
        self.reduced = True
        if self.sched.barrier:
            self.updates.queue_step(self.workers, self.clock.step)
        return True

    def _reduce_program(self) -> bool:
        """A program ends when every step has reduced and, in sync, every update has run."""
        if len(self.sums.reduced_steps) < self.sched.steps or self.links.flows:
            return False
        if not self.updates.delay and any(self.updates.pending(w.w) for w in self.workers):
            return False
        self.reduced = True
        return True

    # ---- time ----------------------------------------------------------------------------------
    def _next_time(self) -> float:
        times = self.compute.ends() + self.host.ends() + self.sums.ends() + self.links.ends()
        return max(min(times), self.clock.t) if times else math.inf

    def _advance(self, t_next: float) -> None:
        dt = t_next - self.clock.t
        self.host.advance(dt)
        self.compute.advance(dt, t_next)
        self.links.advance(dt, t_next)
        self.clock.t = t_next

    def _complete_due(self) -> None:
        self.links.complete(self.recorder.flow_done)
        self.compute.complete()
        for w in range(len(self.workers)):
            self.updates.complete(w)
            self.sums.complete(w)

    # ---- results -------------------------------------------------------------------------------
    def _peaks(self) -> list[int]:
        """Each GPU's memory peak: the memory model's of its workers."""
        half = self.profile.precision != "fp32"
        st: list[StageExprs] = [stage_exprs(c, half) for c in self.costs]
        shape = PipelineShape(self.sched.num_stages, len(self.workers), self.sched.micro_batches, self.sched.options,
                      self.profile.tied_params / GB * self.sched.tied)
        per_worker = memory_peaks(st, shape)
        out = [0] * self.hw.num_gpus
        for w in self.workers:
            out[w.gpu] = max(out[w.gpu], int(per_worker[w.w] * GB))
        return out
