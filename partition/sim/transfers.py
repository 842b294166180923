"""The workers' copies: each copy thread's uploads in order (each waiting for the weights it reads, the slot it
takes and, in a step's last round, the sums it brings up), inputs brought back from host memory, each download
stream's gradient downloads and input offloads in order, and activations and their gradients sent as soon as
they are produced: through host memory (two hops) unless the pair has peer access, in place on one worker."""

from __future__ import annotations

from typing import Callable

from partition.costs import ModelProfile, StageCost
from partition.hardware import Hardware
from partition.schedule import Kind, Schedule
from partition.sim.clock import Clock
from partition.sim.flows import Links
from partition.sim.gradient_sums import GradientSums
from partition.sim.updates import CpuUpdates
from partition.sim.worker_lists import Task, Worker


class Transfers:
    """The copy threads and download streams of every worker, and what has arrived for their computes."""

    def __init__(self, profile: ModelProfile, costs: list[StageCost], hw: Hardware, sched: Schedule, clock: Clock,
                 links: Links, updates: CpuUpdates, sums: GradientSums, workers: list[Worker]):
        self.profile, self.costs, self.hw, self.sched, self.clock = profile, costs, hw, sched, clock
        self.links, self.updates, self.sums, self.workers = links, updates, sums, workers
        self.grad_bytes = sched.options.grad_bytes
        self.tie_pending: dict[int, tuple[int, int, int]] = {}  # worker -> (step, occupancy, order) of its stage 0's
        # backward upload whose weights are up: the head's end of the tied gradient follows (start_tie_in)
        self.new_step()

    def new_step(self) -> None:
        self.arrived: dict[tuple[str, int, int], float] = {}  # ("a" | "g" | "k", stage, micro) -> when it arrived
        self.kept_at: dict[tuple[int, int], float] = {}  # (unit, micro) -> its input is in host memory

    # ---- uploads -------------------------------------------------------------------------------
    def start_upload(self, w: Worker) -> bool:
        if w.uploading or w.ui >= len(w.lists.uploads) or w.upload_held == (w.ui, self.clock.unheld):
            return False  # (nothing it waited for has changed since)
        task, step = w.lists.uploads[w.ui], self.clock.step
        if not all(self.updates.weights_ready(d, step + task.tstep) for d in self.sched.update_deps(task.stage)):
            return self._held(w)  # a CPU update of its weights is pending
        order = step * 10**6 + self.sched.upload_rank(task.stage, task.phase, task.round)
        param_bytes = self.costs[task.stage].param_bytes
        if task.kind == Kind.PREFETCH:  # into the buffer: it waits for no slot
            nbytes = min(float(self.sched.options.prefetch_bytes), param_bytes)
            w.prefetched[task.occ] = nbytes
            done: Callable[[float], None] = lambda t, w=w: setattr(w, "uploading", False)
        elif task.occ >= self.sched.num_slots and task.occ - self.sched.num_slots not in w.released:
            return self._held(w)  # the slot it takes is still in use
        else:  # what the buffer does not hold (its part moves into the slot on the device: not a transfer)
            sums = self.sched.sums_up(task.stage, task.round)
            if sums and not self.sums.rounds_before_summed(task):
                return self._held(w)  # it brings the step's earlier rounds of its gradient sums up: not all down yet
            nbytes = param_bytes - w.prefetched.pop(task.occ, 0.0)
            if task.reload:
                nbytes += len(self.sched.reload_micros(task.stage, task.round)) * self.costs[task.stage].in_bytes
            if sums:
                nbytes += 4.0 * self.costs[task.stage].trainable_count
            done = lambda t, w=w, occ=task.occ: self._upload_done(w, occ, t)
            if self.sched.tie_in and task.stage == 0 and task.phase == "b":  # the copy thread then brings the
                # head's end of the tied weight's gradient up, once it is down (start_tie_in)
                done = lambda t, w=w, key=(step + task.tstep, task.occ, order): self.tie_pending.update({w.w: key})
        w.uploading = True
        w.ui += 1
        self.links.h2d(w.gpu, f"{task.kind.value}{task.phase}{task.stage}", "upload", nbytes, (1, order), done)
        return True

    def _held(self, w: Worker) -> bool:
        """``w``'s next upload waits: it is not looked at again until something it may wait for changes."""
        w.upload_held = (w.ui, self.clock.unheld)
        return False

    def start_tie_in(self, w: Worker) -> bool:
        """Stage 0's weights are up: the head's end of the tied weight's gradient follows once it is down, and the
        copy thread waits for it (one worker holds both ends: ``Schedule.tie_in``)."""
        if w.w not in self.tie_pending or (self.tie_pending[w.w][0], self.sched.num_stages - 1) not in \
                self.sums.downloaded:
            return False
        _, occ, order = self.tie_pending.pop(w.w)
        self.links.h2d(w.gpu, "T0", "upload", self.grad_bytes * self.profile.tied_params, (1, order),
                       lambda t, w=w, occ=occ: self._upload_done(w, occ, t))
        return True

    def start_reloads(self, w: Worker) -> bool:
        """Bring back, in order, each micro-batch input a backward needs once its occupancy is uploaded and a
        forward has put the input in host memory (several may be in flight)."""
        started = False
        while w.ri < len(w.lists.reloads):
            task = w.lists.compute[w.lists.reloads[w.ri]]
            if task.occ not in w.upload_done or (task.unit, task.micro) not in self.kept_at:
                break
            key = ("k", task.stage, task.micro)

            def back(t: float, key: tuple = key, w: Worker = w) -> None:
                self.arrived[key], w.woken = t, True

            self.links.h2d(w.gpu, f"L{task.stage}.{task.micro}", "ckpt", self.profile.units[task.unit].in_bytes, (0,),
                           back)
            w.ri += 1
            started = True
        return started

    def _upload_done(self, w: Worker, occ: int, t: float) -> None:
        w.uploading, w.woken = False, True
        w.upload_done[occ] = t
        self.updates.upload_read(w.w, occ)

    # ---- downloads -----------------------------------------------------------------------------
    def start_d2h(self, w: Worker) -> bool:
        if w.downloading or w.di >= len(w.lists.d2h) or w.di not in w.d2h_ready:
            return False
        if not self.clock.due(w.d2h_ready[w.di]):
            return False
        task = w.lists.d2h[w.di]
        if task.kind == Kind.DOWNLOAD and self.updates.reading_gradients(task.stage, self.clock.step + task.tstep):
            return False  # the previous step's update still reads the stage's one gradient buffer
        if (task.kind == Kind.DOWNLOAD and self.sched.download_work(task.round) > 0
                and self.sums.staging_full(w.w)):
            return False  # a middle round's sums come down into a staging buffer; all of them wait to be added
        w.downloading = True
        w.di += 1
        if task.kind == Kind.DOWNLOAD:
            nbytes = self.grad_bytes * self.costs[task.stage].trainable_count  # fp32 sums or half
            self.links.d2h(w.gpu, f"G{task.stage}", "grad", nbytes, (2, self.sched.num_stages - task.stage),
                           lambda t, w=w, task=task: self._grad_down(w, task, t))
        else:
            nbytes = self.costs[task.stage].in_bytes if task.unit < 0 else self.profile.units[task.unit].in_bytes
            self.links.d2h(w.gpu, f"ckpt{task.stage}.{task.micro}", "ckpt", nbytes, (3, task.stage),
                           lambda t, w=w, task=task: self._offloaded(w, task, t))
        return True

    def _offloaded(self, w: Worker, task: Task, t: float) -> None:
        w.downloading = False
        self.kept_at[(task.unit, task.micro)] = t

    def _grad_down(self, w: Worker, task: Task, t: float) -> None:
        """A gradient's copy is down: the download engine and the slot are free; the summing thread's host work
        on it follows (:meth:`GradientSums.grad_down`)."""
        w.downloading = False
        w.released[task.occ] = t  # the slot is reused only after the copy has read it
        self.clock.unheld += 1
        self.sums.grad_down(w.w, task, t)

    # ---- activations ---------------------------------------------------------------------------
    def send(self, w: Worker, src: int, dst: int, m: int, backward: bool) -> None:
        """Stage ``src``'s output for micro-batch ``m`` (``backward``: its input's gradient) to stage ``dst``."""
        if not 0 <= dst < self.sched.num_stages:
            return
        key = ("g" if backward else "a", dst, m)
        sc = self.costs[src]
        nbytes = sc.in_bytes if backward else sc.out_bytes
        dst_w = self.workers[self.sched.worker_for(dst, m)]
        if dst_w is w or nbytes == 0:
            self.arrived[key], dst_w.woken = self.clock.t, True
            return
        name = f"{key[0]}{src}>{dst}.{m}"
        w.pending_sends += 1

        def arrived(t: float) -> None:
            self.arrived[key], dst_w.woken = t, True
            w.pending_sends -= 1

        if self.hw.p2p_rate(w.gpu, dst_w.gpu):
            self.links.p2p(w.gpu, dst_w.gpu, name, nbytes, arrived)
        else:
            self.links.d2h(w.gpu, name, "act", nbytes, (0,),
                           lambda t: self.links.h2d(dst_w.gpu, name, "act", nbytes, (0,), arrived))
