"""The workers' compute streams: each runs its compute actions in list order, each once its upload is done and
its input has arrived, for its stage's mean time (:class:`ComputeTimes`: or, in a simulation that draws them,
its step's factor of the device and its own), then the messages its dispatch thread posts after it; CPU workers'
computes share the host's cores (:class:`~partition.sim.host_sharing.Host`)."""

from __future__ import annotations

from partition.costs import ModelProfile, StageCost
from partition.hardware import Hardware
from partition.schedule import Kind, Schedule
from partition.sim.clock import EPS_T, Clock
from partition.sim.gradient_sums import GradientSums
from partition.sim.recorder import Recorder
from partition.sim.result import StageTiming
from partition.sim.transfers import Transfers
from partition.sim.worker_lists import Task, Worker
from partition.spread import compute_factor, worker_speeds

_KIND_CODE = {k: i for i, k in enumerate(Kind)}  # ints hash alike in every process (strings do not)


class ComputeTimes:
    """Seconds of each compute: its stage's unit times, in a draw (``draw`` >= 0, :func:`partition.simulate.
    with_spread`) times its step's factor of its device and its own."""

    def __init__(self, profile: ModelProfile, costs: list[StageCost], hw: Hardware, sched: Schedule,
                 worker_gpus: list[int], draw: int):
        self.profile, self.costs, self.hw, self.sched = profile, costs, hw, sched
        self.gpus, self.draw = worker_gpus, draw  # the seed of the speeds drawn at every step; -1: none
        self.program = sched.steps > 1
        self.speeds: dict[int, dict[int, float]] = {}  # a draw's: step -> each worker's device's factor (_speeds)

    def duration(self, task: Task, gpu: int, step: int) -> float:
        """Seconds of a compute task at full speed on device ``gpu`` in the simulation's ``step``: its stage's unit
        times, in a draw at its step's factor of the device and its own (:meth:`_drawn`)."""
        work = self._work(task)
        if self.draw < 0 or task.kind == Kind.DEVICE_UPDATE:
            return work
        step = task.tstep if self.program else step
        return work * self._speeds(step).get(gpu, 1.0) * self._drawn(task, step)

    def _speeds(self, step: int) -> dict[int, float]:
        """Each worker's device's factor in ``step`` of a draw (:func:`partition.spread.worker_speeds`)."""
        if step not in self.speeds:
            gpus = self.gpus
            self.speeds[step] = dict(zip(gpus, worker_speeds(self.draw, step, len(gpus), self.profile.worker_spread)))
        return self.speeds[step]

    def _drawn(self, task: Task, step: int) -> float:
        """The task's own factor in ``step`` of a draw (:func:`partition.spread.compute_factor`), keyed by the task's
        kind, stage, micro-batch and unit."""
        key = (self.draw, step // 2, _KIND_CODE[task.kind], task.stage, task.micro, task.unit)
        return compute_factor(self.profile.compute_spread, key, step)

    def _work(self, task: Task) -> float:
        sc = self.costs[task.stage]
        if task.kind in (Kind.FORWARD, Kind.RECOMPUTE):
            return sc.fwd_s
        if task.kind == Kind.BACKWARD and self.program:
            return sc.bwd_s + sc.acc_s - sc.fwd_s  # after its RECOMPUTE (round-robin)
        if task.kind == Kind.DEVICE_UPDATE:
            return sc.trainable_count / self.hw.device_adam_params_per_s
        if task.kind == Kind.BACKWARD and task.stage in self.sched.kept:
            return sc.bwd_s + sc.acc_s - sc.fwd_s  # the forward's graph was kept: no recompute
        return sc.bwd_s + sc.acc_s  # recompute + backward, or FB (no recompute); fp32 sums


class ComputeStreams:
    """Every worker's compute stream: starting a compute when it may, timing it, and what its end sets off."""

    def __init__(self, profile: ModelProfile, hw: Hardware, sched: Schedule, times: ComputeTimes, clock: Clock,
                 recorder: Recorder, transfers: Transfers, sums: GradientSums, workers: list[Worker]):
        self.profile, self.hw, self.sched, self.times, self.clock = profile, hw, sched, times, clock
        self.recorder, self.transfers, self.sums, self.workers = recorder, transfers, sums, workers
        self.program = sched.steps > 1
        self.M, self.N = sched.micro_batches, len(workers)

    def start(self, w: Worker) -> bool:
        """``w``'s next compute, if its upload is done and its input has arrived."""
        if w.busy_until is not None or w.ci >= len(w.lists.compute):
            return False
        task, t = w.lists.compute[w.ci], self.clock.t
        if task.occ >= 0 and task.occ not in w.upload_done:
            w.woken = False  # until its upload ends
            return False
        inputs = self._input_ready(task)
        if inputs is None:
            w.woken = False  # until an activation (or gradient) arrives for it
            return False
        if not self.clock.due(inputs):
            return False
        uploaded = w.upload_done[task.occ] if task.occ >= 0 else t
        start = max(t, uploaded)
        wait = max(0.0, uploaded - max(w.last_end, inputs))
        dur = self.times.duration(task, w.gpu, self.clock.step)
        posted = self.hw.message_s * w.lists.posts[w.ci]  # the dispatch thread's messages after it, and its own time
        if task.kind != Kind.DEVICE_UPDATE:  # on the action (CPU workers, learnt from their runs)
            posted += self.profile.action_s
        w.running, w.comp_left, w.comp_end = (task, start, posted), dur, start + dur
        w.busy_until = start + dur + posted
        tm = self.recorder.timing[task.stage]
        if self._opens(task):
            if task.kind in (Kind.BACKWARD, Kind.RECOMPUTE):
                tm.bwd_start = start - self.clock.step_start
            else:
                tm.fwd_start = start - self.clock.step_start
            tm.upload_wait_s += wait
        return True

    def _opens(self, task: Task) -> bool:
        """A stage's first compute of the reported step (round-robin: of each of its rounds there)."""
        if not self.program:
            return task.micro == 0
        return (task.tstep == self.sched.steps - 1 and task.micro % self.M % self.N == 0
                and task.kind != Kind.BACKWARD)  # a backward's round opens with its recompute

    def _input_ready(self, task: Task) -> float | None:
        arrived = self.transfers.arrived
        if task.kind == Kind.RECOMPUTE:  # its input brought back from host memory (token ids: none)
            return arrived.get(("k", task.stage, task.micro)) if task.unit >= 0 else self.clock.step_start
        if task.kind == Kind.BACKWARD:
            return arrived.get(("g", task.stage, task.micro))
        if task.stage == 0 or task.kind == Kind.DEVICE_UPDATE:
            return self.clock.step_start
        return arrived.get(("a", task.stage, task.micro))

    def complete(self) -> None:
        """End the computes (and the messages posted after them) that are due."""
        for w in self.workers:
            if w.busy_until is not None and self.clock.due(w.busy_until):
                w.busy_until, w.woken = None, True
                self._ended(w)
                self._done(w)

    def _ended(self, w: Worker) -> None:
        """The compute engine's events of the compute that has ended: the compute, then its posted messages."""
        task, start, posted = w.running
        end = w.comp_end
        if posted:
            self._event(w, task, f"m{task.stage}.{task.micro}", end, end + posted, "dispatch")
        if task.kind == Kind.DEVICE_UPDATE:
            self._event(w, task, f"Od{task.stage}", start, end, "dadam")
        else:
            cat = "bwd" if task.kind != Kind.FORWARD else "fwd"
            self._event(w, task, f"{task.kind.value}{task.stage}.{task.micro}", start, end, cat)
        w.running = None

    def _event(self, w: Worker, task: Task, name: str, start: float, end: float, cat: str) -> None:
        self.recorder.event(w.gpu, "compute", name, start, end, cat)
        if self.program and task.tstep == self.sched.steps - 1:
            self.recorder.busy[cat] += end - start

    def _done(self, w: Worker) -> None:
        """What the compute's end sets off: its output sent, its downloads ready, its slot freed."""
        task, t, rec = w.lists.compute[w.ci], self.clock.t, self.recorder
        j, m = task.stage, task.micro
        w.last_end = t
        rec.compute_end_s = max(rec.compute_end_s, t - self.clock.step_start)
        self.sums.mark_end(task.tstep, t)
        tm = rec.timing[j] if not self.program or task.tstep == self.sched.steps - 1 else StageTiming()
        if task.kind in (Kind.DEVICE_UPDATE, Kind.RECOMPUTE):
            pass
        elif task.kind == Kind.FORWARD:
            tm.fwd_end = t - self.clock.step_start
            self.transfers.send(w, j, self.sched.consumer(j, False), m, backward=False)
        else:
            tm.bwd_end = t - self.clock.step_start
            if task.kind == Kind.FB:
                tm.fwd_end = tm.bwd_end
            self.transfers.send(w, j, self.sched.consumer(j, True), m, backward=True)
        for k in w.lists.triggers.get(w.ci, []):
            w.d2h_ready[k] = t
        if w.ci in w.lists.release_at:
            w.released[w.lists.release_at[w.ci]] = t  # a forward occupancy frees its slot when it ends
            self.clock.unheld += 1
        w.ci += 1

    # ---- CPU workers: the host's cores ---------------------------------------------------------
    def ends(self) -> list[float]:
        """When each compute engine is free; on CPU workers also when each compute ends (it frees its cores)."""
        times = [w.busy_until for w in self.workers if w.busy_until is not None]
        if self.hw.host_cores:  # a compute's end frees its cores (the messages it posts follow)
            times += [w.comp_end for w in self.workers if w.running is not None and w.comp_left > 0]
        return times

    def advance(self, dt: float, t_next: float) -> None:
        """``dt`` seconds of each CPU worker's compute at its share of the cores (to ``t_next``)."""
        if not self.hw.host_cores:
            return
        for w in self.workers:
            if w.running is not None and w.comp_left > 0:
                w.comp_left = 0.0 if w.comp_end <= t_next + EPS_T else max(0.0, w.comp_left - w.comp_rate * dt)
