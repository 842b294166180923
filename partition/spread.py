"""The speeds that vary, drawn: each worker's from step to step (``ModelProfile.worker_spread``) and each compute's
inside a step (``ModelProfile.compute_spread``), around their means, with the spreads the runs on the machine
measured. The step a plan reports is the mean period of one seeded simulation of :data:`SPREAD_STEPS` steps that
draws them (the pipeline's :func:`partition.simulate.with_spread`, zero mode's :func:`partition.zero.step_sim.predict`):
a hand-over or a collective waits for the slower side, so the step is longer than with every compute at its mean.
Draws are seeded by tuples of ints (which hash alike in every process), and an odd step takes the deviates of the
even one before it, negated (antithetic pairs: their mean varies less)."""

from __future__ import annotations

import math
import random
import statistics
from typing import Hashable, Sequence

SPREAD_STEPS = 10  # steps a simulation with the spreads drawn runs (its step: the mean period of all but the first two)


def worker_speeds(draw: int, step: int, n: int, spread: float) -> list[float]:
    """Each of ``n`` workers' factor in ``step`` of draw ``draw``: 1 + ``spread`` times a normal deviate less the
    step's mean over the workers (scaled so that each keeps that standard deviation), at least 0.1: a worker's
    compute against the step's mean."""
    rng = random.Random(hash((draw, step // 2)))
    z = [rng.gauss(0.0, 1.0) * (-1.0 if step % 2 else 1.0) for _ in range(n)]
    mean = sum(z) / n
    scale = spread * math.sqrt(n / (n - 1)) if n > 1 else 0.0
    return [max(0.1, 1.0 + scale * (zi - mean)) for zi in z]


def compute_factor(cv: float, key: Hashable, step: int) -> float:
    """One compute's own factor in ``step``: lognormal with mean 1 and ``cv`` its standard deviation over mean, seeded
    by ``key`` (the draw, the step's pair and what identifies the compute, so that it draws the same whatever runs
    beside it); 1 when ``cv`` is 0."""
    if cv <= 0:
        return 1.0
    sigma = math.sqrt(math.log1p(cv * cv))
    z = random.Random(hash(key)).gauss(0.0, sigma) * (-1.0 if step % 2 else 1.0)
    return math.exp(z - sigma * sigma / 2)


def drawn_text(compute_scale: dict, who: str) -> str:
    """How far the plan's step drew the spreads the runs measured (a plan's ``compute_scale``), for its summary:
    ``the <who> ±w% and computes ±c% the runs measured drawn``; empty when none was measured."""
    w, c = (100 * compute_scale.get(k, 0.0) for k in ("worker_spread", "compute_spread"))
    return f"the {who} ±{w:.0f}% and computes ±{c:.0f}% the runs measured drawn" if w or c else ""


def mean_period(ends: Sequence[float]) -> float:
    """The mean step of a drawn simulation from its steps' ends: all but the first two steps' (the first fills the
    pipeline or the caches, the second carries what the first left running)."""
    return statistics.fmean(b - a for a, b in zip(ends[1:], ends[2:]))
