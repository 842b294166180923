"""Partitions to compare the MIP against, and exhaustive search for small models.

* **minimum-stage** (paper §4.3): one block per stage; the embedding joins the first block's
  stage and the head the last block's.
* **maximum-stage** (paper §4.3): each stage as large as memory allows, packed front to back.
* **time-balanced** (torchgpipe's ``balance_by_time``): ``S`` stages of near-equal forward+backward
  time (minimising the slowest), with ``S = N`` or the smallest ``S >= N`` that fits memory.

Every partition returned satisfies the memory rules of :mod:`partition.timing`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable

from partition.costs import ModelProfile, stage_cost
from partition.evaluate import GB, ModelEvaluator, stage_exprs
from partition.schedule import PipelineOptions
from partition.hardware import Hardware
from partition.timing import phase_needs

Baseline = Callable[[ModelProfile, Hardware, int, int, PipelineOptions], "list[int] | None"]


def is_valid(profile: ModelProfile, boundaries: list[int], hw: Hardware, num_gpus: int, micro_batches: int,
             options: PipelineOptions = PipelineOptions()) -> bool:
    """True when the partition fits the GPU memory budget under the pipeline's memory rules."""
    ev = ModelEvaluator(profile, hw, lambda S: list(range(num_gpus)), micro_batches, options=options)
    return not ev.evaluate(boundaries).violations


def minimum_stage(profile: ModelProfile, hw: Hardware, num_gpus: int, micro_batches: int,
                  options: PipelineOptions = PipelineOptions()) -> list[int] | None:
    """One block per stage (the embedding and head ride with the first and last block)."""
    U = profile.num_units
    bounds = [0] + list(range(2, U - 1)) + [U] if U >= 3 else [0, U]
    return bounds if is_valid(profile, bounds, hw, num_gpus, micro_batches, options) else None


def maximum_stage(profile: ModelProfile, hw: Hardware, num_gpus: int, micro_batches: int,
                  options: PipelineOptions = PipelineOptions()) -> list[int] | None:
    """Greedy front-to-back packing of the largest stages that fit.

    A stage grows while it fits alone on its GPU; if the whole partition then breaks a memory rule
    (a worker also keeps its earlier stages' inputs and slots sized for its largest stage), the
    per-stage parameter cap is lowered one unit at a time until it holds.
    """
    cap = float("inf")
    while True:
        bounds = _greedy(profile, hw, micro_batches, options, cap)
        if bounds is None:
            return None
        if is_valid(profile, bounds, hw, num_gpus, micro_batches, options):
            return bounds
        sizes = [sum(u.param_bytes for u in profile.units[a:b]) for a, b in zip(bounds, bounds[1:])]
        smallest = min(u.param_bytes for u in profile.units) or 1
        cap = max(sizes) - smallest
        if cap <= 0:
            return None


def _greedy(profile: ModelProfile, hw: Hardware, micro_batches: int, options: PipelineOptions,
            cap: float) -> list[int] | None:
    U, bounds = profile.num_units, [0]
    while bounds[-1] < U:
        a, b = bounds[-1], bounds[-1] + 1
        while b < U and _fits(profile, a, b + 1, hw, micro_batches, options, cap):
            b += 1
        if not _fits(profile, a, b, hw, micro_batches, options, float("inf")):
            return None
        bounds.append(b)
    return bounds


def _fits(profile: ModelProfile, a: int, b: int, hw: Hardware, micro_batches: int, options: PipelineOptions,
          cap: float) -> bool:
    """Units [a, b) as a stage alone on its GPU, and within the parameter cap."""
    sc = stage_cost(profile, a, b)
    s = stage_exprs(sc, profile.precision != "fp32")
    fwd, bwd = phase_needs(s, s.slot * options.num_slots, 0.0, micro_batches)
    return sc.param_bytes <= cap and max(fwd, bwd) * GB <= hw.gpu_memory_bytes


def time_balanced(profile: ModelProfile, hw: Hardware, num_gpus: int, micro_batches: int,
                  options: PipelineOptions = PipelineOptions()) -> list[int] | None:
    """torchgpipe-style balance by time: S = N stages if they fit, else the smallest S that does."""
    times = [u.fwd_s + u.bwd_s for u in profile.units]
    for S in range(min(num_gpus, profile.num_units), profile.num_units + 1):
        bounds = balanced_split(times, S)
        if is_valid(profile, bounds, hw, num_gpus, micro_batches, options):
            return bounds
    return None


def balanced_split(costs: list[float], parts: int) -> list[int]:
    """Boundaries splitting ``costs`` into ``parts`` contiguous non-empty parts minimising the
    largest part's sum (exact dynamic program; ties prefer earlier cuts)."""
    n = len(costs)
    prefix = [0.0] + list(itertools.accumulate(costs))
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for c in range(k - 1, i):
                v = max(best[k - 1][c], prefix[i] - prefix[c])
                if v < best[k][i] - 1e-15:
                    best[k][i], cut[k][i] = v, c
    bounds, i = [n], n
    for k in range(parts, 0, -1):
        i = cut[k][i]
        bounds.append(i)
    return bounds[::-1]


BASELINES: dict[str, Baseline] = {
    "minimum-stage": minimum_stage,
    "maximum-stage": maximum_stage,
    "time-balanced": time_balanced,
}


@dataclass
class SearchResult:
    """The best partition found by exhaustive search."""

    boundaries: list[int]
    step_s: float
    evaluated: int


def all_partitions(num_units: int) -> list[list[int]]:
    """Every contiguous partition of ``num_units`` units, as boundaries (2^(U-1) of them)."""
    out = []
    inner = range(1, num_units)
    for r in range(num_units):
        for cuts in itertools.combinations(inner, r):
            out.append([0, *cuts, num_units])
    return out


def exhaustive_search(profile: ModelProfile, hw: Hardware, num_gpus: int, micro_batches: int,
                      score: Callable[[list[int]], float],
                      options: PipelineOptions = PipelineOptions()) -> SearchResult | None:
    """The valid contiguous partition with the lowest ``score`` (e.g. simulated step time)."""
    best, count = None, 0
    for bounds in all_partitions(profile.num_units):
        if not is_valid(profile, bounds, hw, num_gpus, micro_batches, options):
            continue
        count += 1
        s = score(bounds)
        if best is None or s < best.step_s:
            best = SearchResult(bounds, s, 0)
    if best is not None:
        best.evaluated = count
    return best
