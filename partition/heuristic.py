"""A fast local search on the MIP's own timing model, to seed the MIP with a strong incumbent.

For every stage count a time-proportional split is scored with :class:`ModelEvaluator`; the best
few are improved by hill climbing (move one boundary by one unit, merge two neighbouring stages,
split a stage in two) until no move helps or the evaluation budget is spent. The MIP then only
has to beat (or prove it cannot beat) the result, which lets it cut most stage counts off early.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from dataclasses import dataclass

import numpy as np

from partition.evaluate import GB, ModelEvaluator
from partition.timing import VariantNumbers, StageExprs, step_model


@dataclass
class Incumbent:
    """The best partition found, and the heuristic's value and best partition for each stage count."""

    boundaries: list[int] | None
    step_s: float
    per_stage_count: dict[int, float]
    partitions: dict[int, list[int]] = dataclasses.field(default_factory=dict)  # count -> its best partition


def proportional_split(costs: list[float], parts: int) -> list[int]:
    """Boundaries cutting ``costs`` into ``parts`` non-empty runs of roughly equal sums."""
    n = len(costs)
    prefix = list(itertools.accumulate(costs))
    total = prefix[-1] if prefix and prefix[-1] > 0 else float(n)
    bounds = [0]
    for k in range(1, parts):
        target = total * k / parts
        i = next((i + 1 for i, p in enumerate(prefix) if p >= target), n)
        i = max(i, bounds[-1] + 1)
        i = min(i, n - (parts - k))
        bounds.append(i)
    return bounds + [n]


def neighbours(bounds: list[int]) -> list[list[int]]:
    """Partitions one move away: shift a boundary, merge two stages, split a stage."""
    out = []
    for k in range(1, len(bounds) - 1):
        for delta in (-1, 1):
            b = bounds[k] + delta
            if bounds[k - 1] < b < bounds[k + 1]:
                out.append(bounds[:k] + [b] + bounds[k + 1:])
        out.append(bounds[:k] + bounds[k + 1:])
    for k in range(len(bounds) - 1):
        a, b = bounds[k], bounds[k + 1]
        if b - a >= 2:
            out.append(bounds[:k + 1] + [(a + b) // 2] + bounds[k + 1:])
    return out


def find_incumbent(ev: ModelEvaluator, stage_counts: list[int], starts: int = 3,
                   max_evaluations: int = 1000, deadline: float = math.inf) -> Incumbent:
    """Best partition by local search from time-proportional splits (see module docstring), climbing until
    ``deadline`` (``time.perf_counter()``) at the latest: every stage count's split is scored whatever the time."""
    units = ev.profile.units
    costs = [u.fwd_s + u.bwd_s for u in units]
    per_s: dict[int, float] = {}
    found: dict[int, list[int]] = {}
    seeds: list[tuple[float, list[int]]] = []
    score = _Scores(ev)
    for S in stage_counts:
        bounds = proportional_split(costs, S)
        value = score(bounds)
        per_s[S], found[S] = value, bounds
        seeds.append((value, bounds))
    seeds.sort(key=lambda x: x[0])
    best_val, best = math.inf, None
    budget = ev.evaluations + max_evaluations
    allowed = set(stage_counts)
    for value, bounds in seeds[:starts]:
        if not math.isfinite(value):
            break
        value, bounds = _climb(ev, score, bounds, value, budget, per_s, allowed, found, deadline)
        if value < best_val:
            best_val, best = value, bounds
    return Incumbent(best, best_val, per_s, {S: b for S, b in found.items() if math.isfinite(per_s[S])})


AHEAD = 16  # partitions of one stage count evaluated together (one batch costs about two evaluations)


class _Scores:
    """The evaluator's step time of each partition, computed once: the climbs from several starts
    meet the same partitions, and a partition is evaluated in one batch with the next ones of its
    stage count the climb may ask for (:class:`~partition.timing.VariantNumbers`, the same numbers). Every
    partition asked for counts against the evaluation budget, once per time asked, as before."""

    def __init__(self, ev: ModelEvaluator):
        self.ev, self.seen = ev, {}

    def __call__(self, bounds: list[int], ahead: list[list[int]] = ()) -> float:
        """The step time of ``bounds``, evaluated with those of ``ahead`` (the partitions the climb
        may ask for next) that have its stage count."""
        key = tuple(bounds)
        if key not in self.seen:
            todo = [bounds] + [b for b in ahead if len(b) == len(bounds) and tuple(b) not in self.seen][:AHEAD - 1]
            if len(todo) == 1:
                self.seen[key] = self.ev.step_time(bounds)  # (counts itself)
                return self.seen[key]
            self.seen.update(zip(map(tuple, todo), self._batch(todo)))
        self.ev.evaluations += 1
        return self.seen[key]

    def _batch(self, partitions: list[list[int]]) -> list[float]:
        """Step times of partitions with one stage count, in one evaluation of the timing model."""
        S, ev = len(partitions[0]) - 1, self.ev
        stages = [ev.exprs(b) for b in partitions]
        st = [StageExprs(**{f.name: np.array([getattr(p[j], f.name) for p in stages], dtype=float)
                            for f in dataclasses.fields(StageExprs)}) for j in range(S)]
        alg = VariantNumbers(len(partitions))
        step = np.broadcast_to(step_model(alg, st, ev.rates(S), ev.shape(S), ev.hw.gpu_memory_bytes / GB).step,
                               alg.broken.shape)
        return [math.inf if broken else float(t) for t, broken in zip(step, alg.broken)]


def _climb(ev: ModelEvaluator, score: _Scores, bounds: list[int], value: float, budget: int,
           per_s: dict[int, float], allowed: set[int], found: dict[int, list[int]],
           deadline: float = math.inf) -> tuple[float, list[int]]:
    """First-improvement hill climbing over :func:`neighbours` with stage counts in ``allowed`` (until
    ``deadline``); ``per_s`` / ``found`` keep each count's best value and partition met on the way."""
    improved = True
    while improved and ev.evaluations < budget and time.perf_counter() < deadline:
        improved = False
        cands = [c for c in neighbours(bounds) if len(c) - 1 in allowed]
        for i, cand in enumerate(cands):
            if ev.evaluations >= budget:
                break
            S = len(cand) - 1
            v = score(cand, cands[i + 1:])
            if v < per_s.get(S, math.inf):
                per_s[S], found[S] = v, cand
            if v < value * (1 - 1e-9):
                value, bounds, improved = v, cand, True
                break
    return value, bounds
