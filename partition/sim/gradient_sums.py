"""Gradients once they are down: each worker's summing thread adds a middle round's sums into the host sum
(round-robin), a stage's last download of a step queues its update, a tied weight's two ends are summed once both
are down (``TIE``), and a program's step reduces once all its gradients are."""

from __future__ import annotations

import math

from partition.costs import StageCost
from partition.schedule import Schedule
from partition.sim.clock import Clock
from partition.sim.host_sharing import HostThread
from partition.sim.recorder import Recorder
from partition.sim.updates import CpuUpdates
from partition.sim.worker_lists import Task, Worker, downloads_per_step

STAGING = 1  # a worker's pinned buffers that a middle round's gradient sums come down into, to wait to be added


class GradientSums:
    """The summing threads (:attr:`threads`, timed by the host's share) and what each step's gradients have
    reached: downloads summed per stage, the tied ends' sum, a program's steps reduced and ended."""

    def __init__(self, costs: list[StageCost], sched: Schedule, threads: list[HostThread], tie_s: float,
                 clock: Clock, recorder: Recorder, updates: CpuUpdates, workers: list[Worker]):
        self.costs, self.sched, self.threads, self.tie_s = costs, sched, threads, tie_s
        self.clock, self.recorder, self.updates, self.workers = clock, recorder, updates, workers
        self.program = sched.steps > 1  # one list of several steps (round-robin): no per-step restart
        self.queue: list[list[tuple[Task, float]]] = [[] for _ in workers]  # a worker's summing thread: the host
        # work on gradients that are down (round-robin: a middle round's sums added into the host sum), in updates of
        # their parameters, in download order
        self.downloads_due = downloads_per_step(sched)  # (step, stage) -> downloads before its update
        self.downloads_done: dict[tuple[int, int], int] = {}
        self.step_end: dict[int, float] = {}  # the last compute or download of each step of a program
        self.step_left = {s: sum(n for (st, _), n in self.downloads_due.items() if st == s) for s in
                          range(sched.steps)}  # a program's downloads outstanding per step (its barrier)
        self.reduced_steps: set[int] = set()  # a program's steps whose gradients are all down
        self.tie_at: dict[int, float] = {}  # step -> when its tied ends' gradients are summed
        self.new_step()

    def new_step(self) -> None:
        self.downloaded: dict[tuple[int, int], float] = {}  # (step, stage) -> its last download of the step
        self.tie_check = True  # a download landed since start_tie last looked

    # ---- a gradient down -------------------------------------------------------------------------
    def grad_down(self, w: int, task: Task, t: float) -> None:
        """A gradient's copy is down on worker ``w``: the summing thread's host work on it follows, if any
        (:meth:`summed` once it is done)."""
        work = self.sched.download_work(task.round) * self.costs[task.stage].trainable_count
        if work <= 0:
            self.summed(w, task, t)
        else:
            self.queue[w].append((task, work))

    def staging_full(self, w: int) -> bool:
        """Whether worker ``w``'s staging buffers all hold sums that wait to be added."""
        return len(self.queue[w]) + (self.threads[w].running is not None) >= STAGING

    def start(self) -> bool:
        """Each summing thread takes its next gradient once the op's rounds before it are summed."""
        started = False
        for w, thread in enumerate(self.threads):
            if thread.running is not None or not self.queue[w]:
                continue
            task, work = self.queue[w][0]
            if not self.rounds_before_summed(task):
                continue
            self.queue[w].pop(0)
            thread.begin(task, work, self.clock.t)
            started = True
        return started

    def rounds_before_summed(self, task: Task) -> bool:
        """The rounds of ``task``'s step before its own are down and summed for its stage (round-robin)."""
        return self.downloads_done.get((self.clock.step + task.tstep, task.stage), 0) >= task.round % self.sched.rounds

    def complete(self, w: int) -> None:
        """Worker ``w``'s summing thread ends its sums if they are due."""
        thread = self.threads[w]
        if not thread.due(self.clock):
            return
        task, start = thread.running, thread.start
        self.recorder.event(-1, "cpu", f"sum{task.stage}", start, self.clock.t, "sum")
        thread.end()
        self.summed(w, task, self.clock.t)

    def summed(self, w: int, task: Task, t: float) -> None:
        """A gradient is down and summed; the stage's last of the step queues its update (without a barrier)."""
        step = self.clock.step + task.tstep
        key = (step, task.stage)
        self.downloads_done[key] = self.downloads_done.get(key, 0) + 1
        self.clock.unheld += 1
        self.mark_end(task.tstep, t)
        if self.program:
            self.step_left[task.tstep] -= 1
        if self.downloads_done[key] < self.downloads_due[(task.tstep, task.stage)]:
            return  # round-robin: earlier rounds' gradients are summed in host memory
        self.downloaded[key] = t
        self.tie_check = True
        self.updates.gradients_down(w, step, task.stage)

    def mark_end(self, tstep: int, t: float) -> None:
        """Step ``tstep`` of a program has work that ended at ``t``."""
        self.step_end[tstep] = max(self.step_end.get(tstep, 0.0), t)

    # ---- the tied weight and the step's end ------------------------------------------------------
    def start_tie(self) -> bool:
        """Once both ends of a tied weight are down in a step, their gradients are summed (``TIE``)."""
        if not self.sched.tied or not self.tie_check:
            return False
        self.tie_check = False
        started = False
        for step in range(self.clock.step, self.clock.step + self.sched.steps):
            if step in self.tie_at:
                continue
            ends = [(step, j) for j in self.sched.tie_ends]
            if not all(e in self.downloaded for e in ends):
                continue
            self.tie_at[step] = max(self.downloaded[e] for e in ends) + self.tie_s
            if not self.sched.barrier:
                self.updates.queue_step(self.workers, step, tied_only=True)
            started = True
        return started

    def tie_done(self, step: int) -> bool:
        """Whether ``step``'s tied ends are summed by now (true without a tied weight)."""
        tie = self.tie_at.get(step)
        return not self.sched.tied or (tie is not None and self.clock.due(tie))

    def program_reduces(self) -> bool:
        """A program's step reduces once all of its gradients are down (and summed where tied); with a
        barrier its updates follow then."""
        started = False
        for step, left in self.step_left.items():
            if left or step in self.reduced_steps:
                continue
            tie = self.tie_at.get(step, -math.inf if not self.sched.tied else None)
            if tie is None or not self.clock.due(tie):
                continue
            self.reduced_steps.add(step)
            if self.sched.barrier:
                self.updates.queue_step(self.workers, step)
            started = True
        return started

    def summing(self, w: int) -> bool:
        """Whether worker ``w``'s summing thread has sums queued or running."""
        return bool(self.queue[w]) or self.threads[w].running is not None

    def ends(self) -> list[float]:
        """When each tied sum not yet done will be."""
        return [t for t in self.tie_at.values() if not self.clock.due(t)]
