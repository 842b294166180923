"""The MIP's timing model evaluated for one fixed partition, in one pass (no solver).

:func:`model_schedule` computes the earliest time of every event the MIP has a variable for, by
the same lower bounds the MIP states as constraints (see :mod:`partition.mip`): for a fixed
partition the MIP's optimum *is* this schedule's step time. It serves to seed the MIP with a
strong incumbent (so that stage counts which cannot win are cut off early) and to check the MIP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from partition.costs import ModelProfile, StageCost, stage_cost
from partition.hardware import Hardware
from partition.pipeline import PipelineShape, activation_latency


@dataclass
class ModelSchedule:
    """Earliest times per stage (lists indexed by stage) and the step time ``T``."""

    sf0: list[float]
    sfl: list[float]
    sb0: list[float]
    sbl: list[float]
    uf: list[float]
    ub: list[float]
    pf: list[float]  # bytes prefetched before the forward
    pb: list[float]  # bytes prefetched before the backward
    d: list[float]
    o: list[float]
    T: float


def model_step_time(profile: ModelProfile, hw: Hardware, slots: list[int], micro_batches: int,
                    boundaries: list[int], bandwidth: str = "link", prefetch: bool = True) -> float:
    """The MIP's step time for one partition (``inf`` if it breaks a memory rule)."""
    return model_schedule(profile, hw, slots, micro_batches, boundaries, bandwidth, prefetch).T


def model_schedule(profile: ModelProfile, hw: Hardware, slots: list[int], micro_batches: int,
                   boundaries: list[int], bandwidth: str = "link", prefetch: bool = True) -> ModelSchedule:
    """Every MIP time variable at its earliest value for the partition ``boundaries``."""
    return ModelEvaluator(profile, hw, lambda S: slots, micro_batches, bandwidth, prefetch).schedule(boundaries)


class ModelEvaluator:
    """Evaluates many partitions of one model on one machine, caching stage costs and rates."""

    def __init__(self, profile: ModelProfile, hw: Hardware, slots_for: Callable[[int], list[int]],
                 micro_batches: int, bandwidth: str = "link", prefetch: bool = True):
        self.profile, self.hw, self.slots_for, self.M = profile, hw, slots_for, micro_batches
        self.bandwidth, self.prefetch = bandwidth, prefetch
        self._stage: dict[tuple[int, int], StageCost] = {}
        self._slots: dict[int, list[int]] = {}
        self._rates_cache: dict[int, _Rates] = {}
        self.evaluations = 0

    def stage(self, a: int, b: int) -> StageCost:
        sc = self._stage.get((a, b))
        if sc is None:
            sc = self._stage[(a, b)] = stage_cost(self.profile, a, b)
        return sc

    def slots(self, S: int) -> list[int]:
        if S not in self._slots:
            self._slots[S] = list(self.slots_for(S))
        return self._slots[S]

    def step_time(self, boundaries: list[int]) -> float:
        return self.schedule(boundaries).T

    def _rates(self, S: int) -> "_Rates":
        rates = self._rates_cache.get(S)
        if rates is None:
            slots, hw = self.slots(S), self.hw
            shape = PipelineShape(S, len(slots), self.M)
            gpu = [slots[shape.slot_of(j)] for j in range(S)]
            up = hw.uncontended_h2d if self.bandwidth == "link" else hw.shared_h2d
            down = hw.uncontended_d2h if self.bandwidth == "link" else hw.shared_d2h
            latf = [activation_latency(hw, slots, shape, j - 1, j, 1.0) if j else 0.0 for j in range(S)]
            latb = [activation_latency(hw, slots, shape, j + 1, j, 1.0) if j < S - 1 else 0.0 for j in range(S)]
            rates = self._rates_cache[S] = _Rates(shape, [up(g) for g in gpu], [down(g) for g in gpu], latf, latb)
        return rates

    def schedule(self, boundaries: list[int]) -> ModelSchedule:
        """Every MIP time variable at its earliest value for the partition ``boundaries``."""
        self.evaluations += 1
        st = [self.stage(a, b) for a, b in zip(boundaries, boundaries[1:])]
        r = self._rates(len(st))
        sch = _empty(len(st))
        if not _fits(st, r.shape, self.hw.gpu_memory_bytes):
            sch.T = float("inf")
            return sch
        room = self.hw.gpu_memory_bytes if self.prefetch else None
        _forward(st, r, self.hw.gpu_memory_bytes, room, sch)
        _backward(st, r, self.hw.gpu_memory_bytes, room, sch)
        _finish(st, self.hw, sch)
        return sch


@dataclass
class _Rates:
    """Per stage of an S-stage pipeline: its slot shape, link rates and seconds per activation byte."""

    shape: PipelineShape
    bh: list[float]
    bd: list[float]
    latf: list[float]  # from stage j-1 to j
    latb: list[float]  # from stage j+1 to j


def _empty(S: int) -> ModelSchedule:
    z = [0.0] * S
    return ModelSchedule(*(list(z) for _ in range(10)), T=0.0)


def _fits(st: list[StageCost], shape: PipelineShape, budget: int) -> bool:
    n = shape.num_slots
    for j, sc in enumerate(st):
        bwd = shape.bwd_peak(sc, j)
        if shape.fwd_peak(sc, j) > budget or bwd > budget:
            return False
        if not shape.is_resident(j) and bwd + st[j + n].grad_bytes > budget:
            return False
    return True


def _forward(st: list[StageCost], r: _Rates, G: int, room: int | None, s: ModelSchedule) -> None:
    """Forward times; ``room`` is None without prefetch (nothing uploads early)."""
    shape, bh = r.shape, r.bh
    N, M = shape.num_slots, shape.micro_batches
    for j, sc in enumerate(st):
        if j < N:
            s.uf[j] = sc.param_bytes / bh[j]
        else:
            ef = s.sfl[j - N] + st[j - N].fwd_s
            window = (ef - s.uf[j - N]) * bh[j] if room is not None else 0.0
            s.pf[j] = max(0.0, min(sc.param_bytes, G - shape.fwd_peak(st[j - N], j - N), window))
            s.uf[j] = ef + (sc.param_bytes - s.pf[j]) / bh[j]
        s.sf0[j] = s.uf[j]
        if j > 0:
            lat = r.latf[j] * st[j - 1].out_bytes
            s.sf0[j] = max(s.sf0[j], s.sf0[j - 1] + st[j - 1].fwd_s + lat)
            s.sfl[j] = s.sfl[j - 1] + st[j - 1].fwd_s + lat
        s.sfl[j] = max(s.sfl[j], s.sf0[j] + sc.fwd_s * (M - 1))


def _backward(st: list[StageCost], r: _Rates, G: int, room: int | None, s: ModelSchedule) -> None:
    """Backward times and gradient downloads (stages in reverse)."""
    shape, bh, bd = r.shape, r.bh, r.bd
    S, N, M = shape.num_stages, shape.num_slots, shape.micro_batches
    rb: dict[int, float] = {}
    for j in reversed(range(S)):
        sc = st[j]
        if shape.is_resident(j):
            s.sb0[j] = rb[j] = s.sfl[j] + sc.fwd_s
        else:
            upload = sc.bwd_upload(M)
            eb_prev = s.sbl[j + N] + st[j + N].bwd_s
            window = (eb_prev - rb[j + N]) * bh[j] if room is not None else 0.0
            s.pb[j] = max(0.0, min(upload, G - shape.bwd_peak(st[j + N], j + N), window))
            s.ub[j] = s.sb0[j] = eb_prev + (upload - s.pb[j]) / bh[j]
            if j - N >= 0:
                rb[j] = max(s.ub[j], s.d[j + N])
        s.sbl[j] = s.sb0[j] + sc.bwd_s * (M - 1)
        if j < S - 1:
            lat = r.latb[j] * st[j + 1].in_bytes
            s.sb0[j] = max(s.sb0[j], s.sb0[j + 1] + st[j + 1].bwd_s + lat)
            s.sbl[j] = max(s.sb0[j] + sc.bwd_s * (M - 1), s.sbl[j + 1] + st[j + 1].bwd_s + lat)
        down = sc.grad_bytes / bd[j]
        s.d[j] = max(s.sbl[j] + sc.bwd_s + down, (s.d[j + N] if j + N < S else 0.0) + down)


def _finish(st: list[StageCost], hw: Hardware, s: ModelSchedule) -> None:
    """The CPU optimizer updates stages in backward order as their gradients arrive."""
    rate = hw.cpu_adam_params_per_s
    for j in reversed(range(len(st))):
        s.o[j] = max(s.d[j], s.o[j + 1] if j + 1 < len(st) else 0.0) + st[j].param_count / rate
    s.T = s.o[0]
