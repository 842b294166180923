"""Discrete-event simulation of one Mobius pipeline step (see :mod:`partition.pipeline`).

Resources: one compute engine per GPU; per GPU a host->GPU and a GPU->host link; per root
complex a shared host->GPU and GPU->host capacity (the switch uplink); optionally a per-GPU cap
on both directions together; one CPU optimizer. Transfers are fluid flows. Their rates are set by
priority classes, highest first, each class sharing what capacity is left max-min fairly:

* ``sharing="priority"`` (the runtime's per-root-complex transfer queue): activations and their
  gradients first, then stage uploads in the order the stages are needed, then gradient downloads,
  then checkpoint offloads;
* ``sharing="fair"``: every transfer shares equally (processor sharing, no ordering).

What moves per step: each non-resident phase uploads its stage (parameters; for a backward also
the ``M`` input checkpoints, which live in host memory); activations and gradients cross between
GPUs, through host memory (two hops: GPU->host then host->GPU) unless P2P is available; where an
input did not pass through host memory (P2P, or the same GPU) the stage offloads it as its
checkpoint after use; each stage's gradients are downloaded after its backward; the CPU optimizer
then updates the stage. The token ids and the loss targets are not simulated (bytes per sequence).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Callable, Literal

from partition.costs import ModelProfile, StageCost, stage_costs
from partition.hardware import Hardware
from partition.pipeline import Phase, PipelineShape

Sharing = Literal["priority", "fair"]
_EPS_BYTES = 1e-3
_EPS_T = 1e-12


@dataclass
class SimEvent:
    """One span on the timeline. ``gpu`` is the physical GPU, or -1 for the CPU."""

    gpu: int
    track: str  # compute | h2d | d2h | p2p | cpu
    name: str
    start: float
    end: float
    cat: str  # fwd | bwd | upload | act | grad | ckpt | adam


@dataclass
class StageTiming:
    """When a stage ran and how much of its uploads were prefetched."""

    fwd_start: float = math.nan
    fwd_end: float = math.nan
    bwd_start: float = math.nan
    bwd_end: float = math.nan
    fwd_prefetched: float = 0.0
    bwd_prefetched: float = 0.0


@dataclass
class SimResult:
    """Outcome of simulating one step."""

    step_s: float
    compute_end_s: float
    peak_bytes: list[int]  # per physical GPU
    h2d_bytes: list[float]  # per GPU, host->GPU (stage uploads, checkpoints, activation second hops)
    d2h_bytes: list[float]  # per GPU, GPU->host (gradients, activation first hops, checkpoint offloads)
    p2p_bytes: list[float]  # per GPU, sent peer-to-peer
    rc_h2d_bytes: list[float]  # per root complex
    rc_d2h_bytes: list[float]
    bytes_by_kind: dict[str, float]
    stages: list[StageTiming]
    events: list[SimEvent] = field(repr=False, default_factory=list)
    gpu_names: list[str] = field(default_factory=list)

    def total_bytes(self) -> float:
        """All bytes moved over host links (P2P counted once)."""
        return sum(self.h2d_bytes) + sum(self.d2h_bytes) + sum(self.p2p_bytes)

    def to_ascii(self, width: int = 100) -> str:
        """The timeline as a text grid: per GPU a compute row and its two link rows, then the CPU."""
        return _ascii(self, width)

    def to_chrome_trace(self) -> dict:
        """The timeline in Chrome trace format (open in https://ui.perfetto.dev)."""
        return _chrome_trace(self)

    def write_chrome_trace(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_chrome_trace(), f)


@dataclass
class _Flow:
    label: str
    kind: str
    total: float
    resources: tuple
    cap: float
    prio: tuple
    on_done: Callable[[float], None]
    gpu: int
    track: str
    start: float
    limit: float = math.inf
    done: float = 0.0
    rate: float = 0.0
    dst_gpu: int | None = None

    def active(self) -> bool:
        return self.done < min(self.limit, self.total) - _EPS_BYTES


@dataclass
class _Slot:
    gpu: int
    phases: list[Phase]
    cur: int = 0  # first phase not yet ended
    mb: int = 0  # next micro-batch of the current phase
    busy_until: float | None = None
    next_upload: int = 0  # next phase whose upload has not started
    upload_flow: dict = field(default_factory=dict)  # phase index -> flow
    upload_done: dict = field(default_factory=dict)  # phase index -> time
    phase_end: dict = field(default_factory=dict)  # phase index -> time


def simulate(profile: ModelProfile, boundaries: list[int], hardware: Hardware, slots: list[int] | None = None,
             micro_batches: int = 4, prefetch: bool = True, sharing: Sharing = "priority",
             record: bool = True) -> SimResult:
    """Simulate one training step of the partition ``boundaries`` and return its timeline and totals.

    ``slots[s]`` is the physical GPU of slot ``s``; stage ``j`` runs on ``slots[j % len(slots)]``
    (default: GPUs 0..N-1 in order). ``prefetch=False`` uploads a stage only after the previous one ends.
    """
    stages = stage_costs(profile, boundaries)
    slots = list(range(hardware.num_gpus)) if slots is None else list(slots)
    engine = _Engine(stages, hardware, slots, micro_batches, prefetch, sharing, record)
    return engine.run()


class _Engine:
    """The event loop: start what is ready, share bandwidth, jump to the next completion."""

    def __init__(self, stages: list[StageCost], hw: Hardware, slots: list[int], micro_batches: int,
                 prefetch: bool, sharing: Sharing, record: bool):
        self.stages, self.hw, self.M = stages, hw, micro_batches
        self.prefetch, self.sharing, self.record = prefetch, sharing, record
        self.shape = PipelineShape(len(stages), len(slots), micro_batches)
        self.slot_gpu = slots
        self.slots = [_Slot(g, self.shape.phases(s)) for s, g in enumerate(slots)]
        self.t = 0.0
        self.flows: list[_Flow] = []
        self.act_ready: dict[tuple[bool, int, int], float] = {}
        self.grad_done: dict[int, float] = {}
        self.adam_next = len(stages) - 1
        self.adam_until: float | None = None
        self.events: list[SimEvent] = []
        self.timing = [StageTiming() for _ in stages]
        n = hw.num_gpus
        self.h2d, self.d2h, self.p2p = [0.0] * n, [0.0] * n, [0.0] * n
        self.rc_h2d, self.rc_d2h = [0.0] * len(hw.groups), [0.0] * len(hw.groups)
        self.by_kind: dict[str, float] = {}
        self.pending_grads = [0.0] * n
        self.peak = [0] * n
        self.compute_end = 0.0
        self.capacity = self._capacities()
        for m in range(micro_batches):
            self.act_ready[(False, 0, m)] = 0.0
            self.act_ready[(True, len(stages) - 1, m)] = 0.0

    def _capacities(self) -> dict:
        hw, cap = self.hw, {}
        for g in range(hw.num_gpus):
            cap[("h2d", g)], cap[("d2h", g)] = hw.h2d_Bps[g], hw.d2h_Bps[g]
            if hw.bidir_Bps:
                cap[("bidir", g)] = hw.bidir_Bps[g]
        for k in range(len(hw.groups)):
            cap[("rc_h2d", k)], cap[("rc_d2h", k)] = hw.rc_h2d_Bps[k], hw.rc_d2h_Bps[k]
        return cap

    # ------------------------------------------------------------------------------ main loop
    def run(self) -> SimResult:
        while True:
            while self._start_ready():
                pass
            self._allocate()
            t_next = self._next_time()
            if t_next == math.inf:
                break
            self._advance(t_next)
            self._sample_memory()
            self._complete_due()
            self._sample_memory()
        self._check_finished()
        return self._result()

    def _start_ready(self) -> bool:
        started = False
        for s, slot in enumerate(self.slots):
            started |= self._try_upload(s, slot)
            started |= self._try_compute(s, slot)
        return self._try_adam() or started

    def _next_time(self) -> float:
        times = [sl.busy_until for sl in self.slots if sl.busy_until is not None]
        if self.adam_until is not None:
            times.append(self.adam_until)
        for f in self.flows:
            if f.rate > 0:
                times.append(self.t + (min(f.limit, f.total) - f.done) / f.rate)
        return max(min(times), self.t) if times else math.inf

    def _advance(self, t_next: float) -> None:
        dt = t_next - self.t
        for f in self.flows:
            cap = min(f.limit, f.total)
            f.done = min(f.done + f.rate * dt, cap)
            if cap - f.done < _EPS_BYTES:
                f.done = cap
        self.t = t_next

    def _complete_due(self) -> None:
        for f in [f for f in self.flows if f.total - f.done < _EPS_BYTES]:
            self.flows.remove(f)
            self._finish_flow(f)
        for s, slot in enumerate(self.slots):
            if slot.busy_until is not None and slot.busy_until <= self.t + _EPS_T:
                slot.busy_until = None
                self._finish_compute(s, slot)
        if self.adam_until is not None and self.adam_until <= self.t + _EPS_T:
            self.adam_until = None
            self.adam_next -= 1

    def _check_finished(self) -> None:
        for slot in self.slots:
            assert slot.cur == len(slot.phases), f"simulation stalled on GPU {slot.gpu} at phase {slot.cur}"
        assert self.adam_next < 0 and not self.flows, "simulation stalled in the optimizer or a transfer"

    # ------------------------------------------------------------------------------ uploads
    def _window_open(self, slot: _Slot, i: int) -> bool:
        """May the upload of phase ``i`` start (is phase ``i-1`` running, or the slot idle before it)?"""
        if i == 0:
            return True
        prev = i - 1
        if not self.prefetch:
            return prev in slot.phase_end
        if not slot.phases[prev].resident and prev not in slot.upload_done:
            return False
        if prev >= 1 and prev - 1 not in slot.phase_end:
            return False
        before = slot.phases[prev - 1] if prev >= 1 else None
        if slot.phases[prev].backward and before is not None and before.backward:
            return before.stage in self.grad_done
        return True

    def _try_upload(self, s: int, slot: _Slot) -> bool:
        while slot.next_upload < len(slot.phases) and slot.phases[slot.next_upload].resident:
            slot.next_upload += 1
        i = slot.next_upload
        if i >= len(slot.phases) or not self._window_open(slot, i):
            return False
        if any(f.kind == "upload" and f.gpu == slot.gpu for f in self.flows):
            return False
        phase = slot.phases[i]
        sc = self.stages[phase.stage]
        nbytes = self.shape.upload_bytes(sc, phase)
        limit = math.inf
        if i >= 1 and i - 1 not in slot.phase_end:
            limit = max(0.0, self.hw.gpu_memory_bytes - self.shape.phase_peak(self.stages[slot.phases[i - 1].stage],
                                                                               slot.phases[i - 1]))
        order = phase.stage if not phase.backward else 2 * self.shape.num_stages - phase.stage
        flow = self._h2d_flow(slot.gpu, f"C{phase.label}", "upload", nbytes, (1, order),
                              lambda t, sl=slot, k=i: self._upload_finished(sl, k, t))
        flow.limit = limit
        slot.upload_flow[i] = flow
        slot.next_upload += 1
        return True

    def _upload_finished(self, slot: _Slot, i: int, t: float) -> None:
        slot.upload_done[i] = t

    # ------------------------------------------------------------------------------ compute
    def _ready(self, slot: _Slot) -> bool:
        i = slot.cur
        phase = slot.phases[i]
        if not phase.resident and i not in slot.upload_done:
            return False
        if self.act_ready.get((phase.backward, phase.stage, slot.mb), math.inf) > self.t + _EPS_T:
            return False
        if phase.backward and not phase.resident and slot.mb == 0:
            prev = slot.phases[i - 1].stage
            need = self.shape.bwd_peak(self.stages[phase.stage], phase.stage) + self.stages[prev].grad_bytes
            if need > self.hw.gpu_memory_bytes and prev not in self.grad_done:
                return False
        return True

    def _try_compute(self, s: int, slot: _Slot) -> bool:
        if slot.busy_until is not None or slot.cur >= len(slot.phases) or not self._ready(slot):
            return False
        phase = slot.phases[slot.cur]
        sc = self.stages[phase.stage]
        dur = sc.bwd_s if phase.backward else sc.fwd_s
        slot.busy_until = self.t + dur
        tm = self.timing[phase.stage]
        if slot.mb == 0:
            if phase.backward:
                tm.bwd_start = self.t
            else:
                tm.fwd_start = self.t
        self._event(slot.gpu, "compute", f"{phase.label}.{slot.mb}", self.t, self.t + dur,
                    "bwd" if phase.backward else "fwd")
        return True

    def _finish_compute(self, s: int, slot: _Slot) -> None:
        phase = slot.phases[slot.cur]
        j, m = phase.stage, slot.mb
        self.compute_end = max(self.compute_end, self.t)
        if not phase.backward:
            self._send(j, j + 1, m, backward=False)
        else:
            self._send(j, j - 1, m, backward=True)
        self._maybe_offload_checkpoint(slot, phase, m)
        slot.mb += 1
        if slot.mb == self.M:
            self._end_phase(slot)

    def _end_phase(self, slot: _Slot) -> None:
        i, phase = slot.cur, slot.phases[slot.cur]
        slot.phase_end[i] = self.t
        tm = self.timing[phase.stage]
        nxt = slot.upload_flow.get(i + 1)
        if nxt is not None:
            prefetched = nxt.done
            if slot.phases[i + 1].backward:
                self.timing[slot.phases[i + 1].stage].bwd_prefetched = prefetched
            else:
                self.timing[slot.phases[i + 1].stage].fwd_prefetched = prefetched
            nxt.limit = math.inf
        if phase.backward:
            tm.bwd_end = self.t
            self._download_grads(slot, phase.stage)
        else:
            tm.fwd_end = self.t
        slot.cur += 1
        slot.mb = 0

    # ------------------------------------------------------------------------------ transfers
    def _send(self, src: int, dst: int, m: int, backward: bool) -> None:
        if dst < 0 or dst >= len(self.stages):
            return
        nbytes = self.stages[src].in_bytes if backward else self.stages[src].out_bytes
        g_src = self.slot_gpu[self.shape.slot_of(src)]
        g_dst = self.slot_gpu[self.shape.slot_of(dst)]
        key = (backward, dst, m)
        name = f"{'g' if backward else 'a'}{src}>{dst}.{m}"

        def arrived(t: float) -> None:
            self.act_ready[key] = t

        if g_src == g_dst or nbytes == 0:
            arrived(self.t)
        elif self.hw.p2p_rate(g_src, g_dst):
            self._p2p_flow(g_src, g_dst, name, nbytes, arrived)
        else:
            self._d2h_flow(g_src, name, "act", nbytes, (0,),
                           lambda t: self._h2d_flow(g_dst, name, "act", nbytes, (0,), arrived))

    def _maybe_offload_checkpoint(self, slot: _Slot, phase: Phase, m: int) -> None:
        """Inputs that did not pass through host memory are offloaded as checkpoints after use."""
        j = phase.stage
        if phase.backward or j == 0 or self.shape.is_resident(j):
            return
        src_gpu = self.slot_gpu[self.shape.slot_of(j - 1)]
        if src_gpu != slot.gpu and not self.hw.p2p_rate(src_gpu, slot.gpu):
            return
        nbytes = self.stages[j].in_bytes
        self._d2h_flow(slot.gpu, f"ckpt{j}.{m}", "ckpt", nbytes, (3, j), lambda t: None)

    def _download_grads(self, slot: _Slot, stage: int) -> None:
        nbytes = self.stages[stage].grad_bytes
        self.pending_grads[slot.gpu] += nbytes

        def done(t: float, g: int = slot.gpu) -> None:
            self.pending_grads[g] -= nbytes
            self.grad_done[stage] = t

        self._d2h_flow(slot.gpu, f"G{stage}", "grad", nbytes, (2, self.shape.num_stages - stage), done)

    def _h2d_flow(self, gpu: int, label: str, kind: str, nbytes: float, prio: tuple,
                  on_done: Callable[[float], None]) -> _Flow:
        res = [("h2d", gpu), ("rc_h2d", self.hw.group_of(gpu))]
        return self._add_flow(label, kind, nbytes, res, math.inf, prio, on_done, gpu, "h2d")

    def _d2h_flow(self, gpu: int, label: str, kind: str, nbytes: float, prio: tuple,
                  on_done: Callable[[float], None]) -> _Flow:
        res = [("d2h", gpu), ("rc_d2h", self.hw.group_of(gpu))]
        return self._add_flow(label, kind, nbytes, res, math.inf, prio, on_done, gpu, "d2h")

    def _p2p_flow(self, src: int, dst: int, label: str, nbytes: float, on_done: Callable[[float], None]) -> _Flow:
        res = [("d2h", src), ("h2d", dst)]
        gs, gd = self.hw.group_of(src), self.hw.group_of(dst)
        if gs != gd:
            res += [("rc_d2h", gs), ("rc_h2d", gd)]
        return self._add_flow(label, "act", nbytes, res, self.hw.p2p_rate(src, dst), (0,), on_done, src, "p2p",
                              dst_gpu=dst)

    def _add_flow(self, label: str, kind: str, nbytes: float, res: list, cap: float, prio: tuple,
                  on_done: Callable[[float], None], gpu: int, track: str, dst_gpu: int | None = None) -> _Flow:
        if self.hw.bidir_Bps:
            res = res + [("bidir", gpu)] + ([("bidir", dst_gpu)] if dst_gpu is not None else [])
        flow = _Flow(label, kind, float(nbytes), tuple(res), cap, prio if self.sharing == "priority" else (0,),
                     on_done, gpu, track, self.t, dst_gpu=dst_gpu)
        if nbytes <= 0:
            on_done(self.t)
            return flow
        self.flows.append(flow)
        return flow

    def _finish_flow(self, f: _Flow) -> None:
        hw = self.hw
        self.by_kind[f.kind] = self.by_kind.get(f.kind, 0.0) + f.total
        if f.track == "h2d":
            self.h2d[f.gpu] += f.total
            self.rc_h2d[hw.group_of(f.gpu)] += f.total
        elif f.track == "d2h":
            self.d2h[f.gpu] += f.total
            self.rc_d2h[hw.group_of(f.gpu)] += f.total
        else:
            self.p2p[f.gpu] += f.total
        cat = {"upload": "upload", "act": "act", "grad": "grad", "ckpt": "ckpt"}[f.kind]
        self._event(f.gpu, f.track, f.label, f.start, self.t, cat)
        f.on_done(self.t)

    # ------------------------------------------------------------------------------ sharing
    def _allocate(self) -> None:
        """Strict priority between classes, max-min fair inside a class (progressive filling)."""
        remaining = dict(self.capacity)
        for f in self.flows:
            f.rate = 0.0
        active = [f for f in self.flows if f.active()]
        for prio in sorted({f.prio for f in active}):
            _fill([f for f in active if f.prio == prio], remaining, self.capacity)

    # ------------------------------------------------------------------------------ optimizer
    def _try_adam(self) -> bool:
        j = self.adam_next
        if self.adam_until is not None or j < 0 or j not in self.grad_done:
            return False
        dur = self.stages[j].param_count / self.hw.cpu_adam_params_per_s
        self.adam_until = self.t + dur
        self._event(-1, "cpu", f"adam{j}", self.t, self.t + dur, "adam")
        return True

    # ------------------------------------------------------------------------------ bookkeeping
    def _sample_memory(self) -> None:
        for slot in self.slots:
            used = self.pending_grads[slot.gpu]
            if slot.cur < len(slot.phases):
                phase = slot.phases[slot.cur]
                used += self.shape.phase_peak(self.stages[phase.stage], phase)
                nxt = slot.upload_flow.get(slot.cur + 1)
                if nxt is not None:
                    used += nxt.done
            self.peak[slot.gpu] = max(self.peak[slot.gpu], int(used))

    def _event(self, gpu: int, track: str, name: str, start: float, end: float, cat: str) -> None:
        if self.record:
            self.events.append(SimEvent(gpu, track, name, start, end, cat))

    def _result(self) -> SimResult:
        step = max(self.compute_end, self.t)
        return SimResult(step_s=step, compute_end_s=self.compute_end, peak_bytes=self.peak, h2d_bytes=self.h2d,
                         d2h_bytes=self.d2h, p2p_bytes=self.p2p, rc_h2d_bytes=self.rc_h2d, rc_d2h_bytes=self.rc_d2h,
                         bytes_by_kind=self.by_kind, stages=self.timing, events=self.events,
                         gpu_names=list(self.hw.gpu_names))


def _fill(flows: list[_Flow], remaining: dict, capacity: dict) -> None:
    """Max-min fair rates for ``flows`` within ``remaining`` capacity (reduced in place)."""
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
_TRACKS = ["compute", "h2d", "d2h", "p2p"]


def _ascii(res: SimResult, width: int) -> str:
    """Text grid: compute cells show the stage (forward lower case a-z, backward upper case)."""
    end = res.step_s or 1.0
    cell = end / width
    gpus = sorted({e.gpu for e in res.events if e.gpu >= 0})
    rows = []
    for g in gpus:
        for track in _TRACKS:
            evs = [e for e in res.events if e.gpu == g and e.track == track]
            if not evs and track != "compute":
                continue
            label = f"GPU{g} {track}" if track == "compute" else f"     {track}"
            rows.append(f"{label:<12}|{_row(evs, cell, width)}|")
    cpu = [e for e in res.events if e.gpu < 0]
    rows.append(f"{'CPU adam':<12}|{_row(cpu, cell, width)}|")
    legend = (f"step {res.step_s * 1e3:.1f} ms, {cell * 1e3:.2f} ms per column; compute: stage j forward = "
              f"chr('a'+j%26), backward = upper case; links: > upload, a activation, g gradient, < grad download, "
              f"c checkpoint; CPU: stage (mod 10) being updated")
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
        stage = int(e.name[1:].split(".")[0])
        ch = chr(ord("a") + stage % 26)
        return ch.upper() if e.cat == "bwd" else ch
    if e.cat == "adam":
        return str(int(e.name[4:]) % 10)
    return {"upload": ">", "grad": "<", "ckpt": "c"}.get(e.cat, "g" if e.name.startswith("g") else "a")


def _chrome_trace(res: SimResult) -> dict:
    events: list[dict] = []
    pids = sorted({e.gpu for e in res.events})
    for pid in pids:
        name = "CPU" if pid < 0 else f"GPU {pid}" + (f" ({res.gpu_names[pid]})" if pid < len(res.gpu_names) else "")
        events.append({"name": "process_name", "ph": "M", "pid": pid + 1, "args": {"name": name}})
        for tid, track in enumerate(_TRACKS + ["cpu"]):
            events.append({"name": "thread_name", "ph": "M", "pid": pid + 1, "tid": tid, "args": {"name": track}})
    tids = {t: i for i, t in enumerate(_TRACKS + ["cpu"])}
    for e in res.events:
        events.append({"name": e.name, "cat": e.cat, "ph": "X", "ts": e.start * 1e6,
                       "dur": max(0.0, (e.end - e.start) * 1e6), "pid": e.gpu + 1, "tid": tids[e.track]})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"step_s": res.step_s, "generator": "mobius partition simulator"}}
