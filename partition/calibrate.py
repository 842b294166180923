"""The compute of a run against its unit profile: fitted from what a run measured, kept per machine, and
applied to the next plan.

A unit profile times each unit alone, minutes before the run. Inside a pipeline, round-robin or zero step the
same units compute at another speed (on 2 CPU workers of a 2-core VM forwards 0.74-1.59x their profile over
112 runs, as the VM's speed drifted; on one H100 a block's forward 2.4-3.7x beside the CPU AdamW), so the
plan's step is off by that much even where its schedule is right. :func:`fit_scale` finds the two factors (one
for every forward, one for every backward apart from its recompute) that make the plan's simulated
forward and backward phases equal the ones the run measured, and on CPU workers :func:`fit_action` the
dispatch thread's own time per compute action (``ModelProfile.action_s``: what the runtime measured of it
beyond the simulated messages, spread over the worker's computes); a pipeline's workers also compute at speeds
that vary from step to step, apart (``ModelProfile.worker_spread``: on 2 CPU workers of this VM a worker's compute
in a step 2-13% from its usual against the other's), and each compute's time varies inside a step
(``ModelProfile.compute_spread``, 7-19% there), which the run measures and the fit passes on, and which a plan's
step pays in a simulation that draws them (:func:`partition.simulate.with_spread`); zero mode's reduce-scatters between
CPU workers take longer inside the steps than the hardware model says (:func:`fit_reduce_scatter`,
``ModelProfile.reduce_scatter_x``); the app keeps the last runs' figures per
profile and machine (:func:`record_scale`) and plans the next run with their mean
(:func:`learnt_scale`, :meth:`ComputeScale.apply`). Pure functions over numbers, but the cache's files.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol, Sequence

from mobius.files import write_text_atomic
from partition.costs import ModelProfile

log = logging.getLogger(__name__)

_KEPT = ("forward", "backward", "action_s", "worker_spread", "compute_spread", "reduce_scatter_x")  # a run kept
KEPT_RUNS = 5  # the runs whose factors the next plan averages (a single run's moment drifts by 10-30% here)


class Split(Protocol):
    """A simulated step's phases (:meth:`partition.simulate.SimResult.time_split`)."""

    def time_split(self) -> dict[str, float]: ...


@dataclass(frozen=True)
class ComputeScale:
    """Unit times as a run computes them, relative to the profile: every forward (and the forward a
    backward recomputes) times ``forward``, the rest of every backward times ``backward``; ``action_s``: the
    dispatch thread's own time per compute action (CPU workers; ``ModelProfile.action_s``); ``worker_spread``,
    ``compute_spread``: how much a worker's compute varied from step to step against the others', and one
    compute's time inside a step (``ModelProfile``'s, measured); ``reduce_scatter_x``: zero mode's reduce-scatters on
    CPU workers against the hardware model (:func:`fit_reduce_scatter`); ``runs``: how many runs' figures were
    averaged (0: none, the profile as measured); ``origin``: whose runs they were when not this setting's (:func:`learnt_scale`'s ``others``, e.g. ``with parallel.schedule=swapped``)."""

    forward: float = 1.0
    backward: float = 1.0
    runs: int = 0
    action_s: float = 0.0
    origin: str = ""
    worker_spread: float = 0.0
    compute_spread: float = 0.0
    reduce_scatter_x: float = 1.0

    def apply(self, profile: ModelProfile) -> ModelProfile:
        """``profile`` with every unit's times scaled (the fp32 gradient sums, ``acc_s``, as profiled), and
        ``action_s``, the two spreads and ``reduce_scatter_x`` set."""
        if (self.forward == 1.0 and self.backward == 1.0 and self.action_s == profile.action_s
                and self.worker_spread == profile.worker_spread and self.compute_spread == profile.compute_spread
                and self.reduce_scatter_x == profile.reduce_scatter_x):
            return profile
        units = [dataclasses.replace(u, fwd_s=u.fwd_s * self.forward,
                                     bwd_s=u.fwd_s * self.forward + (u.bwd_s - u.fwd_s) * self.backward)
                 for u in profile.units]
        return dataclasses.replace(profile, units=units, notes=dict(profile.notes), action_s=self.action_s,
                                   worker_spread=self.worker_spread, compute_spread=self.compute_spread,
                                   reduce_scatter_x=self.reduce_scatter_x)

    def times(self, other: "ComputeScale") -> "ComputeScale":
        """This scale applied after ``other`` (scales compose factor by factor; ``action_s``, the spreads and
        ``reduce_scatter_x`` are this one's)."""
        return dataclasses.replace(self, forward=self.forward * other.forward, backward=self.backward * other.backward,
                                   origin="")

    def line(self) -> str:
        action = f", {self.action_s * 1e3:.2f} ms dispatch per compute" if self.action_s else ""
        spread = (f", workers ±{100 * self.worker_spread:.0f}% and computes ±{100 * self.compute_spread:.0f}% around "
                  f"their means" if self.worker_spread or self.compute_spread else "")
        if self.reduce_scatter_x != 1.0:
            spread += f", reduce-scatters x{self.reduce_scatter_x:.2f} the model's"
        runs = 'the last run' if self.runs == 1 else f'the last {self.runs} runs'
        return (f"x{self.forward:.2f} forward, x{self.backward:.2f} backward{action}{spread} as "
                f"{runs}{' ' + self.origin if self.origin else ''} on this machine computed")


def fit_scale(profile: ModelProfile, simulate: Callable[[ModelProfile], Split],
              measured: dict[str, float]) -> ComputeScale:
    """The factors that make ``simulate(scaled profile)``'s forward and backward phases equal
    ``measured`` ({"forward": s, "backward": s}, seconds per worker and step as the run's metrics give
    them), relative to ``profile``; the identity when nothing was measured. With ``measured["dispatch"]`` (CPU
    workers' pipeline: the dispatch thread's own time, ``dispatch_s``) also the ``action_s`` that makes the
    dispatch phase equal it (:func:`fit_action`); without, the profile's; likewise with ``measured["reduce_scatter"]``
    (zero mode on CPU workers, ``reduce_scatter_s``) the ``reduce_scatter_x`` (:func:`fit_reduce_scatter`).
    ``measured["worker_spread"]`` and ``["compute_spread"]`` (:func:`mobius.app.launch.measured_compute`) are passed
    on as they are.

    A phase is a sum of compute spans, each a sum of unit times, so it is linear in the two factors (plus
    what they do not scale, the fp32 gradient sums): three simulations give its coefficients, and the two
    equations their solution."""
    if not (measured.get("forward", 0) > 0 and measured.get("backward", 0) > 0):
        return ComputeScale()
    keys = ("forward", "backward")
    at = {xy: simulate(ComputeScale(*xy, action_s=profile.action_s).apply(profile)).time_split()
          for xy in ((1.0, 1.0), (2.0, 1.0), (1.0, 2.0))}
    (a, b), (c, d) = [[at[xy][k] - at[(1.0, 1.0)][k] for xy in ((2.0, 1.0), (1.0, 2.0))] for k in keys]
    e, f = (measured[k] - at[(1.0, 1.0)][k] for k in keys)
    det = a * d - b * c
    if abs(det) < 1e-12 * max(abs(a * d), abs(b * c), 1e-30):
        return ComputeScale()  # a phase the factors do not move (no forward in the step): nothing to fit
    fx, bx = 1.0 + (e * d - b * f) / det, 1.0 + (a * f - e * c) / det
    if not (fx > 0 and bx > 0):
        return ComputeScale()
    fit = ComputeScale(fx, bx, 1, profile.action_s, worker_spread=measured.get("worker_spread", 0.0),
                       compute_spread=measured.get("compute_spread", 0.0), reduce_scatter_x=profile.reduce_scatter_x)
    if "dispatch" in measured:
        fit = dataclasses.replace(fit, action_s=fit_action(fit.apply(profile), simulate, measured["dispatch"]))
    if "reduce_scatter" in measured:
        fit = dataclasses.replace(fit, reduce_scatter_x=fit_reduce_scatter(fit.apply(profile), simulate,
                                                                           measured["reduce_scatter"]))
    return fit


def fit_action(profile: ModelProfile, simulate: Callable[[ModelProfile], Split], measured_s: float) -> float:
    """The ``action_s`` that makes ``simulate``'s dispatch phase (its messages, plus ``action_s`` per compute
    action) equal ``measured_s``, the dispatch thread's own time per worker and step as the run's metrics give
    it (``dispatch_s``); 0 when the messages alone take that long. The phase is linear in ``action_s``: two
    simulations give it."""
    at = [simulate(dataclasses.replace(profile, action_s=a)).time_split()["dispatch"] for a in (0.0, 1e-3)]
    per_ms = at[1] - at[0]  # seconds of dispatch per worker and step for each ms per compute action
    if per_ms <= 0:
        return 0.0
    return max(0.0, (measured_s - at[0]) / per_ms * 1e-3)


def fit_reduce_scatter(profile: ModelProfile, simulate: Callable[[ModelProfile], Split], measured_s: float) -> float:
    """The ``reduce_scatter_x`` that makes ``simulate``'s reduce-scatter phase (zero mode on CPU workers: the
    dispatch thread's waits for its reduce-scatters, the slowest rank's arrival included) equal ``measured_s``, as the
    run's metrics give it (``reduce_scatter_s``); ``profile``'s when the simulation has no such phase. Nearly
    linear in the factor: two simulations give it (at least 0.1)."""
    at = [simulate(dataclasses.replace(profile, reduce_scatter_x=x)).time_split().get("reduce_scatter")
          for x in (1.0, 2.0)]
    if at[0] is None or at[1] <= at[0]:
        return profile.reduce_scatter_x
    return max(0.1, 1.0 + (measured_s - at[0]) / (at[1] - at[0]))


def scale_key(profile_key: str, workers: int, threads: int, mode: str) -> str:
    """Where a run's factors are kept: per profile (its units, setting and device), number of workers, CPU
    threads per worker (what the compute shares the machine with) and mode (zero, or the pipeline with its
    schedule, ``pipeline/swapped``: how the units run, one stage's micro-batches back to back or every unit's in
    turn between gathers, and what else the dispatch thread does)."""
    return hashlib.sha1(json.dumps([profile_key, workers, threads, mode]).encode()).hexdigest()[:16]


def scale_path(cache_dir: str | Path, key: str) -> Path:
    return Path(cache_dir) / "in_run" / f"{key}.json"


def learnt_scale(cache_dir: str | Path | None, key: str, others: Sequence[tuple[str, str]] = ()) -> ComputeScale:
    """The mean of the figures the last :data:`KEPT_RUNS` runs kept under ``key``; with none there, under the
    first of ``others`` ((key, origin) pairs: settings whose runs compute the same units, the pipeline's other
    schedules) that has some, saying whose they are; with none at all the identity (the profile as measured)."""
    for k, origin in ((key, ""), *others):
        runs = _read_runs(scale_path(cache_dir, k)) if cache_dir is not None else []
        if runs:
            mean = {f: statistics.fmean(r[f] for r in runs) for f in _KEPT}
            return ComputeScale(runs=len(runs), origin=origin, **mean)
    return ComputeScale()


def record_scale(cache_dir: str | Path, key: str, scale: ComputeScale, about: dict) -> None:
    """Keep one run's factors (relative to the profile as measured) under ``key``, with the last runs'."""
    path = scale_path(cache_dir, key)
    runs = (_read_runs(path) + [{f: getattr(scale, f) for f in _KEPT}])[-KEPT_RUNS:]
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps({"runs": runs, **about}, indent=1) + "\n")


def _read_runs(path: Path) -> list[dict[str, float]]:
    """The kept runs' factors; a missing or unreadable file (another version's, a torn write) holds none."""
    try:
        runs = json.loads(path.read_text())["runs"]
        neutral = {f: ComputeScale.__dataclass_fields__[f].default for f in _KEPT[2:]}  # (kept before them)
        return [{"forward": float(r["forward"]), "backward": float(r["backward"]),
                 **{f: max(0.0, float(r.get(f, x))) for f, x in neutral.items()}} for r in runs
                if float(r["forward"]) > 0 and float(r["backward"]) > 0]
    except (OSError, ValueError, KeyError, TypeError):
        return []
