"""One partition through the timing model (:mod:`partition.timing`) with numbers, no solver.

:class:`ModelEvaluator` computes the earliest time of every event of a step for a fixed partition
by the same statements the MIP emits as constraints, so for a fixed partition the MIP's optimum
*is* :meth:`ModelEvaluator.step_time`. It seeds the MIP with a strong incumbent (stage counts that
cannot win are then cut off early), scores the baselines and checks memory rules. The rates it
uses (:func:`rates_for`) are the MIP's too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from partition.costs import TIE_SUM_BYTES, UPDATE_BYTES, ModelProfile, StageCost, compute_copy_work, stage_cost
from partition.hardware import Hardware
from partition.schedule import PipelineOptions
from partition.timing import Numbers, Rates, PipelineShape, StageExprs, StepTimes, step_model

GB = 1e9


@dataclass
class Evaluation:
    """A partition's step time (``inf`` when a memory rule breaks), event times and broken rules."""

    T: float
    times: StepTimes
    violations: list[tuple[str, float, float]]


def slot_gb(param_bytes: float, grad_bytes: float, param_count: float, half: bool) -> float:
    """GB of a device slot: half-precision parameters and gradients, and fp32 sums when half
    (``grad_bytes`` and ``param_count``: of what trains)."""
    return (param_bytes + grad_bytes + (4 * param_count if half else 0)) / GB


def state_gb(param_bytes: float, grad_bytes: float, param_count: float, half: bool) -> float:
    """GB of a resident stage on its GPU: its slot plus the fp32 master (a separate copy in half
    precision) and the AdamW moments: 20 bytes per parameter in bf16/fp16, 16 in fp32."""
    return slot_gb(param_bytes, grad_bytes, param_count, half) + (12 if half else 8) * param_count / GB


def stage_exprs(sc: StageCost, half: bool) -> StageExprs:
    """A stage's quantities in the model's units (seconds, GB, G parameters)."""
    t = sc.trainable_count  # updates, downloads, fp32 sums and masters: what trains (LoRA: the adapters)
    return StageExprs(fwd=sc.fwd_s, bwd=sc.bwd_s + sc.acc_s, params=t / GB, pbytes=sc.param_bytes / GB,
                      slot=slot_gb(sc.param_bytes, sc.grad_bytes, t, half), state=state_gb(sc.param_bytes, sc.grad_bytes, t, half),
                      in_b=sc.in_bytes / GB, out_b=sc.out_bytes / GB, saved=sc.saved_bytes / GB,
                      work=sc.work_bytes / GB)


def activation_seconds_per_byte(hw: Hardware, src: int, dst: int) -> float:
    """Uncontended seconds per byte from one GPU to another: peer to peer, or two host hops."""
    if src == dst:
        return 0.0
    peer = hw.p2p_rate(src, dst)
    if peer:
        return 1.0 / min(peer, hw.uncontended_d2h(src), hw.uncontended_h2d(dst))
    return 1.0 / hw.uncontended_d2h(src) + 1.0 / hw.uncontended_h2d(dst)


def tie_seconds(profile: ModelProfile, hw: Hardware) -> float:
    """A tied weight's two ends' gradients exchanged through host memory between the two workers that hold them,
    then summed on the host (``TIE_SUM_BYTES`` a parameter at the CPU update's byte rate): the round-robin
    schedule's, and the pipeline's with its ends on two workers (one worker holding both sums them on the
    device: ``Schedule.tie_in``)."""
    if not profile.tied_params:
        return 0.0
    exchange = 4 * profile.tied_params / hw.host_copy_Bps
    return exchange + profile.tied_params * TIE_SUM_BYTES / UPDATE_BYTES / hw.cpu_update_rate()


def rates_for(profile: ModelProfile, hw: Hardware, worker_gpus: list[int], num_stages: int,
              bandwidth: str = "link", half_grads: bool = False) -> Rates:
    """Per-stage rates of an S-stage pipeline whose stage j runs on GPU ``worker_gpus[j % N]``; a
    worker's CPU AdamW at its share of the host with all ``N`` updating at once."""
    N = len(worker_gpus)
    gpu = [worker_gpus[j % N] for j in range(num_stages)]
    up = hw.uncontended_h2d if bandwidth == "link" else hw.shared_h2d
    down = hw.uncontended_d2h if bandwidth == "link" else hw.shared_d2h
    lat_in = [activation_seconds_per_byte(hw, gpu[j - 1], gpu[j]) * GB if j else 0.0 for j in range(num_stages)]
    lat_back = [activation_seconds_per_byte(hw, gpu[j + 1], gpu[j]) * GB if j < num_stages - 1 else 0.0
                for j in range(num_stages)]
    # one worker holding both tied ends sums them on the device (stage 0's backward upload brings the head's end's
    # gradient: the timing model's bytes); two exchange them through host memory and sum them there
    tie_s = tie_seconds(profile, hw) if num_stages > 1 and (num_stages - 1) % N else 0.0  # ends on two workers
    cpu = hw.cpu_update_rate(half_grads, updating=N)  # the host's share while every worker updates (with clipping
    # they all do, after the global norm; the simulator follows who actually updates when)
    return Rates([up(g) / GB for g in gpu], [down(g) / GB for g in gpu], lat_in, lat_back, cpu / GB, tie_s,
                 hw.device_adam_params_per_s / GB, hw.message_s, profile.action_s, compute_copy_work(profile.precision))


class ModelEvaluator:
    """Evaluates many partitions of one model on one machine, caching stage costs and rates."""

    def __init__(self, profile: ModelProfile, hw: Hardware, gpus_for: Callable[[int], list[int]],
                 micro_batches: int, bandwidth: str = "link", options: PipelineOptions = PipelineOptions()):
        self.profile, self.hw, self.gpus_for, self.M = profile, hw, gpus_for, micro_batches
        self.bandwidth, self.options = bandwidth, options
        self.half = profile.precision != "fp32"
        self._stage: dict[tuple[int, int], StageCost] = {}
        self._exprs: dict[tuple[int, int], StageExprs] = {}
        self._worker_gpus: dict[int, list[int]] = {}
        self._rates: dict[int, Rates] = {}
        self.evaluations = 0

    def stage(self, a: int, b: int) -> StageCost:
        sc = self._stage.get((a, b))
        if sc is None:
            sc = self._stage[(a, b)] = stage_cost(self.profile, a, b)
        return sc

    def worker_gpus(self, S: int) -> list[int]:
        if S not in self._worker_gpus:
            self._worker_gpus[S] = list(self.gpus_for(S))
        return self._worker_gpus[S]

    def rates(self, S: int) -> Rates:
        if S not in self._rates:
            self._rates[S] = rates_for(self.profile, self.hw, self.worker_gpus(S), S, self.bandwidth,
                                       self.options.grad_dtype == "half")
        return self._rates[S]

    def shape(self, S: int, options: PipelineOptions | None = None) -> PipelineShape:
        return PipelineShape(S, len(self.worker_gpus(S)), self.M, options or self.options, self.profile.tied_params / GB)

    def exprs(self, boundaries: list[int]) -> list[StageExprs]:
        return [self._exprs.get((a, b)) or self._exprs.setdefault((a, b), stage_exprs(self.stage(a, b), self.half))
                for a, b in zip(boundaries, boundaries[1:])]

    def evaluate(self, boundaries: list[int], options: PipelineOptions | None = None) -> Evaluation:
        """Every event's earliest time for the partition ``boundaries`` (under ``options``, by
        default the evaluator's; the gradient dtype must be the evaluator's)."""
        assert options is None or options.grad_dtype == self.options.grad_dtype, "rates are cached per dtype"
        self.evaluations += 1
        S = len(boundaries) - 1
        alg = Numbers()
        times = step_model(alg, self.exprs(boundaries), self.rates(S), self.shape(S, options),
                           self.hw.gpu_memory_bytes / GB)
        return Evaluation(math.inf if alg.violations else float(times.step), times, alg.violations)

    def step_time(self, boundaries: list[int]) -> float:
        return self.evaluate(boundaries).T


def model_step_time(profile: ModelProfile, hw: Hardware, worker_gpus: list[int], micro_batches: int,
                    boundaries: list[int], bandwidth: str = "link",
                    options: PipelineOptions = PipelineOptions()) -> float:
    """The MIP's step time for one partition (``inf`` if it breaks a memory rule)."""
    return ModelEvaluator(profile, hw, lambda S: worker_gpus, micro_batches, bandwidth, options).step_time(boundaries)
