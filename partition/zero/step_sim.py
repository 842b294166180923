"""Zero mode's step time: an event simulation of the runtime's streams (compute, gathers,
collectives, downloads, the CPU optimizer thread) over two steps (three under ``train.update: delayed``),
so that the CPU updates that run into the next step are counted; and the bytes each rank moves per step.

An offloaded chunk's next gather uploads the half copy its CPU update rewrites: in sync once the update
has run; under ``train.update: delayed`` once its gradient is down, since the runtime then copies the
master (one update old) into that copy on the CPU thread, ahead of every AdamW that has not begun (it
pushes those back), and the chunk's next gradient download waits for the AdamW to have read the gradient
shard, holding up the dispatch.

Each stream is a lane that runs its operations one after another in issue order. The rank's PCIe
link is two more lanes, one per direction, that everything crossing it holds while it moves its
bytes: uploads of offloaded chunks (host->GPU), gradient downloads (GPU->host) and, where the
collectives go through host memory (no P2P), each collective's two hops (GPU->host, then
host->GPU, half its time each), so that a collective and an upload share the link instead of
both running at its full rate. ``ZeroHardware``'s rates are per rank with every rank moving at
once, so the root complex's share is in them.

The ranks run alike at the means; with the spreads the runs on the machine measured (:func:`with_spread`, the step
a plan reports) each rank's computes are drawn (:mod:`partition.spread`) and the simulated lanes are rank 0's:
the other ranks run ahead or behind it (``_StepSim.lag``), a collective begins when the last rank issues it, and
a wait for one (a gather's all-gather, a blocking reduce-scatter, the step's statistics) lines them up again."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from mobius.layout import ChunkLayout
from partition.costs import ModelProfile, compute_copy_work
from partition.schedule.zero import OpKind, chunk_trace, grad_flushes, train_program
from partition.spread import SPREAD_STEPS, compute_factor, mean_period, worker_speeds
from partition.zero.replacement import simulate_cache
from partition.zero.memory import GRAD_BYTES, Setting, Workload, ZeroHardware


@dataclass
class Prediction:
    """A simulated step (the last of two or three, so CPU updates running into it are counted)."""

    step_s: float
    compute_s: float
    stall_s: float  # compute waiting for gathers
    cpu_adam_s: float
    gathers: int
    traffic: dict[str, float]  # bytes per rank per step
    forward_s: float = 0.0  # of compute_s: the forward operators'; the rest the loss's and the backward's (their
    # recomputes and gradient sums included), as a zero run's metrics split them
    spread_s: float = 0.0  # of step_s, what the ranks' computes varying add (with_spread)
    waits: dict[str, float] = field(default_factory=dict)  # where the dispatch thread waits itself (hw.blocking, CPU
    # workers; none on a GPU, whose dispatch runs ahead of its streams): for gathers (``stall_s``) and reduce-scatters

    def time_split(self) -> dict[str, float]:
        """The compute's phases, as :func:`partition.calibrate.fit_scale` reads them, and the dispatch thread's
        waits (``waits``), as a zero run's metrics measure them."""
        return {"forward": self.forward_s, "backward": self.compute_s - self.forward_s, **self.waits}


@dataclass
class _Lanes:
    gather: float = 0.0  # the gather stream (uploads, casts)
    g2g: float = 0.0  # the collectives (one communicator: all-gathers and reduce-scatters in issue order)
    d2h: float = 0.0  # the GPU->host link (gradient downloads; host-staged collectives' first hop)
    h2d: float = 0.0  # the host->GPU link (uploads of offloaded chunks; host-staged collectives' second hop)
    cpu: float = 0.0  # the CPU optimizer thread
    compute: float = 0.0


def _op_seconds(prof: ModelProfile, op: Any, w: Workload) -> float:
    u = prof.units[op.unit]
    if op.kind in (OpKind.FORWARD, OpKind.EVAL):
        return w.micro_batches * u.fwd_s
    if op.kind == OpKind.LOSS or w.checkpointing:
        return w.micro_batches * u.bwd_s  # forward (or recompute) and backward
    return w.micro_batches * max(u.bwd_s - u.fwd_s, 0.0)


_KIND_CODE = {k: i for i, k in enumerate(OpKind)}  # ints hash alike in every process (strings do not)
_WAITS = {"gather_wait": "stall", "reduce_scatter": "reduce_scatter"}  # Prediction.waits -> the step's stats


def with_spread(nominal: Prediction, layout: ChunkLayout, prof: ModelProfile, hw: ZeroHardware, s: Setting,
                w: Workload) -> Prediction:
    """``nominal`` (:func:`predict`'s of the setting) with the step when each rank's speed varies from step to step by
    ``prof.worker_spread`` and each of its computes by ``prof.compute_spread``: the mean period of one seeded
    simulation of :data:`SPREAD_STEPS` steps that draws them, the difference in ``spread_s``, and the dispatch
    thread's waits the mean of those steps' (where a collective waits for the slowest rank); the compute's phases as
    at the means. ``nominal`` itself without either spread."""
    if prof.worker_spread <= 0 and prof.compute_spread <= 0:
        return nominal
    sim, ends, waits = _StepSim(layout, prof, hw, s, w, draw=0), [], []
    for _ in range(SPREAD_STEPS):
        stats = sim.step()
        ends.append(sim.lanes.compute)
        waits.append({k: stats[v] for k, v in _WAITS.items()})
    extra = mean_period(ends) - nominal.step_s
    mean = {k: sum(x[k] for x in waits[2:]) / len(waits[2:]) for k in nominal.waits}  # (as mean_period's steps)
    return dataclasses.replace(nominal, step_s=nominal.step_s + extra, spread_s=extra, waits=mean)


def predict(layout: ChunkLayout, prof: ModelProfile, hw: ZeroHardware, s: Setting, w: Workload) -> Prediction:
    """Predicted steady-state step time and per-step traffic of one setting, every compute at its mean."""
    sim = _StepSim(layout, prof, hw, s, w)
    ends, stats = [], {}
    for _ in range(3 if w.delayed else 2):  # delayed: an update's AdamW may hold up the step after next
        stats = sim.step()
        ends.append(sim.lanes.compute)
    N, P, sh, e, run = hw.ranks, layout.padded, layout.shard, w.elem, sim.run
    off = [c for c in run.gathered_chunks() if c >= s.gpu_chunks]
    flush_count = sum(len(f) for f in sim.flushes)
    traffic = {"replaced_bytes": run.gathers * P * e, "allgather_bytes": run.gathers * (N - 1) * sh * e,
               "reduce_scatter_bytes": flush_count * (N - 1) * sh * GRAD_BYTES,
               "h2d_bytes": len(off) * sh * e, "d2h_bytes": sum(layout.trains(c) for c in range(s.gpu_chunks, layout.num_chunks)) * sh * GRAD_BYTES}
    waits = {k: stats[v] for k, v in _WAITS.items()} if hw.blocking else {}
    return Prediction(ends[-1] - ends[-2], stats["compute"], stats["stall"], stats["cpu"], run.gathers, traffic,
                      stats["forward"], waits=waits)


class _StepSim:
    """Steps of the runtime on its lanes (carried from step to step, as are the CPU updates' ends)."""

    def __init__(self, layout: ChunkLayout, prof: ModelProfile, hw: ZeroHardware, s: Setting, w: Workload,
                 draw: int = -1):
        self.layout, self.prof, self.hw, self.s, self.w = layout, prof, hw, s, w
        self.draw, self.index = draw, -1  # the seed of the speeds drawn at every step (-1: none); this step's index
        self.lag = [0.0] * hw.ranks  # each rank's compute behind rank 0's (the lanes'; ahead: negative)
        self.speeds = [1.0] * hw.ranks  # each rank's factor in this step (a draw's)
        self.program = train_program(layout.num_units)
        self.trace = chunk_trace(self.program, layout)
        self.flushes = grad_flushes(self.program, layout)
        self.run = simulate_cache(self.trace, s.cache_blocks, w.prefetch)
        self.runs = {c: sum(c in f for f in self.flushes) for c in range(layout.num_chunks)}
        sh, e, N, lat = layout.shard, w.elem, hw.ranks, hw.collective_s
        self.cost = {"upload": lat + sh * e / hw.c2g_Bps, "cast": lat + sh * (4 + e) / hw.device_Bps,
                     "allgather": lat + (N - 1) * sh * e / hw.g2g_Bps if N > 1 else 0.0,
                     "reduce": prof.reduce_scatter_x * (lat + ((N - 1) * sh * GRAD_BYTES / hw.g2g_Bps if N > 1
                                                               else 2 * sh * GRAD_BYTES / hw.device_Bps)),
                     "download": lat + sh * GRAD_BYTES / hw.g2c_Bps, "cpu_adam": sh / hw.cpu_adam_params_per_s,
                     "copy": sh * compute_copy_work(w.precision) / hw.cpu_adam_params_per_s}
        self.fold_s = w.micro_batches * (e + 8) / hw.device_Bps  # per parameter: its gradient into the fp32 sums
        self.lanes, self.cpu_ready = _Lanes(), [0.0] * layout.num_chunks  # an offloaded chunk's half copy rewritten
        self.consumed = [0.0] * layout.num_chunks  # an offloaded chunk's last AdamW done with its gradient shard
        self.adams: list[list] = []  # [start, end, chunk] of the CPU AdamWs scheduled (a copy pushes back later ones)
        self.stats: dict[str, float] = {}
        self.block_free: list[float] = []  # per step: when each block's last reader ends
        self.ready: dict[int, float] = {}  # per step: when each gathered chunk is complete
        self.where: dict[int, int] = {}
        self.seen: dict[int, int] = {}  # per step: flushes so far per chunk
        self.barrier_jobs: list[tuple[int, float]] = []  # CPU updates that wait for the norm
        self.flush_end = 0.0

    def step(self) -> dict[str, float]:
        """One step from the end of the previous one; returns its compute, stall and CPU seconds."""
        start = self.lanes.compute
        self.index += 1
        if self.draw >= 0:
            self.speeds = worker_speeds(self.draw, self.index, self.hw.ranks, self.prof.worker_spread)
        self.block_free, self.ready, self.where = [start] * self.s.cache_blocks, {}, {}
        self.seen, self.barrier_jobs, self.flush_end = dict.fromkeys(self.runs, 0), [], start
        self.stats = {"compute": 0.0, "forward": 0.0, "stall": 0.0, "cpu": 0.0, "reduce_scatter": 0.0}
        for t, op in enumerate(self.program):
            self._operator(t, op)
        lanes = self.lanes
        self._line_up(max(lanes.compute + max(self.lag), self.flush_end))  # the step's statistics (an all-reduce)
        lanes.compute += self.hw.collective_s  # begin when the last rank has every flush done
        for c, done in (self.barrier_jobs if self.w.delayed else sorted(self.barrier_jobs)):  # as the runtime
            self._cpu_update(c, max(done, lanes.compute))
        gpu_trainable = sum(self.layout.trains(c) for c in range(min(self.s.gpu_chunks, self.layout.num_chunks)))
        lanes.compute += gpu_trainable * self.layout.shard / self.hw.gpu_adam_params_per_s
        if self.w.delayed:  # the GPU chunks' compute copies take the master first, on the compute stream
            lanes.compute += gpu_trainable * self.layout.shard * (4 + self.w.elem) / self.hw.device_Bps
        return self.stats

    def _operator(self, t: int, op: Any) -> None:
        # the next operator's gathers (prefetch) start as this one's compute is issued (RCache.release); a dispatch
        # thread that computes itself (hw.blocking) issues them when the compute has ended, before its flushes
        early = [] if self.hw.blocking else self.run.prefetched[t]
        lanes = self.lanes
        before = lanes.compute  # (a blocking dispatch thread's fills for this operator count as its wait)
        for c, b in self.run.demand[t] + early:
            self._gather(c, b)
        begin = self._line_up(max((self.ready[c] for c in self.trace[t]), default=-math.inf))  # its gathers' ends
        dt = _op_seconds(self.prof, op, self.w) + (self.fold_s * _unit_numel(self.layout, op.unit)
                                                  if op.makes_grads else 0.0)
        if self.draw >= 0:  # each rank's own time for the operator
            key = (self.draw, self.index // 2, _KIND_CODE[op.kind], op.unit)
            f = [x * compute_factor(self.prof.compute_spread, (*key, r), self.index) for r, x in enumerate(self.speeds)]
            self.lag = [lag + dt * (fr - f[0]) for lag, fr in zip(self.lag, f)]
            dt *= f[0]
        self.stats["stall"] += begin - before
        self.stats["compute"] += dt
        if op.kind in (OpKind.FORWARD, OpKind.EVAL):
            self.stats["forward"] += dt
        lanes.compute = begin + dt
        for c in self.trace[t]:
            self.block_free[self.where[c]] = lanes.compute
        for c, b in self.run.prefetched[t] if self.hw.blocking else ():
            self._gather(c, b)
        for c in self.flushes[t]:
            self._flush(c)

    def _gather(self, c: int, b: int) -> None:
        lanes, offloaded = self.lanes, c >= self.s.gpu_chunks
        begin = max(lanes.gather, self.block_free[b], self.cpu_ready[c] if offloaded else 0.0)
        if self.hw.blocking:  # the dispatch thread fills the block between its computes
            begin = max(begin, lanes.compute)
        if offloaded:  # the upload holds the host->GPU link
            begin = max(begin, lanes.h2d)
            lanes.gather = lanes.h2d = begin + self.cost["upload"]
        else:
            lanes.gather = begin + self.cost["cast"]
        if self.hw.blocking:
            lanes.compute = lanes.gather
        self.ready[c] = self._collective(lanes.gather, self.cost["allgather"]) if self.hw.ranks > 1 else lanes.gather
        self.where[c] = b

    def _collective(self, ready: float, seconds: float) -> float:
        """A collective issued at ``ready`` on the communicator, lasting ``seconds``; through host
        memory it holds the GPU->host link for its first half and the host->GPU link for its second.
        Returns its end."""
        lanes = self.lanes
        begin = max(lanes.g2g, ready + max(self.lag))  # when the last rank issues it
        if not (self.hw.host_staged and self.hw.ranks > 1):
            lanes.g2g = begin + seconds
            return lanes.g2g
        lanes.d2h = max(begin, lanes.d2h) + seconds / 2
        lanes.h2d = lanes.g2g = max(lanes.d2h, lanes.h2d) + seconds / 2
        return lanes.g2g

    def _line_up(self, at: float) -> float:
        """Every rank's compute waits until ``at`` (the end of a collective they all wait for), a rank already past
        it not at all: rank 0's lane and the others' lags move so. Returns rank 0's time then."""
        now = self.lanes.compute
        self.lanes.compute = max(now, at)
        self.lag = [max(now + lag, at) - self.lanes.compute for lag in self.lag]
        return self.lanes.compute

    def _flush(self, c: int) -> None:
        lanes = self.lanes
        self.seen[c] += 1
        final = self.seen[c] == self.runs[c] and c >= self.s.gpu_chunks
        if final:  # the dispatch waits for the chunk's last AdamW to have read its gradient shard (delayed)
            lanes.compute = max(lanes.compute, self.consumed[c])
        done = self._collective(lanes.compute, self.cost["reduce"])
        if self.hw.blocking:  # the dispatch thread waits for its reduce-scatter
            before = lanes.compute
            self.stats["reduce_scatter"] += self._line_up(done) - before
        if final:
            lanes.d2h = max(lanes.d2h, done) + self.cost["download"]
            done = lanes.d2h
            if self.w.delayed:  # the compute copy takes the master as the gradient lands
                self._copy(c, done)
            if self.w.barrier:
                self.barrier_jobs.append((c, done))
            else:
                self._cpu_update(c, done)
        self.flush_end = max(self.flush_end, done)

    def _cpu_update(self, c: int, arrived: float) -> None:
        begin = max(self.lanes.cpu, arrived)
        self.lanes.cpu = self.consumed[c] = begin + self.cost["cpu_adam"]
        self.adams.append([begin, self.lanes.cpu, c])
        if not self.w.delayed:
            self.cpu_ready[c] = self.lanes.cpu
        self.stats["cpu"] += self.cost["cpu_adam"]

    def _copy(self, c: int, arrived: float) -> None:
        """Delayed: chunk c's compute copy from its master on the CPU thread once its gradient is down, after the
        AdamW running then and before every one that has not begun (each pushed back by the copy)."""
        dt = self.cost["copy"]
        begin = next((end for start, end, _ in self.adams if start <= arrived < end), arrived)
        for job in self.adams:
            if job[0] >= begin:
                job[0] += dt
                job[1] += dt
                self.consumed[job[2]] = max(self.consumed[job[2]], job[1])
        self.lanes.cpu = self.lanes.cpu + dt if self.lanes.cpu > begin else begin + dt
        self.cpu_ready[c] = begin + dt
        self.stats["cpu"] += dt


def _unit_numel(layout: ChunkLayout, unit: int) -> int:
    return sum(p.numel for p in layout.params if unit in p.units)
