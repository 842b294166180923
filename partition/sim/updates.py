"""The CPU updates: each worker's optimizer thread runs its stages' AdamW in order, as their gradients are down
(without a barrier; a tied weight's ends once their sum is) or after the step's REDUCE (with one), and, under
``train.update: delayed`` with one compute copy per stage (the swapped pipeline), each stage's copy of its
master into the copy the next step computes with, ahead of every update; and which weights an upload may read
(:meth:`CpuUpdates.weights_ready`)."""

from __future__ import annotations

from partition.costs import ModelProfile, StageCost, compute_copy_work, tie_copy_work
from partition.schedule import Kind, Schedule
from partition.sim.clock import Clock
from partition.sim.host_sharing import HostThread
from partition.sim.recorder import Recorder
from partition.sim.worker_lists import Worker


class CpuUpdates:
    """The workers' optimizer threads (:attr:`threads`, timed by the host's share), their queues and the updates
    and compute copies each stage has completed."""

    def __init__(self, profile: ModelProfile, costs: list[StageCost], sched: Schedule, threads: list[HostThread],
                 clock: Clock, recorder: Recorder, workers: list[Worker]):
        self.costs, self.sched, self.threads, self.clock, self.recorder = costs, sched, threads, clock, recorder
        N = len(workers)
        self.version = [0] * sched.num_stages  # updates each stage has completed
        self.copied = [0] * sched.num_stages  # delayed: compute copies taken (one per download, after it lands)
        # delayed, one compute copy per stage: each download queues the stage's copy from its master on its worker's
        # CPU ahead of every update (in CPU updates of the stage's parameters); several copies: none
        self.copy_work = compute_copy_work(profile.precision) if sched.options.delayed and sched.compute_copies == 1 \
            else 0.0
        self.delay = int(sched.options.delayed)  # train.update: delayed (see :meth:`weights_ready`)
        self.copies: list[list[tuple[int, int]]] = [[] for _ in range(N)]  # (step, stage) in order
        self.queue: list[list[tuple[int, int]]] = [[] for _ in range(N)]  # (step, stage) in order
        # a tied weight's end that the other end updates (one worker holds both: the embedding's store updates the
        # head's end; the round-robin's embedding end copies its result into the head's: tie_copies)
        self.tied_held = profile.tied_params if sched.tied and sched.tie_held is not None else 0
        self.tie_copy = profile.tied_params * tie_copy_work(profile.precision) if sched.tied and sched.tie_copies \
            else 0.0
        # delayed (one compute copy): per worker, each stage's last upload of the step -> the stage, whose copy
        # follows it
        self.refreshes = [{t.occ: t.stage for t in w.lists.uploads if t.kind == Kind.UPLOAD and self.copy_work
                           and sched.last_uploads[t.stage] == t.phase} for w in workers]

    def weights_ready(self, stage: int, step: int) -> bool:
        """Whether ``stage``'s weights for ``step`` are in its host copy. Sync: every earlier step's update has
        run. Delayed, with one compute copy per stage (the swapped pipeline): the previous step's compute copy
        taken (the runtime copies the master, one update old, into the compute copy on the worker's CPU thread,
        ahead of every update, once that step's last upload of the stage has read it and the stage's earlier
        updates have run: ``copy_work``), and a download waits until the update has read the stage's one
        gradient buffer (:meth:`reading_gradients`); with two copies of both that alternate by step (round-robin):
        the update before the previous one has run (it wrote its copy)."""
        if not self.delay:
            return self.version[stage] >= step
        if self.sched.compute_copies == 1:
            return self.copied[stage] >= step
        return self.version[stage] >= step - 1

    def reading_gradients(self, stage: int, step: int) -> bool:
        """Whether the previous step's update still reads ``stage``'s one gradient buffer, which ``step``'s download
        would write (delayed, one compute copy)."""
        return bool(self.delay) and self.sched.compute_copies == 1 and self.version[stage] < step

    def upload_read(self, w: int, occ: int) -> None:
        """Worker ``w``'s upload of occupancy ``occ`` has read its host copy: the step's last read of a delayed
        stage's copy queues its compute copy."""
        if occ in self.refreshes[w]:
            self.copies[w].append((self.clock.step, self.refreshes[w][occ]))

    def gradients_down(self, w: int, step: int, stage: int) -> None:
        """``stage``'s gradients of ``step`` are down and summed on worker ``w``: without a barrier its update is
        queued (a tied end's once both ends are summed, :meth:`queue_step`)."""
        if not self.copy_work:  # (delayed: the compute copy is queued at the step's last upload, upload_read)
            self.copied[stage] += 1
        if not self.sched.barrier and not self.tied_end(stage):
            self.queue[w].append((step, stage))

    def queue_step(self, workers: list[Worker], step: int, tied_only: bool = False) -> None:
        """Queue each worker's CPU updates of ``step`` (``tied_only``: of the stages that read both tied ends)."""
        for w in workers:
            self.queue[w.w] += [(step, j) for j in w.lists.updates_of(step) if not tied_only or self.tied_end(j)]

    def tied_end(self, j: int) -> bool:
        """Whether stage j's update reads both ends of the tied weight (and waits for their sum)."""
        return self.sched.tied and j in self.sched.tie_readers

    def start(self, tie_at: dict[int, float]) -> bool:
        """Each idle optimizer thread takes its next compute copy whose stage's earlier updates have run, else its
        next update (a tied end's once the ends' sum is done, ``tie_at``)."""
        started = False
        t = self.clock.t
        for w, thread in enumerate(self.threads):
            if thread.busy is not None:
                continue
            copy = self.copies[w] and next((c for c in self.copies[w] if self.version[c[1]] >= c[0]), None)
            if copy:  # a compute copy goes ahead of every update (the next step's upload waits for it),
                # once the stage's earlier updates have run
                self.copies[w].remove(copy)
                step, j = copy
                thread.begin((step, j, True), self._cpu_params(j) * self.copy_work, t)
                started = True
                continue
            if not self.queue[w]:
                continue
            step, j = self.queue[w][0]
            tie = tie_at.get(step)
            if self.tied_end(j) and not self.sched.barrier and (tie is None or not self.clock.due(tie)):
                continue
            self.queue[w].pop(0)
            thread.begin((step, j, False), self._cpu_params(j), t)
            started = True
        return started

    def _cpu_params(self, j: int) -> float:
        """The parameters stage j's CPU update covers: a tied weight's end that the other end updates left out, and
        that end's copy into it counted (round-robin)."""
        return float(self.costs[j].trainable_count - (self.tied_held if j == self.sched.tie_held else 0)
                     + (self.tie_copy if j in self.sched.tie_readers else 0.0))

    def complete(self, w: int) -> None:
        """Worker ``w``'s update or compute copy ends if it is due."""
        thread = self.threads[w]
        if not thread.due(self.clock):
            return
        _, j, copy = thread.running
        self.recorder.event(-1, "cpu", f"{'copy' if copy else 'adam'}{j}", thread.start, self.clock.t, "adam")
        if copy:
            self.copied[j] += 1
        else:
            self.version[j] += 1
        self.clock.unheld += 1
        thread.end()

    def pending(self, w: int) -> bool:
        """Whether worker ``w`` has an update queued or running."""
        return bool(self.queue[w]) or self.threads[w].busy is not None
