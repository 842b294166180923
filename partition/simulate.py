"""Discrete-event simulation of the pipeline runtime: it interprets the very action lists the
executor dispatches (:mod:`partition.schedule`), over several consecutive steps.

Each worker has the engines the runtime has: a compute stream (compute actions in list order), a
copy thread (uploads in order, each waiting for the slot it takes to be released and for the
stage's previous update), a download stream (gradient downloads and offloaded boundary inputs in
order) and an optimizer thread (CPU updates in order; the workers' threads share the host: while
``k`` update at once each runs at ``Hardware.cpu_update_rate(updating=k)``; CPU workers' compute shares the host's
``Hardware.host_cores`` with their copies, updates and sums). Activations and their gradients travel as
soon as they are produced: through host memory (two hops) unless the pair has peer access, or in
place when both stages are on one worker. A tied weight's two ends exchange gradients once both
are down (``TIE``), or, when one worker holds both, stage 0's backward upload brings the head's end's
gradient up (``Schedule.tie_in``) and its download is the sum; the step ends at ``REDUCE``, when every
worker has finished its transfers (and, without a barrier, its updates); the next step starts then.
With a barrier (clipping, fp16) the updates follow REDUCE in ascending stage order and overlap the
next step, whose uploads wait for them. The reported step time is the steady-state period (the last of ``steps`` steps).

Transfers are fluid flows over per-GPU links (host->GPU, GPU->host, optionally both together) and
per-root-complex capacities, which may depend on the number of concurrent streams (measured by
``mobius topo --bench``); uploads, gradient downloads, offloaded inputs and both hops of
host-staged activations all draw on them. Rates are set by priority classes, highest first, each class sharing
what is left max-min fairly: ``sharing="priority"`` (the runtime's per-root-complex upload
arbiter): activations first, then uploads in the order the stages start, then gradient downloads,
then input offloads; ``sharing="fair"``: everything shares equally.

Every compute takes its mean time, but in the step a plan reports (:func:`with_spread`): there each step draws each
worker's speed and each compute's around their means, with the spreads the runs on the machine measured.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from dataclasses import dataclass, field
from typing import Callable, Literal

from partition.costs import ModelProfile, StageCost, compute_copy_work, stage_costs, tie_copy_work
from partition.evaluate import GB, PipelineOptions, stage_exprs, tie_seconds
from partition.hardware import Hardware
from partition.schedule import COMPUTE, Kind, Schedule, build_schedule
from partition.spread import SPREAD_STEPS, compute_factor, mean_period, worker_speeds
from partition.timing import Shape, StageExprs, memory_peaks

Sharing = Literal["priority", "fair"]
_EPS_BYTES = 1e-3
_EPS_T = 1e-12
STAGING = 1  # a worker's pinned buffers that a middle round's gradient sums come down into, to wait to be added


@dataclass
class SimEvent:
    """One span on the timeline. ``gpu`` is the physical GPU, or -1 for the CPU."""

    gpu: int
    track: str  # compute | h2d | d2h | p2p | cpu
    name: str
    start: float
    end: float
    cat: str  # fwd | bwd | upload | act | grad | ckpt | adam | dadam | sum (a summing thread's host work) | dispatch
    nbytes: float = 0.0  # what a transfer moved


@dataclass
class StageTiming:
    """When a stage ran in the reported step, and how long its compute waited for its uploads."""

    fwd_start: float = math.nan
    fwd_end: float = math.nan
    bwd_start: float = math.nan
    bwd_end: float = math.nan
    upload_wait_s: float = 0.0


@dataclass
class SimResult:
    """Outcome of simulating a run of steps (figures of the last, steady-state step)."""

    step_s: float
    compute_end_s: float
    peak_bytes: list[int]  # per physical GPU (the memory model's peak of its worker)
    h2d_bytes: list[float]  # per GPU, host->GPU (stage uploads, checkpoints, activation second hops)
    d2h_bytes: list[float]  # per GPU, GPU->host (gradients, activation first hops, checkpoint offloads)
    p2p_bytes: list[float]  # per GPU, sent peer-to-peer
    rc_h2d_bytes: list[float]  # per root complex
    rc_d2h_bytes: list[float]
    bytes_by_kind: dict[str, float]
    stages: list[StageTiming]
    events: list[SimEvent] = field(repr=False, default_factory=list)
    gpu_names: list[str] = field(default_factory=list)
    step_ends: list[float] = field(default_factory=list)  # REDUCE time of every simulated step
    busy_s: dict[str, float] | None = None  # a program's compute and upload waits in its reported step per GPU, by
    # event category (its events are the step's period, which with a delayed update holds part of the step before's
    # compute instead of the next step's)
    spread_s: float = 0.0  # of ``step_s``, what the workers' and the computes' speeds varying add (:func:`with_spread`;
    # the time split counts it as idle: a hand-over waits for the slower side)

    def total_bytes(self) -> float:
        """All bytes moved over host links (P2P counted once)."""
        return sum(self.h2d_bytes) + sum(self.d2h_bytes) + sum(self.p2p_bytes)

    def time_split(self) -> dict[str, float]:
        """Where the reported step's time goes, in seconds per GPU averaged over the GPUs that compute:
        forward, backward (recompute included), device AdamW, the dispatch thread's messages and own time
        (``Hardware.message_s``, ``ModelProfile.action_s``), waiting for uploads, and idle (pipeline
        fill and drain, waiting for activations); ``tail``: the step's end after the last compute
        (global norm, CPU AdamW, reduce). Needs the recorded events (``record=True``), but for a program's."""
        busy = self.busy_s
        if busy is None:
            n = max(len({e.gpu for e in self.events if e.track == "compute"}), 1)
            busy = {"fwd": 0.0, "bwd": 0.0, "dadam": 0.0, "dispatch": 0.0,
                    "upload_wait": sum(t.upload_wait_s for t in self.stages) / n}
            for e in self.events:
                if e.track == "compute":
                    busy[e.cat] += (e.end - e.start) / n
        split = {"forward": busy["fwd"], "backward": busy["bwd"], "device_adamw": busy["dadam"],
                 "dispatch": busy["dispatch"], "upload_wait": busy["upload_wait"]}
        split["idle"] = max(0.0, self.compute_end_s + self.spread_s - sum(split.values()))
        split["tail"] = max(0.0, self.step_s - self.spread_s - self.compute_end_s)
        return split

    def to_ascii(self, width: int = 100) -> str:
        """The timeline as a text grid: per GPU a compute row and its two link rows, then the CPU."""
        return _ascii(self, width)

    def to_chrome_trace(self) -> dict:
        """The timeline in Chrome trace format (open in https://ui.perfetto.dev)."""
        return _chrome_trace(self)

    def write_chrome_trace(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_chrome_trace(), f)


def simulate(profile: ModelProfile, boundaries: list[int], hardware: Hardware, worker_gpus: list[int] | None = None,
             micro_batches: int = 4, options: PipelineOptions = PipelineOptions(), sharing: Sharing = "priority",
             record: bool = True, steps: int = 3, draw: int = -1) -> SimResult:
    """Simulate ``steps`` training steps of the partition ``boundaries``; report the last one. ``draw`` (>= 0): the
    seed of the workers' and computes' speeds drawn at every step (:func:`with_spread`); -1: all at their means.

    ``worker_gpus[s]`` is the physical GPU of worker ``s``; stage ``j`` runs on worker ``j % len(worker_gpus)``
    (default: GPUs 0..N-1 in order).
    """
    costs = stage_costs(profile, boundaries)
    worker_gpus = list(range(hardware.num_gpus)) if worker_gpus is None else list(worker_gpus)
    worker_gpus = worker_gpus[:len(costs)]  # fewer stages than GPUs leave the last ones idle
    N, S = len(worker_gpus), len(costs)
    sched = build_schedule(S, N, micro_batches, [j % N for j in range(S)], options, profile.tied_params > 0 and S > 1)
    return _Sim(profile, costs, hardware, worker_gpus, sched, sharing, record, draw).run(steps)


_KIND_CODE = {k: i for i, k in enumerate(Kind)}  # ints hash alike in every process (strings do not)


def with_spread(nominal: SimResult, profile: ModelProfile, run: Callable[[int, int], SimResult]) -> SimResult:
    """``nominal`` (``profile``'s step simulated) with the step it reports when each worker's speed varies from step
    to step by ``profile.worker_spread`` and each compute's inside a step by ``profile.compute_spread``: one seeded
    simulation of :data:`SPREAD_STEPS` steps (``run(steps, draw)``: ``profile``'s, unrecorded) in which every step
    draws each worker's factor and each compute's (:meth:`_Sim._speeds`, :meth:`_Sim._drawn`), the mean period of its
    steps after the first two; the difference from the nominal step in ``spread_s``. ``nominal`` itself without
    either spread."""
    if profile.worker_spread <= 0 and profile.compute_spread <= 0:
        return nominal
    extra = mean_period(run(SPREAD_STEPS, 0).step_ends) - nominal.step_s
    return dataclasses.replace(nominal, step_s=nominal.step_s + extra, spread_s=extra)


# ---------------------------------------------------------------------------------------------
# The simulation state
# ---------------------------------------------------------------------------------------------
@dataclass
class _Flow:
    label: str
    kind: str  # upload | act | grad | ckpt
    total: float
    resources: tuple
    cap: float
    prio: tuple
    on_done: Callable[[float], None]
    gpu: int
    track: str
    start: float
    done: float = 0.0
    rate: float = 0.0
    base: float = 0.0  # its rate on its links (CPU workers: times the share of the cores it gets, _share_cores)

    def __post_init__(self) -> None:
        self.distinct = len(set(self.resources)) == len(self.resources)  # each link once (_fill's short way)

    def remaining(self) -> float:
        return self.total - self.done


@dataclass
class _Task:
    """One action of a worker's list, with what it waits for."""

    kind: Kind
    stage: int
    micro: int = -1
    phase: str = "f"
    occ: int = -1  # the occupancy (upload) it belongs to
    trigger: int = -1  # a d2h task: the compute task whose end produces its data
    reload: bool = False  # an upload followed by the stage's offloaded inputs (RELOAD, on the same copy thread)
    round: int = -1  # round-robin: the round of an upload or download
    unit: int = -1  # round-robin: the unit whose input an OFFLOAD keeps
    tstep: int = 0  # the training step of the lists it belongs to (round-robin lists hold several)


class _Worker:
    """One worker's engines and the queues of the current step."""

    def __init__(self, w: int, gpu: int, sched: Schedule):
        self.w, self.gpu, self.sched = w, gpu, sched
        self.compute: list[_Task] = []  # compute stream: forwards, backwards, device AdamWs
        self.uploads: list[_Task] = []
        self.d2h: list[_Task] = []  # gradient downloads and input offloads, in issue order
        self.updates: dict[int, list[int]] = {}  # step -> stages with a CPU update after its REDUCE, in order
        self.reloads: list[int] = []  # compute tasks that first bring their input back from host memory
        self.posts: list[int] = []  # per compute task, the messages posted after it (set by the simulation)
        self.refreshes: dict[int, int] = {}  # occupancy -> stage whose compute copy may follow it (delayed)
        self._split(sched.actions[w])
        self.reset()

    def _split(self, actions: tuple) -> None:
        """The list's actions per engine. Device updates that follow REDUCE (a barrier) run on the
        compute stream before the next step's first forward: they open the step's compute list."""
        sched = self.sched
        occ_of = {(a.stage, a.phase, a.round): k for k, a in enumerate(x for x in actions if x.kind == Kind.UPLOAD)}
        rounds = sched.rounds
        opening: list[_Task] = []
        reduces, reload_unit = 0, -1
        for a in actions:
            tstep = max(a.round, 0) // rounds
            if a.kind in (Kind.UPLOAD, Kind.PREFETCH):
                self.uploads.append(_Task(a.kind, a.stage, phase=a.phase, occ=occ_of[(a.stage, a.phase, a.round)],
                                          round=a.round, tstep=tstep))
            elif a.kind == Kind.RELOAD and a.micro < 0:  # all of a stage's inputs, with its backward upload
                self.uploads[-1].reload = True
            elif a.kind == Kind.RELOAD:  # one micro-batch's input, before its backward (round-robin)
                reload_unit = a.unit
            elif a.kind in COMPUTE:
                r = sched.round_of(a.micro)
                phase = "b" if a.kind in (Kind.BACKWARD, Kind.RECOMPUTE) and (a.stage, "b", r) in occ_of else "f"
                self.compute.append(_Task(a.kind, a.stage, a.micro, occ=occ_of.get((a.stage, phase, r), -1),
                                          tstep=max(r, 0) // rounds, unit=reload_unit))
                if reload_unit >= 0:
                    self.reloads.append(len(self.compute) - 1)
                reload_unit = -1
            elif a.kind == Kind.OFFLOAD:
                self.d2h.append(_Task(a.kind, a.stage, a.micro, trigger=len(self.compute) - 1, unit=a.unit,
                                      tstep=self.compute[-1].tstep))
            elif a.kind == Kind.DOWNLOAD:
                self.d2h.append(_Task(a.kind, a.stage, occ=self.compute[-1].occ, trigger=len(self.compute) - 1,
                                      round=a.round, tstep=tstep))
            elif a.kind == Kind.UPDATE:
                self.updates.setdefault(max(reduces - 1, 0) if sched.barrier else 0, []).append(a.stage)
            elif a.kind == Kind.DEVICE_UPDATE:
                (opening if reduces else self.compute).append(_Task(a.kind, a.stage))
            reduces += a.kind == Kind.REDUCE
        self.compute = opening + self.compute
        for t in self.d2h:
            t.trigger += len(opening)
        downloaded = {t.occ for t in self.d2h if t.kind == Kind.DOWNLOAD}
        last = {t.occ: i for i, t in enumerate(self.compute) if t.occ >= 0}
        self.release_at = {i: occ for occ, i in last.items() if occ not in downloaded}  # compute -> occupancy freed
        self.triggers: dict[int, list[int]] = {}
        for k, t in enumerate(self.d2h):
            self.triggers.setdefault(t.trigger, []).append(k)

    def reset(self) -> None:
        self.ci = self.ui = self.di = self.ri = 0
        self.busy_until: float | None = None  # when the compute engine is free (its compute and posted messages)
        self.running: tuple[_Task, float, float] | None = None  # the compute in it: (task, start, posted seconds)
        self.comp_end = 0.0  # when that compute ends at its current rate
        self.comp_left = 0.0  # its seconds left at full speed (CPU workers share the host's cores: _share_cores)
        self.comp_rate = 1.0
        self.last_end = 0.0
        self.uploading = self.downloading = False
        self.upload_done: dict[int, float] = {}
        self.prefetched: dict[int, float] = {}  # occupancy -> bytes of it that wait in the prefetch buffer
        self.released: dict[int, float] = {}
        self.d2h_ready: dict[int, float] = {}  # d2h task -> time its data is produced
        self.pending_sends = 0
        self.woken = True  # something its next compute waits for may have happened since it last checked
        self.upload_held: tuple[int, int] | None = None  # (ui, _Sim.unheld) when its next upload last had to wait


class _Sim:
    """The event loop: start what is ready, share bandwidth, jump to the next completion."""

    def __init__(self, profile: ModelProfile, costs: list[StageCost], hw: Hardware, worker_gpus: list[int],
                 sched: Schedule, sharing: Sharing, record: bool, draw: int = -1):
        self.profile, self.costs, self.hw, self.sched = profile, costs, hw, sched
        self.grad_bytes = sched.options.grad_bytes
        self.half_grads = sched.options.grad_dtype == "half"
        self.sharing, self.record = sharing, record
        self.S, self.M, self.N = sched.num_stages, sched.micro_batches, len(worker_gpus)
        self.workers = [_Worker(w, worker_gpus[w], sched) for w in range(self.N)]
        self.draw = draw  # the seed of the speeds drawn at every step (with_spread); -1: none
        self.speeds: dict[int, dict[int, float]] = {}  # a draw's: step -> each worker's device's factor (_speeds)
        self.half = profile.precision != "fp32"
        self.t = 0.0
        self.flows: list[_Flow] = []
        self.flows_changed = False  # a flow started or ended since the rates were last set
        self.link_caps = {(d, g): rate for g in range(hw.num_gpus)  # each GPU's links, and the root complexes' with
                          for d, rate in (("h2d", hw.h2d_Bps[g]), ("d2h", hw.d2h_Bps[g]))  # one stream (_capacities)
                          + ((("bidir", hw.bidir_Bps[g]),) if hw.bidir_Bps else ())}
        for k in range(len(hw.groups)):
            self.link_caps[("rc_h2d", k)] = hw.rc_rate(k, "h2d", 1)
            self.link_caps[("rc_d2h", k)] = hw.rc_rate(k, "d2h", 1)
        self.step = 0
        self.step_start = 0.0
        self.step_ends: list[float] = []
        self.version = [0] * self.S  # updates each stage has completed
        self.copied = [0] * self.S  # delayed: compute copies taken (one per download, after it lands)
        self.unheld = 0  # counts what may let a waiting upload start (updates, copies, slots freed, sums, steps)
        # delayed, one compute copy per stage: each download queues the stage's copy from its master on its worker's
        # CPU ahead of every update (in CPU updates of the stage's parameters); several copies: none
        self.copy_work = compute_copy_work(profile.precision) if sched.options.delayed and sched.compute_copies == 1 \
            else 0.0
        self.copy_queue: list[list[tuple[int, int]]] = [[] for _ in range(self.N)]  # (step, stage) in order
        self.delay = int(sched.options.delayed)  # train.update: delayed (see :meth:`_weights_ready`)
        self.program = sched.steps > 1  # one list of several steps (round-robin): no per-step restart
        self.downloads_due = _downloads_per_step(sched)  # (step, stage) -> downloads before its update
        self.downloads_done: dict[tuple[int, int], int] = {}
        self.step_end: dict[int, float] = {}  # the last compute or download of each step of a program
        self.step_left = {s: sum(n for (st, _), n in self.downloads_due.items() if st == s) for s in
                          range(sched.steps)}  # a program's downloads outstanding per step (its barrier)
        self.opt_queue: list[list[tuple[int, int]]] = [[] for _ in range(self.N)]  # (step, stage) in order
        self.opt_busy: list[float | None] = [None] * self.N  # when the running update ends at its current rate
        self.opt_running: list[tuple[int, int, bool] | None] = [None] * self.N  # (step, stage, a compute copy)
        self.opt_left = [0.0] * self.N  # parameters the running update has left
        self.opt_rate = [0.0] * self.N  # its parameters per second: its share of the host (:meth:`_share_cpu`)
        self.opt_start = [0.0] * self.N
        self.add_queue: list[list[tuple[_Task, float]]] = [[] for _ in range(self.N)]  # a worker's summing thread:
        # the host work on gradients that are down (round-robin: a middle round's sums added into the host sum), in
        # updates of their parameters, in download order
        self.adding: list[tuple[_Task, float] | None] = [None] * self.N  # the running one, with its start
        self.add_left = [0.0] * self.N  # (in updates of its parameters; timed like the CPU updates)
        self.add_busy: list[float | None] = [None] * self.N
        self.add_rate = [0.0] * self.N
        self.reduced_steps: set[int] = set()  # a program's steps whose gradients are all down
        self.tie_at: dict[int, float] = {}  # step -> when its tied ends' gradients are summed
        # the tied ends' sum on the host once both are down, unless one worker holds both (tie_in: on the device)
        self.tie_s = 0.0 if sched.tie_in else tie_seconds(profile, hw)
        self.tie_pending: dict[int, tuple[int, int, int]] = {}  # worker -> (step, occupancy, order) of its stage 0's
        # backward upload whose weights are up: the head's end of the tied gradient follows (_start_tie_in)
        # a tied weight's end that the other end updates (one worker holds both: the embedding's store updates the
        # head's end; the round-robin's embedding end copies its result into the head's: tie_copies)
        self.tied_held = profile.tied_params if sched.tied and sched.tie_held is not None else 0
        self.tie_copy = profile.tied_params * tie_copy_work(profile.precision) if sched.tied and sched.tie_copies \
            else 0.0
        for w in self.workers:
            w.posts = self._posts(w)
            # delayed (one compute copy): each stage's last upload of the step -> the stage, whose copy follows it
            w.refreshes = {t.occ: t.stage for t in w.uploads if t.kind == Kind.UPLOAD and self.copy_work
                           and sched.last_uploads[t.stage] == t.phase}
        self._new_step_state()

    def _posts(self, w: _Worker) -> list[int]:
        """Per compute task of the worker, the messages its dispatch thread posts after it and before the next:
        the send of its output, the receive of the next one's input (to and from other workers)."""
        def crossing(stage: int, micro: int) -> int:
            return int(0 <= stage < self.S and self.sched.worker_for(stage, micro) != w.w)

        def ends(task: _Task) -> tuple[int, int]:  # (receives, sends)
            if task.kind not in (Kind.FORWARD, Kind.BACKWARD, Kind.FB):
                return 0, 0
            back = task.kind != Kind.FORWARD
            return (crossing(self.sched.producer(task.stage, back), task.micro),
                    crossing(self.sched.consumer(task.stage, back), task.micro))
        edges = [ends(t) for t in w.compute]
        posts = [sends + (edges[i + 1][0] if i + 1 < len(edges) else 0) for i, (_, sends) in enumerate(edges)]
        if posts:
            posts[0] += edges[0][0]
        return posts

    # ---- steps -------------------------------------------------------------------------------
    def _new_step_state(self) -> None:
        self.arrived: dict[tuple[str, int, int], float] = {}
        self.kept_at: dict[tuple[int, int], float] = {}  # (unit, micro) -> its input is in host memory
        self.downloaded: dict[tuple[int, int], float] = {}  # (step, stage) -> its last download of the step
        self.tie_check = True  # a download landed since _start_tie last looked
        self.reduced = False
        self.timing = [StageTiming() for _ in range(self.S)]
        self.bytes = {"h2d": [0.0] * self.hw.num_gpus, "d2h": [0.0] * self.hw.num_gpus,
                      "p2p": [0.0] * self.hw.num_gpus, "rc_h2d": [0.0] * len(self.hw.groups),
                      "rc_d2h": [0.0] * len(self.hw.groups)}
        self.by_kind: dict[str, float] = {}
        self.events: list[SimEvent] = []
        self.busy = dict.fromkeys(("fwd", "bwd", "dadam", "dispatch"), 0.0)  # a program's last step's compute
        # (the time split's: SimResult.busy_s)
        self.compute_end_s = 0.0
        for w in self.workers:
            w.reset()
            w.last_end = self.step_start

    def run(self, steps: int) -> SimResult:
        if self.program:  # the lists hold every step
            self._loop()
            self._check_reduced()
            self.step_ends = [self.step_end[s] for s in range(self.sched.steps)]
            return self._result()
        while self.step < steps:
            self._loop()
            self._check_reduced()
            self.step_ends.append(self.t)
            self.step += 1
            self.unheld += 1
            if self.step < steps:
                self.step_start = self.t
                self._new_step_state()
        return self._result()

    def _loop(self) -> None:
        while not self.reduced:
            while self._start_ready():
                pass
            if self._try_reduce():
                return
            self._allocate()
            self._share_cpu()
            t_next = self._next_time()
            assert t_next < math.inf, f"simulation stalled at {self.t:.6f} s in step {self.step}"
            self._advance(t_next)
            self._complete_due()

    def _check_reduced(self) -> None:
        for w in self.workers:
            assert w.ci == len(w.compute) and w.ui == len(w.uploads) and w.di == len(w.d2h), w.w

    # ---- starting work -------------------------------------------------------------------------
    def _start_ready(self) -> bool:
        started = False
        for w in self.workers:  # (an engine that is busy or has nothing left is skipped without a call)
            if not w.uploading and w.ui < len(w.uploads):
                started |= self._start_upload(w)
            if self.tie_pending:
                started |= self._start_tie_in(w)
            if w.busy_until is None and w.ci < len(w.compute) and w.woken:
                started |= self._start_compute(w)
            if not w.downloading and w.di in w.d2h_ready:
                started |= self._start_d2h(w)
            if w.ri < len(w.reloads):
                started |= self._start_reloads(w)
        started |= self._start_tie()
        if self.program:
            started |= self._program_reduces()
        started |= self._start_updates()
        started |= self._start_adds()
        return started

    def _start_upload(self, w: _Worker) -> bool:
        if w.uploading or w.ui >= len(w.uploads) or w.upload_held == (w.ui, self.unheld):
            return False  # (nothing it waited for has changed since)
        task = w.uploads[w.ui]
        K = self.sched.num_slots
        if not all(self._weights_ready(d, self.step + task.tstep) for d in self.sched.update_deps(task.stage)):
            return self._held(w)  # a CPU update of its weights is pending
        order = self.step * 10**6 + self.sched.upload_rank(task.stage, task.phase, task.round)
        param_bytes = self.costs[task.stage].param_bytes
        if task.kind == Kind.PREFETCH:  # into the buffer: it waits for no slot
            nbytes = min(float(self.sched.options.prefetch_bytes), param_bytes)
            w.prefetched[task.occ] = nbytes
            done: Callable[[float], None] = lambda t, w=w: setattr(w, "uploading", False)
        elif task.occ >= K and task.occ - K not in w.released:
            return self._held(w)  # the slot it takes is still in use
        else:  # what the buffer does not hold (its part moves into the slot on the device: not a transfer)
            sums = self.sched.sums_up(task.stage, task.round)
            if sums and not self._rounds_before_summed(task):
                return self._held(w)  # it brings the step's earlier rounds of its gradient sums up: not all down yet
            nbytes = param_bytes - w.prefetched.pop(task.occ, 0.0)
            if task.reload:
                nbytes += len(self.sched.reload_micros(task.stage, task.round)) * self.costs[task.stage].in_bytes
            if sums:
                nbytes += 4.0 * self.costs[task.stage].trainable_count
            done = lambda t, w=w, occ=task.occ: self._upload_done(w, occ, t)
            if self.sched.tie_in and task.stage == 0 and task.phase == "b":  # the copy thread then brings the
                # head's end of the tied weight's gradient up, once it is down (_start_tie_in)
                done = lambda t, w=w, key=(self.step + task.tstep, task.occ, order): self.tie_pending.update({w.w: key})
        w.uploading = True
        w.ui += 1
        self._h2d_flow(w.gpu, f"{task.kind.value}{task.phase}{task.stage}", "upload", nbytes, (1, order), done)
        return True

    def _held(self, w: _Worker) -> bool:
        """``w``'s next upload waits: it is not looked at again until something it may wait for changes."""
        w.upload_held = (w.ui, self.unheld)
        return False

    def _start_tie_in(self, w: _Worker) -> bool:
        """Stage 0's weights are up: the head's end of the tied weight's gradient follows once it is down, and the
        copy thread waits for it (one worker holds both ends: ``Schedule.tie_in``)."""
        if w.w not in self.tie_pending or (self.tie_pending[w.w][0], self.S - 1) not in self.downloaded:
            return False
        _, occ, order = self.tie_pending.pop(w.w)
        self._h2d_flow(w.gpu, "T0", "upload", self.grad_bytes * self.profile.tied_params, (1, order),
                       lambda t, w=w, occ=occ: self._upload_done(w, occ, t))
        return True

    def _start_reloads(self, w: _Worker) -> bool:
        """Bring back, in order, each micro-batch input a backward needs once its occupancy is uploaded and a
        forward has put the input in host memory (several may be in flight)."""
        started = False
        while w.ri < len(w.reloads):
            task = w.compute[w.reloads[w.ri]]
            if task.occ not in w.upload_done or (task.unit, task.micro) not in self.kept_at:
                break
            key = ("k", task.stage, task.micro)

            def back(t: float, key: tuple = key, w: _Worker = w) -> None:
                self.arrived[key], w.woken = t, True

            self._h2d_flow(w.gpu, f"L{task.stage}.{task.micro}", "ckpt", self.profile.units[task.unit].in_bytes, (0,),
                           back)
            w.ri += 1
            started = True
        return started

    def _weights_ready(self, stage: int, step: int) -> bool:
        """Whether ``stage``'s weights for ``step`` are in its host copy. Sync: every earlier step's update has
        run. Delayed, with one compute copy per stage (the swapped pipeline): the previous step's compute copy
        taken (the runtime copies the master, one update old, into the compute copy on the worker's CPU thread,
        ahead of every update, once that step's last upload of the stage has read it and the stage's earlier
        updates have run: ``copy_work``), and a download waits until the update has read the stage's one
        gradient buffer; with two copies of both that alternate by step (round-robin): the
        update before the previous one has run (it wrote its copy)."""
        if not self.delay:
            return self.version[stage] >= step
        if self.sched.compute_copies == 1:
            return self.copied[stage] >= step
        return self.version[stage] >= step - 1

    def _upload_done(self, w: _Worker, occ: int, t: float) -> None:
        w.uploading, w.woken = False, True
        w.upload_done[occ] = t
        if occ in w.refreshes:  # the step's last read of a delayed stage's host copy: its compute copy may follow
            self.copy_queue[w.w].append((self.step, w.refreshes[occ]))

    def _start_compute(self, w: _Worker) -> bool:
        if w.busy_until is not None or w.ci >= len(w.compute):
            return False
        task = w.compute[w.ci]
        if task.occ >= 0 and task.occ not in w.upload_done:
            w.woken = False  # until its upload ends
            return False
        inputs = self._input_ready(task)
        if inputs is None:
            w.woken = False  # until an activation (or gradient) arrives for it
            return False
        if inputs > self.t + _EPS_T:
            return False
        uploaded = w.upload_done[task.occ] if task.occ >= 0 else self.t
        start = max(self.t, uploaded)
        wait = max(0.0, uploaded - max(w.last_end, inputs))
        dur = self._duration(task, w.gpu)
        posted = self.hw.message_s * w.posts[w.ci]  # the dispatch thread's messages after it, and its own time
        if task.kind != Kind.DEVICE_UPDATE:  # on the action (CPU workers, learnt from their runs)
            posted += self.profile.action_s
        w.running, w.comp_left, w.comp_end = (task, start, posted), dur, start + dur
        w.busy_until = start + dur + posted
        tm = self.timing[task.stage]
        if self._opens(task):
            if task.kind in (Kind.BACKWARD, Kind.RECOMPUTE):
                tm.bwd_start = start - self.step_start
            else:
                tm.fwd_start = start - self.step_start
            tm.upload_wait_s += wait
        return True

    def _compute_ended(self, w: _Worker) -> None:
        """The compute engine's events of the compute that has ended: the compute, then its posted messages."""
        task, start, posted = w.running
        end = w.comp_end
        if posted:
            self._compute_event(w, task, f"m{task.stage}.{task.micro}", end, end + posted, "dispatch")
        if task.kind == Kind.DEVICE_UPDATE:
            self._compute_event(w, task, f"Od{task.stage}", start, end, "dadam")
        else:
            cat = "bwd" if task.kind != Kind.FORWARD else "fwd"
            self._compute_event(w, task, f"{task.kind.value}{task.stage}.{task.micro}", start, end, cat)
        w.running = None

    def _compute_event(self, w: _Worker, task: _Task, name: str, start: float, end: float, cat: str) -> None:
        self._event(w.gpu, "compute", name, start, end, cat)
        if self.program and task.tstep == self.sched.steps - 1:
            self.busy[cat] += end - start

    def _opens(self, task: _Task) -> bool:
        """A stage's first compute of the reported step (round-robin: of each of its rounds there)."""
        if not self.program:
            return task.micro == 0
        return (task.tstep == self.sched.steps - 1 and task.micro % self.M % self.N == 0
                and task.kind != Kind.BACKWARD)  # a backward's round opens with its recompute

    def _input_ready(self, task: _Task) -> float | None:
        if task.kind == Kind.RECOMPUTE:  # its input brought back from host memory (token ids: none)
            return self.arrived.get(("k", task.stage, task.micro)) if task.unit >= 0 else self.step_start
        if task.kind == Kind.BACKWARD:
            return self.arrived.get(("g", task.stage, task.micro))
        if task.stage == 0 or task.kind == Kind.DEVICE_UPDATE:
            return self.step_start
        return self.arrived.get(("a", task.stage, task.micro))

    def _duration(self, task: _Task, gpu: int) -> float:
        """Seconds of a compute task at full speed on device ``gpu``: its stage's unit times, in a draw
        (``draw`` >= 0) at its step's factor of the device and its own (:meth:`_drawn`)."""
        work = self._work(task)
        if self.draw < 0 or task.kind == Kind.DEVICE_UPDATE:
            return work
        step = task.tstep if self.program else self.step
        return work * self._speeds(step).get(gpu, 1.0) * self._drawn(task, step)

    def _speeds(self, step: int) -> dict[int, float]:
        """Each worker's device's factor in ``step`` of a draw (:func:`partition.spread.worker_speeds`)."""
        if step not in self.speeds:
            gpus = [w.gpu for w in self.workers]
            self.speeds[step] = dict(zip(gpus, worker_speeds(self.draw, step, len(gpus), self.profile.worker_spread)))
        return self.speeds[step]

    def _drawn(self, task: _Task, step: int) -> float:
        """The task's own factor in ``step`` of a draw (:func:`partition.spread.compute_factor`), keyed by the task's
        kind, stage, micro-batch and unit."""
        key = (self.draw, step // 2, _KIND_CODE[task.kind], task.stage, task.micro, task.unit)
        return compute_factor(self.profile.compute_spread, key, step)

    def _work(self, task: _Task) -> float:
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

    def _start_d2h(self, w: _Worker) -> bool:
        if w.downloading or w.di >= len(w.d2h) or w.di not in w.d2h_ready:
            return False
        if w.d2h_ready[w.di] > self.t + _EPS_T:
            return False
        task = w.d2h[w.di]
        if (task.kind == Kind.DOWNLOAD and self.delay and self.sched.compute_copies == 1
                and self.version[task.stage] < self.step + task.tstep):
            return False  # the previous step's update still reads the stage's one gradient buffer
        if (task.kind == Kind.DOWNLOAD and self.sched.download_work(task.round) > 0
                and len(self.add_queue[w.w]) + (self.adding[w.w] is not None) >= STAGING):
            return False  # a middle round's sums come down into a staging buffer; all of them wait to be added
        w.downloading = True
        w.di += 1
        if task.kind == Kind.DOWNLOAD:
            nbytes = self.grad_bytes * self.costs[task.stage].trainable_count  # fp32 sums or half
            self._d2h_flow(w.gpu, f"G{task.stage}", "grad", nbytes, (2, self.S - task.stage),
                           lambda t, w=w, task=task: self._grad_down(w, task, t))
        else:
            nbytes = self.costs[task.stage].in_bytes if task.unit < 0 else self.profile.units[task.unit].in_bytes
            self._d2h_flow(w.gpu, f"ckpt{task.stage}.{task.micro}", "ckpt", nbytes, (3, task.stage),
                           lambda t, w=w, task=task: self._offloaded(w, task, t))
        return True

    def _offloaded(self, w: _Worker, task: _Task, t: float) -> None:
        w.downloading = False
        self.kept_at[(task.unit, task.micro)] = t

    def _grad_down(self, w: _Worker, task: _Task, t: float) -> None:
        """A gradient's copy is down: the download engine and the slot are free; the summing thread's host work
        on it follows, if any (:meth:`_downloaded` once it is done)."""
        w.downloading = False
        w.released[task.occ] = t  # the slot is reused only after the copy has read it
        self.unheld += 1
        work = self.sched.download_work(task.round) * self.costs[task.stage].trainable_count
        if work <= 0:
            self._downloaded(w, task, t)
        else:
            self.add_queue[w.w].append((task, work))

    def _start_adds(self) -> bool:
        """Each summing thread takes its next gradient once the op's rounds before it are summed."""
        started = False
        for w in range(self.N):
            if self.adding[w] is not None or not self.add_queue[w]:
                continue
            task, work = self.add_queue[w][0]
            if not self._rounds_before_summed(task):
                continue
            self.add_queue[w].pop(0)
            self.adding[w], self.add_left[w], self.add_busy[w] = (task, self.t), work, self.t  # timed by _share_cpu
            started = True
        return started

    def _rounds_before_summed(self, task: _Task) -> bool:
        """The rounds of ``task``'s step before its own are down and summed for its stage (round-robin)."""
        return self.downloads_done.get((self.step + task.tstep, task.stage), 0) >= task.round % self.sched.rounds

    def _downloaded(self, w: _Worker, task: _Task, t: float) -> None:
        """A gradient is down and summed; the stage's last of the step queues its update (without a barrier)."""
        step = self.step + task.tstep
        key = (step, task.stage)
        self.downloads_done[key] = self.downloads_done.get(key, 0) + 1
        self.unheld += 1
        self._ends(task.tstep, t)
        if self.program:
            self.step_left[task.tstep] -= 1
        if self.downloads_done[key] < self.downloads_due[(task.tstep, task.stage)]:
            return  # round-robin: earlier rounds' gradients are summed in host memory
        self.downloaded[key] = t
        self.tie_check = True
        if not self.copy_work:  # (delayed: the compute copy is queued at the step's last upload, _upload_done)
            self.copied[task.stage] += 1
        if not self.sched.barrier and not self._tied_end(task.stage):
            self.opt_queue[w.w].append((step, task.stage))

    def _ends(self, tstep: int, t: float) -> None:
        self.step_end[tstep] = max(self.step_end.get(tstep, 0.0), t)

    def _tied_end(self, j: int) -> bool:
        """Whether stage j's update reads both ends of the tied weight (and waits for their sum)."""
        return self.sched.tied and j in self.sched.tie_readers

    def _updates_of(self, w: _Worker, step: int) -> list[int]:
        """The stages whose CPU updates of ``step`` worker ``w`` runs (a step's lists repeat unless they are
        a program of several)."""
        return w.updates.get(step if self.program else 0, [])

    def _start_tie(self) -> bool:
        """Once both ends of a tied weight are down in a step, their gradients are summed (``TIE``)."""
        if not self.sched.tied or not self.tie_check:
            return False
        self.tie_check = False
        started = False
        for step in range(self.step, self.step + self.sched.steps):
            if step in self.tie_at:
                continue
            ends = [(step, j) for j in self.sched.tie_ends]
            if not all(e in self.downloaded for e in ends):
                continue
            self.tie_at[step] = max(self.downloaded[e] for e in ends) + self.tie_s
            if not self.sched.barrier:
                for w in self.workers:
                    self.opt_queue[w.w] += [(step, j) for j in self._updates_of(w, step) if self._tied_end(j)]
            started = True
        return started

    def _program_reduces(self) -> bool:
        """A program's step reduces once all of its gradients are down (and summed where tied); with a
        barrier its updates follow then."""
        started = False
        for step, left in self.step_left.items():
            if left or step in self.reduced_steps:
                continue
            tie = self.tie_at.get(step, -math.inf if not self.sched.tied else None)
            if tie is None or tie > self.t + _EPS_T:
                continue
            self.reduced_steps.add(step)
            if self.sched.barrier:
                for w in self.workers:
                    self.opt_queue[w.w] += [(step, j) for j in self._updates_of(w, step)]
            started = True
        return started

    def _start_updates(self) -> bool:
        started = False
        for w in range(self.N):
            if self.opt_busy[w] is not None:
                continue
            copy = self.copy_queue[w] and next((c for c in self.copy_queue[w] if self.version[c[1]] >= c[0]), None)
            if copy:  # a compute copy goes ahead of every update (the next step's upload waits for it),
                # once the stage's earlier updates have run
                self.copy_queue[w].remove(copy)
                step, j = copy
                self.opt_running[w], self.opt_start[w] = (step, j, True), self.t
                self.opt_left[w] = self._cpu_params(j) * self.copy_work
                self.opt_busy[w] = self.t
                started = True
                continue
            if not self.opt_queue[w]:
                continue
            step, j = self.opt_queue[w][0]
            tie = self.tie_at.get(step)
            if self._tied_end(j) and not self.sched.barrier and (tie is None or tie > self.t + _EPS_T):
                continue
            self.opt_queue[w].pop(0)
            self.opt_running[w], self.opt_start[w] = (step, j, False), self.t
            self.opt_left[w] = self._cpu_params(j)
            self.opt_busy[w] = self.t  # timed by _share_cpu
            started = True
        return started

    def _cpu_params(self, j: int) -> float:
        """The parameters stage j's CPU update covers: a tied weight's end that the other end updates left out, and
        that end's copy into it counted (round-robin)."""
        return float(self.costs[j].trainable_count - (self.tied_held if j == self.sched.tie_held else 0)
                     + (self.tie_copy if j in self.sched.tie_readers else 0.0))

    def _share_cpu(self) -> None:
        """The running CPU updates' and summing threads' rates: each one's share of the host while this many
        work on its memory; a worker's update pauses while its summing thread adds (the sums hold up downloads and
        slots, the update only the next step). CPU workers' compute shares the host's cores with them too
        (:meth:`_share_cores`)."""
        adding = [w for w in range(self.N) if self.adding[w] is not None]
        running = [w for w in range(self.N) if self.opt_running[w] is not None]
        paused = [w for w in running if self.adding[w] is not None]  # a worker's update yields to its sums
        n = len(running) - len(paused) + len(adding)
        rate = self.hw.cpu_update_rate(self.half_grads, updating=n) if n else 0.0
        for w in running:
            self.opt_rate[w] = 0.0 if w in paused else rate
            self.opt_busy[w] = math.inf if w in paused else self.t + self.opt_left[w] / rate
        for w in adding:
            self.add_rate[w] = rate
            self.add_busy[w] = self.t + self.add_left[w] / rate
        if self.hw.host_cores:
            self._share_cores(n)

    def _share_cores(self, host_jobs: int) -> None:
        """CPU workers: every thread that wants the host's cores gets its share of them, cores / wanted: the
        workers' computes and copies (every transfer is a memory copy on a worker's thread) run at that share of
        their speed, beside ``host_jobs`` CPU updates and sums (whose rates are measured inside steps, so kept);
        each of them runs on ``Hardware.worker_threads`` threads."""
        computing = [w for w in self.workers if w.running is not None and w.comp_left > 0]
        copies = sum(1 for f in self.flows if f.base > 0)  # (each flow's rate on its links alone: _allocate)
        demand = (len(computing) + copies + host_jobs) * self.hw.worker_threads
        rate = min(1.0, self.hw.host_cores / demand) if demand else 1.0
        for w in computing:
            w.comp_rate, w.comp_end = rate, self.t + w.comp_left / rate
            w.busy_until = w.comp_end + w.running[2]
        for f in self.flows:
            f.rate = f.base * rate

    # ---- the end of a step ---------------------------------------------------------------------
    def _try_reduce(self) -> bool:
        """REDUCE: every worker has finished its step's work (and, without a barrier, its updates)."""
        for w in self.workers:
            if w.ci < len(w.compute) or w.busy_until is not None or w.ui < len(w.uploads) or w.uploading:
                return False
            if w.di < len(w.d2h) or w.downloading or w.pending_sends or self.add_queue[w.w] or self.adding[w.w]:
                return False
            if not (self.sched.barrier or self.delay) and (self.opt_queue[w.w] or self.opt_busy[w.w] is not None):
                return False
        if self.program:
            return self._reduce_program()
        tie = self.tie_at.get(self.step)
        if self.sched.tied and (tie is None or tie > self.t + _EPS_T):
            return False
        if any(f.kind == "act" for f in self.flows):
            return False
        self.reduced = True
        if self.sched.barrier:
            for w in self.workers:
                self.opt_queue[w.w] += [(self.step, j) for j in self._updates_of(w, self.step)]
        return True

    def _reduce_program(self) -> bool:
        """A program ends when every step has reduced and, in sync, every update has run."""
        if len(self.reduced_steps) < self.sched.steps or self.flows:
            return False
        if not self.delay and any(self.opt_queue[w] or self.opt_busy[w] is not None for w in range(self.N)):
            return False
        self.reduced = True
        return True

    # ---- time ----------------------------------------------------------------------------------
    def _next_time(self) -> float:
        times = [w.busy_until for w in self.workers if w.busy_until is not None]
        if self.hw.host_cores:  # a compute's end frees its cores (the messages it posts follow)
            times += [w.comp_end for w in self.workers if w.running is not None and w.comp_left > 0]
        times += [b for b in self.opt_busy + self.add_busy if b is not None]
        times += [t for t in self.tie_at.values() if t > self.t + _EPS_T]
        times += [self.t + f.remaining() / f.rate for f in self.flows if f.rate > 0]
        return max(min(times), self.t) if times else math.inf

    def _advance(self, t_next: float) -> None:
        dt = t_next - self.t
        for w in range(self.N):
            if self.opt_running[w] is not None:
                self.opt_left[w] = max(0.0, self.opt_left[w] - self.opt_rate[w] * dt)
            if self.adding[w] is not None:
                self.add_left[w] = max(0.0, self.add_left[w] - self.add_rate[w] * dt)
        for w in self.workers if self.hw.host_cores else ():
            if w.running is not None and w.comp_left > 0:
                w.comp_left = 0.0 if w.comp_end <= t_next + _EPS_T else max(0.0, w.comp_left - w.comp_rate * dt)
        short = max(_EPS_T, 4 * math.ulp(t_next))  # a time too short to move the clock on from t_next
        for f in self.flows:  # a flow is done up to a byte's fraction or what moves in that time (a fast link's last
            f.done = min(f.total, f.done + f.rate * dt)  # bytes): _complete_due ends it
            if f.total - f.done < max(_EPS_BYTES, f.rate * short):
                f.done = f.total
        self.t = t_next

    def _complete_due(self) -> None:
        for f in [f for f in self.flows if f.done == f.total]:  # (_advance marks the flows due now done)
            self.flows.remove(f)
            self.flows_changed = True
            self._finish_flow(f)
        for w in self.workers:
            if w.busy_until is not None and w.busy_until <= self.t + _EPS_T:
                w.busy_until, w.woken = None, True
                self._compute_ended(w)
                self._compute_done(w)
        self._complete_updates()

    def _complete_updates(self) -> None:
        for w in range(self.N):
            if self.opt_busy[w] is not None and self.opt_busy[w] <= self.t + _EPS_T:
                _, j, copy = self.opt_running[w]
                self._event(-1, "cpu", f"{'copy' if copy else 'adam'}{j}", self.opt_start[w], self.t, "adam")
                if copy:
                    self.copied[j] += 1
                else:
                    self.version[j] += 1
                self.unheld += 1
                self.opt_busy[w], self.opt_running[w] = None, None
            if self.add_busy[w] is not None and self.add_busy[w] <= self.t + _EPS_T:
                task, start = self.adding[w]
                self._event(-1, "cpu", f"sum{task.stage}", start, self.t, "sum")
                self.adding[w], self.add_busy[w] = None, None
                self._downloaded(self.workers[w], task, self.t)

    def _compute_done(self, w: _Worker) -> None:
        task = w.compute[w.ci]
        j, m = task.stage, task.micro
        w.last_end = self.t
        self.compute_end_s = max(self.compute_end_s, self.t - self.step_start)
        self._ends(task.tstep, self.t)
        tm = self.timing[j] if not self.program or task.tstep == self.sched.steps - 1 else StageTiming()
        if task.kind in (Kind.DEVICE_UPDATE, Kind.RECOMPUTE):
            pass
        elif task.kind == Kind.FORWARD:
            tm.fwd_end = self.t - self.step_start
            self._send(w, j, self.sched.consumer(j, False), m, backward=False)
        else:
            tm.bwd_end = self.t - self.step_start
            if task.kind == Kind.FB:
                tm.fwd_end = tm.bwd_end
            self._send(w, j, self.sched.consumer(j, True), m, backward=True)
        for k in w.triggers.get(w.ci, []):
            w.d2h_ready[k] = self.t
        if w.ci in w.release_at:
            w.released[w.release_at[w.ci]] = self.t  # a forward occupancy frees its slot when it ends
            self.unheld += 1
        w.ci += 1

    # ---- transfers -----------------------------------------------------------------------------
    def _send(self, w: _Worker, src: int, dst: int, m: int, backward: bool) -> None:
        if not 0 <= dst < self.S:
            return
        key = ("g" if backward else "a", dst, m)
        sc = self.costs[src]
        nbytes = sc.in_bytes if backward else sc.out_bytes
        dst_w = self.workers[self.sched.worker_for(dst, m)]
        if dst_w is w or nbytes == 0:
            self.arrived[key], dst_w.woken = self.t, True
            return
        name = f"{key[0]}{src}>{dst}.{m}"
        w.pending_sends += 1

        def arrived(t: float) -> None:
            self.arrived[key], dst_w.woken = t, True
            w.pending_sends -= 1

        if self.hw.p2p_rate(w.gpu, dst_w.gpu):
            self._p2p_flow(w.gpu, dst_w.gpu, name, nbytes, arrived)
        else:
            self._d2h_flow(w.gpu, name, "act", nbytes, (0,),
                           lambda t: self._h2d_flow(dst_w.gpu, name, "act", nbytes, (0,), arrived))

    def _h2d_flow(self, gpu: int, label: str, kind: str, nbytes: float, prio: tuple,
                  on_done: Callable[[float], None]) -> None:
        res = [("h2d", gpu), ("rc_h2d", self.hw.group_of(gpu))]
        self._add_flow(label, kind, nbytes, res, math.inf, prio, on_done, gpu, "h2d")

    def _d2h_flow(self, gpu: int, label: str, kind: str, nbytes: float, prio: tuple,
                  on_done: Callable[[float], None]) -> None:
        res = [("d2h", gpu), ("rc_d2h", self.hw.group_of(gpu))]
        self._add_flow(label, kind, nbytes, res, math.inf, prio, on_done, gpu, "d2h")

    def _p2p_flow(self, src: int, dst: int, label: str, nbytes: float, on_done: Callable[[float], None]) -> None:
        res = [("d2h", src), ("h2d", dst)]
        gs, gd = self.hw.group_of(src), self.hw.group_of(dst)
        if gs != gd:
            res += [("rc_d2h", gs), ("rc_h2d", gd)]
        self._add_flow(label, "act", nbytes, res, self.hw.p2p_rate(src, dst), (0,), on_done, src, "p2p")

    def _add_flow(self, label: str, kind: str, nbytes: float, res: list, cap: float, prio: tuple,
                  on_done: Callable[[float], None], gpu: int, track: str) -> None:
        if self.hw.bidir_Bps:
            res = res + [("bidir", gpu)]
        if nbytes <= 0:
            on_done(self.t)
            return
        self.flows_changed = True
        self.flows.append(_Flow(label, kind, float(nbytes), tuple(res), cap,
                                prio if self.sharing == "priority" else (0,), on_done, gpu, track, self.t))

    def _finish_flow(self, f: _Flow) -> None:
        hw = self.hw
        self.by_kind[f.kind] = self.by_kind.get(f.kind, 0.0) + f.total
        self.bytes[f.track][f.gpu] += f.total
        if f.track in ("h2d", "d2h"):
            self.bytes[f"rc_{f.track}"][hw.group_of(f.gpu)] += f.total
        self._event(f.gpu, f.track, f.label, f.start, self.t, {"upload": "upload", "act": "act", "grad": "grad",
                                                                "ckpt": "ckpt"}[f.kind], f.total)
        f.on_done(self.t)

    # ---- sharing -------------------------------------------------------------------------------
    def _capacities(self) -> dict:
        """Each link's capacity now; a root complex's may depend on how many streams share it."""
        hw = self.hw
        if not (hw.rc_h2d_by_streams or hw.rc_d2h_by_streams):  # then set once (read only: _allocate fills a copy)
            return self.link_caps
        cap = dict(self.link_caps)
        users: dict = {}
        for f in self.flows:
            for r in f.resources:
                users[r] = users.get(r, 0) + 1
        for k in range(len(hw.groups)):
            cap[("rc_h2d", k)] = hw.rc_rate(k, "h2d", users.get(("rc_h2d", k), 1))
            cap[("rc_d2h", k)] = hw.rc_rate(k, "d2h", users.get(("rc_d2h", k), 1))
        return cap

    def _allocate(self) -> None:
        """Strict priority between classes, max-min fair inside a class (progressive filling). The
        rates depend on the flows in flight only: they are set again when one starts or ends."""
        if not self.flows_changed:
            return
        self.flows_changed = False
        capacity = self._capacities()
        remaining = dict(capacity)
        for f in self.flows:
            f.rate = 0.0
        for _, same in itertools.groupby(sorted(self.flows, key=_priority), key=_priority):
            _fill(list(same), remaining, capacity)
        for f in self.flows:
            f.base = f.rate

    # ---- results -------------------------------------------------------------------------------
    def _event(self, gpu: int, track: str, name: str, start: float, end: float, cat: str, nbytes: float = 0.0) -> None:
        if self.record:
            self.events.append(SimEvent(gpu, track, name, start - self.step_start, end - self.step_start, cat, nbytes))

    def _result(self) -> SimResult:
        ends = self.step_ends
        step = ends[-1] - ends[-2] if len(ends) > 1 else ends[-1]
        if self.program:
            return self._program_result(step)
        return SimResult(step_s=step, compute_end_s=self.compute_end_s, peak_bytes=self._peaks(),
                         h2d_bytes=self.bytes["h2d"], d2h_bytes=self.bytes["d2h"], p2p_bytes=self.bytes["p2p"],
                         rc_h2d_bytes=self.bytes["rc_h2d"], rc_d2h_bytes=self.bytes["rc_d2h"],
                         bytes_by_kind=self.by_kind, stages=self.timing, events=self.events,
                         gpu_names=list(self.hw.gpu_names), step_ends=list(ends))

    def _program_result(self, step: float) -> SimResult:
        """A program's figures: bytes per step (its steps move the same), the last step's period and the events in
        it, and that step's compute wherever it fell (``busy_s``: the time split's)."""
        n = self.sched.steps
        lo = self.step_ends[-2] if n > 1 else 0.0
        per = {k: [x / n for x in v] for k, v in self.bytes.items()}
        events = [dataclasses.replace(e, start=e.start - lo, end=e.end - lo) for e in self.events if e.end > lo
                  and e.start < self.step_ends[-1]]
        busy = {k: v / self.N for k, v in self.busy.items()}
        busy["upload_wait"] = sum(t.upload_wait_s for t in self.timing) / self.N
        return SimResult(step_s=step, compute_end_s=step, peak_bytes=[0] * self.hw.num_gpus, h2d_bytes=per["h2d"],
                         d2h_bytes=per["d2h"], p2p_bytes=per["p2p"], rc_h2d_bytes=per["rc_h2d"],
                         rc_d2h_bytes=per["rc_d2h"], bytes_by_kind={k: v / n for k, v in self.by_kind.items()},
                         stages=self.timing, events=events, gpu_names=list(self.hw.gpu_names),
                         step_ends=list(self.step_ends), busy_s=busy)

    def _peaks(self) -> list[int]:
        st: list[StageExprs] = [stage_exprs(c, self.half) for c in self.costs]
        shape = Shape(self.S, self.N, self.M, self.sched.options, self.profile.tied_params / GB * self.sched.tied)
        per_worker = memory_peaks(st, shape)
        out = [0] * self.hw.num_gpus
        for w in self.workers:
            out[w.gpu] = max(out[w.gpu], int(per_worker[w.w] * GB))
        return out


def _downloads_per_step(sched) -> dict[tuple[int, int], int]:
    """(step of the lists, stage) -> the gradient downloads of that stage in that step."""
    rounds = sched.rounds
    out: dict[tuple[int, int], int] = {}
    for acts in sched.actions:
        for a in acts:
            if a.kind == Kind.DOWNLOAD:
                key = (max(a.round, 0) // rounds, a.stage)
                out[key] = out.get(key, 0) + 1
    return out


def _priority(f: _Flow) -> tuple:
    return f.prio


def _fill(flows: list[_Flow], remaining: dict, capacity: dict) -> None:
    """Max-min fair rates for ``flows`` within ``remaining`` capacity (reduced in place)."""
    if len(flows) == 1 and flows[0].distinct:  # one round of the loop below
        f = flows[0]
        step = max(min([remaining[r] for r in f.resources] + [f.cap - f.rate]), 0.0)
        f.rate += step
        for r in f.resources:
            remaining[r] -= step
        return
    free = list(flows)
    while free:
        users: dict = {}
        for f in free:
            for r in f.resources:
                users[r] = users.get(r, 0) + 1
        step = min([remaining[r] / n for r, n in users.items()] + [f.cap - f.rate for f in free])
        step = max(step, 0.0)
        for f in free:
            f.rate += step
            for r in f.resources:
                remaining[r] -= step
        saturated = {r for r in users if remaining[r] <= 1e-9 * capacity[r]}
        free = [f for f in free if (f.cap == math.inf or f.cap - f.rate > 1e-9 * f.cap)
                and not any(r in saturated for r in f.resources)]


# ---------------------------------------------------------------------------------- rendering
TRACKS = ("compute", "h2d", "d2h", "p2p", "cpu")  # a step's tracks, in the order (and as the thread ids) of its
# Chrome trace: a GPU's compute and its transfers by link, then the host's CPU updates; the runtime's measured
# trace (scheduler/trace.py) uses the same


def _ascii(res: SimResult, width: int) -> str:
    """Text grid: compute cells show the stage (forward lower case a-z, backward upper case)."""
    end = res.step_s or 1.0
    cell = end / width
    gpus = sorted({e.gpu for e in res.events if e.gpu >= 0})
    rows = []
    for g in gpus:
        for track in TRACKS[:-1]:  # the GPU's; the CPU's row follows
            evs = [e for e in res.events if e.gpu == g and e.track == track]
            if not evs and track != "compute":
                continue
            label = f"GPU{g} {track}" if track == "compute" else f"     {track}"
            rows.append(f"{label:<12}|{_row(evs, cell, width)}|")
    cpu = [e for e in res.events if e.gpu < 0]
    rows.append(f"{'CPU adam':<12}|{_row(cpu, cell, width)}|")
    legend = (f"step {res.step_s * 1e3:.1f} ms, {cell * 1e3:.2f} ms per column; compute: stage j forward = "
              f"chr('a'+j%26), backward = upper case; links: > upload, a activation, g gradient, < grad download, "
              f"c checkpoint, . messages posted; CPU: stage (mod 10) being updated, + a download's sums added")
    return "\n".join(rows + [legend])


def _row(evs: list[SimEvent], cell: float, width: int) -> str:
    chars = [" "] * width
    cover = [0.0] * width
    for e in evs:
        c0, c1 = int(e.start / cell), min(width - 1, int(max(e.start, e.end - 1e-15) / cell))
        for c in range(max(0, c0), c1 + 1):
            lo, hi = max(e.start, c * cell), min(e.end, (c + 1) * cell)
            if hi - lo > cover[c] or (hi - lo == cover[c] == 0):
                cover[c] = hi - lo
                chars[c] = _glyph(e)
    return "".join(chars)


def _glyph(e: SimEvent) -> str:
    if e.cat in ("fwd", "bwd"):
        stage = int(e.name.lstrip("FBXC").split(".")[0])
        ch = chr(ord("a") + stage % 26)
        return ch.upper() if e.cat == "bwd" else ch
    if e.cat == "adam":
        return str(int(e.name[4:]) % 10)
    if e.cat == "dadam":
        return "*"
    if e.cat == "sum":
        return "+"
    if e.cat == "dispatch":
        return "."
    return {"upload": ">", "grad": "<", "ckpt": "c"}.get(e.cat, "g" if e.name.startswith("g") else "a")


def _chrome_trace(res: SimResult) -> dict:
    events: list[dict] = []
    pids = sorted({e.gpu for e in res.events})
    for pid in pids:
        name = "CPU" if pid < 0 else f"GPU {pid}" + (f" ({res.gpu_names[pid]})" if pid < len(res.gpu_names) else "")
        events.append({"name": "process_name", "ph": "M", "pid": pid + 1, "args": {"name": name}})
        for tid, track in enumerate(TRACKS):
            events.append({"name": "thread_name", "ph": "M", "pid": pid + 1, "tid": tid, "args": {"name": track}})
    tids = {t: i for i, t in enumerate(TRACKS)}
    for e in res.events:
        events.append({"name": e.name, "cat": e.cat, "ph": "X", "ts": e.start * 1e6,
                       "dur": max(0.0, (e.end - e.start) * 1e6), "pid": e.gpu + 1, "tid": tids[e.track]})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"step_s": res.step_s, "generator": "mobius partition simulator"}}
