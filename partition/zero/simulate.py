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
once, so the root complex's share is in them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mobius.layout import ChunkLayout
from partition.costs import ModelProfile, compute_copy_work
from partition.schedule.zero import OpKind, chunk_trace, grad_flushes, train_program
from partition.zero.cache import simulate_cache
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

    def time_split(self) -> dict[str, float]:
        """The compute's phases, as :func:`partition.calibrate.fit_scale` reads them."""
        return {"forward": self.forward_s, "backward": self.compute_s - self.forward_s}


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


def predict(layout: ChunkLayout, prof: ModelProfile, hw: ZeroHardware, s: Setting, w: Workload) -> Prediction:
    """Predicted steady-state step time and per-step traffic of one setting."""
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
    return Prediction(ends[-1] - ends[-2], stats["compute"], stats["stall"], stats["cpu"], run.gathers, traffic,
                      stats["forward"])


class _StepSim:
    """Steps of the runtime on its lanes (carried from step to step, as are the CPU updates' ends)."""

    def __init__(self, layout: ChunkLayout, prof: ModelProfile, hw: ZeroHardware, s: Setting, w: Workload):
        self.layout, self.prof, self.hw, self.s, self.w = layout, prof, hw, s, w
        self.program = train_program(layout.num_units)
        self.trace = chunk_trace(self.program, layout)
        self.flushes = grad_flushes(self.program, layout)
        self.run = simulate_cache(self.trace, s.cache_blocks, w.prefetch)
        self.runs = {c: sum(c in f for f in self.flushes) for c in range(layout.num_chunks)}
        sh, e, N, lat = layout.shard, w.elem, hw.ranks, hw.collective_s
        self.cost = {"upload": lat + sh * e / hw.c2g_Bps, "cast": lat + sh * (4 + e) / hw.device_Bps,
                     "allgather": lat + (N - 1) * sh * e / hw.g2g_Bps if N > 1 else 0.0,
                     "reduce": lat + ((N - 1) * sh * GRAD_BYTES / hw.g2g_Bps if N > 1
                                      else 2 * sh * GRAD_BYTES / hw.device_Bps),
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
        self.block_free, self.ready, self.where = [start] * self.s.cache_blocks, {}, {}
        self.seen, self.barrier_jobs, self.flush_end = dict.fromkeys(self.runs, 0), [], start
        self.stats = {"compute": 0.0, "forward": 0.0, "stall": 0.0, "cpu": 0.0}
        for t, op in enumerate(self.program):
            self._operator(t, op)
        lanes = self.lanes
        lanes.compute = max(lanes.compute, self.flush_end) + self.hw.collective_s  # the step's statistics
        for c, done in (self.barrier_jobs if self.w.delayed else sorted(self.barrier_jobs)):  # as the runtime
            self._cpu_update(c, max(done, lanes.compute))
        gpu_trainable = sum(self.layout.trains(c) for c in range(min(self.s.gpu_chunks, self.layout.num_chunks)))
        lanes.compute += gpu_trainable * self.layout.shard / self.hw.gpu_adam_params_per_s
        if self.w.delayed:  # the GPU chunks' compute copies take the master first, on the compute stream
            lanes.compute += gpu_trainable * self.layout.shard * (4 + self.w.elem) / self.hw.device_Bps
        return self.stats

    def _operator(self, t: int, op: Any) -> None:
        for c, b in self.run.demand[t] + self.run.prefetched[t]:
            self._gather(c, b)
        lanes = self.lanes
        begin = max([lanes.compute] + [self.ready[c] for c in self.trace[t]])
        dt = _op_seconds(self.prof, op, self.w) + (self.fold_s * _unit_numel(self.layout, op.unit)
                                                  if op.makes_grads else 0.0)
        self.stats["stall"] += begin - lanes.compute
        self.stats["compute"] += dt
        if op.kind in (OpKind.FORWARD, OpKind.EVAL):
            self.stats["forward"] += dt
        lanes.compute = begin + dt
        for c in self.trace[t]:
            self.block_free[self.where[c]] = lanes.compute
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
        begin = max(lanes.g2g, ready)
        if not (self.hw.host_staged and self.hw.ranks > 1):
            lanes.g2g = begin + seconds
            return lanes.g2g
        lanes.d2h = max(begin, lanes.d2h) + seconds / 2
        lanes.h2d = lanes.g2g = max(lanes.d2h, lanes.h2d) + seconds / 2
        return lanes.g2g

    def _flush(self, c: int) -> None:
        lanes = self.lanes
        self.seen[c] += 1
        final = self.seen[c] == self.runs[c] and c >= self.s.gpu_chunks
        if final:  # the dispatch waits for the chunk's last AdamW to have read its gradient shard (delayed)
            lanes.compute = max(lanes.compute, self.consumed[c])
        done = self._collective(lanes.compute, self.cost["reduce"])
        if self.hw.blocking:  # the dispatch thread waits for its reduce-scatter
            lanes.compute = max(lanes.compute, done)
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
