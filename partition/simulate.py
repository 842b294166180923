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
from typing import Callable

from partition.costs import ModelProfile, stage_costs
from partition.evaluate import PipelineOptions
from partition.hardware import Hardware
from partition.schedule import build_schedule
from partition.sim.event_loop import run_schedule
from partition.sim.flows import Sharing
from partition.sim.result import SimResult
from partition.spread import SPREAD_STEPS, mean_period


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
    return run_schedule(profile, costs, hardware, worker_gpus, sched, sharing, record, draw, steps)


def with_spread(nominal: SimResult, profile: ModelProfile, run: Callable[[int, int], SimResult]) -> SimResult:
    """``nominal`` (``profile``'s step simulated) with the step it reports when each worker's speed varies from step
    to step by ``profile.worker_spread`` and each compute's inside a step by ``profile.compute_spread``: one seeded
    simulation of :data:`SPREAD_STEPS` steps (``run(steps, draw)``: ``profile``'s, unrecorded) in which every step
    draws each worker's factor and each compute's (:class:`~partition.sim.compute_streams.ComputeTimes`), the mean
    period of its steps after the first two; the difference from the nominal step in ``spread_s``. ``nominal`` itself
    without either spread."""
    if profile.worker_spread <= 0 and profile.compute_spread <= 0:
        return nominal
    extra = mean_period(run(SPREAD_STEPS, 0).step_ends) - nominal.step_s
    return dataclasses.replace(nominal, step_s=nominal.step_s + extra, spread_s=extra)
