"""The plan the trainer runs: stages, their GPUs, predicted time and memory, and how it was found.

:func:`plan_model` is the one entry point: profile (or estimate) the units, solve the MIP over
every stage count, simulate the chosen partition on the real topology (root-complex contention
included) and the baselines beside it. The runtime consumes ``boundaries``, ``slots`` and the
per-stage memory and prefetch figures of :class:`StagePlan`.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from partition.baselines import BASELINES
from partition.costs import ModelProfile, stage_costs
from partition.gpus import GB, GiB
from partition.hardware import Hardware
from partition.lp import SolverName
from partition.mapping import MappingKind, SlotsFor, as_slots_function
from partition.mip import (DEFAULT_REL_GAP, BandwidthView, MipResult, explain_infeasible, given_partition,
                           solve_partition)
from partition.pipeline import PipelineShape
from partition.simulate import SimResult, Sharing, simulate

log = logging.getLogger(__name__)


@dataclass
class StagePlan:
    """One stage: its units ``[first_unit, end_unit)``, GPU, costs and memory figures."""

    index: int
    first_unit: int
    end_unit: int
    units: str  # "embed..block.3"
    gpu: int
    param_bytes: int
    fwd_s: float  # per micro-batch
    bwd_s: float  # per micro-batch, recompute included
    fwd_peak_bytes: int
    bwd_peak_bytes: int
    prefetch_limit_bytes: int  # memory the previous stage on the GPU leaves free for this one's forward upload
    prefetch_bytes: int  # forward upload bytes prefetched (simulated)
    bwd_prefetch_bytes: int  # backward upload bytes prefetched (simulated)
    resident_backward: bool  # the backward follows the forward on the GPU without re-uploading


@dataclass
class Plan:
    """A partition of the model into stages mapped to GPUs, with its predicted cost."""

    boundaries: list[int]
    slots: list[int]
    num_gpus: int
    micro_batches: int
    micro_batch_size: int
    seq_len: int
    precision: str
    predicted_step_s: float  # simulated on the topology (contention included)
    model_step_s: float  # the MIP's own figure (no root-complex contention)
    solver: str
    solve_s: float
    gap: float
    baselines: dict[str, float | None]  # name -> simulated step time (None: does not fit)
    baseline_boundaries: dict[str, list[int] | None]
    profile_source: str
    device_name: str
    stages: list[StagePlan]
    peak_bytes: list[int]  # per GPU
    traffic: dict[str, float]
    unit_names: list[str]
    mapping_kind: str
    hardware: str
    gpu_memory_bytes: int
    param_count: int
    num_slots: int = 2  # device slots per worker: 2 = the next stage uploads while the current one computes
    offload_inputs: bool = False  # boundary inputs wait for their backward in host memory
    mip: dict[str, Any] = field(default_factory=dict)

    @property
    def num_stages(self) -> int:
        return len(self.boundaries) - 1

    def gpu_of_stage(self, j: int) -> int:
        return self.slots[j % len(self.slots)]

    def to_json(self) -> dict:
        """A JSON-ready dict (also what ``mobius plan --json`` prints)."""
        out = asdict(self)
        out["num_stages"] = self.num_stages
        out["mapping"] = {"kind": self.mapping_kind, "slots": self.slots,
                          "stage_gpus": [self.gpu_of_stage(j) for j in range(self.num_stages)]}
        return _finite(out)

    @classmethod
    def from_json(cls, data: dict) -> "Plan":
        known = {f for f in cls.__dataclass_fields__}
        kw = {k: v for k, v in data.items() if k in known}
        kw["stages"] = [StagePlan(**s) for s in data["stages"]]
        return cls(**kw)

    def summary(self) -> str:
        """A human-readable report: stages table, predicted time, memory, traffic, baselines."""
        return "\n".join(_summary_lines(self))


def _finite(obj: Any) -> Any:
    """Replace non-finite floats by None so that the JSON is standard."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


def _gb(n: float) -> str:
    return f"{n / GB:.2f} GB"


def _summary_lines(p: Plan) -> list[str]:
    lines = [f"stages: {p.num_stages} on {p.num_gpus} GPU(s), {p.mapping_kind} mapping, slots {p.slots} "
             f"(stage j runs on GPU slots[j % {len(p.slots)}])",
             f"  {'stage':>5}  {'units':<22} {'gpu':>3}  {'params':>9}  {'fwd/mb':>8}  {'bwd/mb':>8}  "
             f"{'prefetch':>9}  {'peak fwd':>9}  {'peak bwd':>9}"]
    for s in p.stages:
        pre = f"{100 * s.prefetch_bytes / s.param_bytes:.0f}%" if s.param_bytes and s.index >= len(p.slots) else "-"
        lines.append(f"  {s.index:>5}  {s.units:<22} {s.gpu:>3}  {_gb(s.param_bytes):>9}  {s.fwd_s * 1e3:>6.1f}ms  "
                     f"{s.bwd_s * 1e3:>6.1f}ms  {pre:>9}  {s.fwd_peak_bytes / GiB:>6.2f}GiB  "
                     f"{s.bwd_peak_bytes / GiB:>6.2f}GiB")
    gap = f"{100 * p.gap:.2f}%" if math.isfinite(p.gap) else "unknown"
    lines.append(f"predicted step time: {p.predicted_step_s:.3f} s (simulated with root-complex contention; the MIP's "
                 f"contention-free model says {p.model_step_s:.3f} s; solver {p.solver}, {p.solve_s:.2f} s, gap {gap})")
    mem = ", ".join(f"GPU{g} {b / GiB:.1f}" for g, b in enumerate(p.peak_bytes))
    lines.append(f"peak GPU memory (GiB, budget {p.gpu_memory_bytes / GiB:.1f}): {mem}")
    t = p.traffic
    lines.append(f"traffic per step: {_gb(t['total_bytes'])} = {t['x_param_bytes']:.2f} x the parameter bytes in "
                 f"{p.precision} ({t['x_fp32_param_bytes']:.2f} x fp32): host->GPU {_gb(t['h2d_bytes'])}, "
                 f"GPU->host {_gb(t['d2h_bytes'])}, peer {_gb(t['p2p_bytes'])}")
    base = []
    for name, v in p.baselines.items():
        base.append(f"{name} {v:.3f} s ({100 * (v / p.predicted_step_s - 1):+.1f}%)" if v else f"{name}: does not fit")
    lines.append("baselines (simulated the same way): " + ", ".join(base))
    return lines


# ---------------------------------------------------------------------------------- entry point
def plan_model(specs_or_profile: Sequence[Any] | ModelProfile, hardware: Hardware, *, micro_batches: int,
               micro_batch_size: int = 1, seq_len: int = 512, precision: str = "bf16",
               mapping: MappingKind | str | Sequence[int] | SlotsFor = "cross", solver: SolverName = "auto",
               time_limit_s: float = 30.0, profile: str = "auto", gpu: Any = None, cache_dir: str | None = None,
               bandwidth_view: BandwidthView = "link", sharing: Sharing = "priority",
               with_baselines: bool = True, rel_gap: float = DEFAULT_REL_GAP, prefetch: bool = True,
               min_stages: int = 1, boundaries: list[int] | None = None, offload_inputs: str = "auto") -> Plan:
    """Profile (or take) the unit costs, find the best partition, simulate it and the baselines.

    ``mapping``: "cross" or "sequential" (``topology``'s search for each stage count), a fixed slot
    order, or a function of the stage count. ``bandwidth_view``: how the MIP sees shared root
    complexes (see :func:`partition.mip.build_model`); the simulator always models them.
    ``min_stages``: the fewest stages allowed (a runtime that keeps every GPU busy needs ``N``).
    ``boundaries``: a partition to evaluate instead of solving for one (``parallel.stages``).
    ``offload_inputs``: "on", "off" or "auto" (host memory when keeping them would crowd the GPU).
    """
    prof = _profile(specs_or_profile, micro_batch_size, seq_len, precision, profile, gpu, cache_dir)
    slots_for = as_slots_function(mapping, hardware.groups)
    if boundaries is None:
        counts = list(range(max(1, min_stages), prof.num_units + 1))
        res = solve_partition(prof, hardware, slots_for, micro_batches, solver, time_limit_s, stage_counts=counts,
                              bandwidth=bandwidth_view, rel_gap=rel_gap, prefetch=prefetch)
        if res.best is None or res.best.boundaries is None:
            raise explain_infeasible(prof, hardware, micro_batches)
    else:
        res = given_partition(prof, hardware, slots_for, micro_batches, boundaries, bandwidth_view, prefetch)
    bounds = res.best.boundaries
    slots = slots_for(len(bounds) - 1)
    sim = simulate(prof, bounds, hardware, slots, micro_batches, prefetch=prefetch, sharing=sharing)
    base, base_bounds = {}, {}
    if with_baselines:
        for name, fn in BASELINES.items():
            b = fn(prof, hardware, len(slots), micro_batches)
            base_bounds[name] = b
            base[name] = (simulate(prof, b, hardware, slots_for(len(b) - 1), micro_batches, prefetch=prefetch,
                                   sharing=sharing, record=False).step_s if b else None)
    label = mapping if isinstance(mapping, str) else "given"
    plan = _assemble(prof, hardware, bounds, slots, micro_batches, sim, res, base, base_bounds, label)
    plan.num_slots, plan.offload_inputs = memory_decisions(prof, hardware, bounds, slots, micro_batches, prefetch,
                                                           offload_inputs)
    return plan


CHECKPOINT_SHARE = 0.1  # auto: boundary inputs go to host memory when they would take more of the GPU
SLOT_SHARE = 0.6  # two stage slots must fit in this share of the memory (the rest: activations, work)


def memory_decisions(prof: ModelProfile, hw: Hardware, bounds: list[int], slots: list[int], M: int,
                     prefetch: bool, offload_inputs: str) -> tuple[int, bool]:
    """(device slots per worker, boundary inputs in host memory): two slots only if they fit
    beside a working reserve; inputs in host memory when keeping them would take more than a
    tenth of the device."""
    costs = stage_costs(prof, bounds)
    half = prof.precision != "fp32"
    slot = max(c.param_bytes + c.grad_bytes + (4 * c.param_count if half else 0) for c in costs)
    mem = hw.gpu_memory_bytes
    per_worker = max(sum(1 for j in range(len(costs)) if j % len(slots) == s) for s in range(len(slots)))
    inputs = (per_worker - 1) * M * max(c.in_bytes for c in costs)
    offload = {"on": True, "off": False}.get(offload_inputs, inputs > CHECKPOINT_SHARE * mem)
    two = prefetch and 2 * slot <= SLOT_SHARE * mem
    if prefetch and not two:
        log.warning("two stages of %.2f GiB do not fit beside working memory in %.1f GiB: no prefetch",
                    slot / GiB, mem / GiB)
    return (2 if two else 1), offload


def _profile(specs_or_profile: Any, mbs: int, seq: int, precision: str, mode: str, gpu: Any,
             cache_dir: str | None) -> ModelProfile:
    if isinstance(specs_or_profile, ModelProfile):
        return specs_or_profile
    from partition.profile import get_profile

    return get_profile(list(specs_or_profile), mbs, seq, precision, mode, gpu, cache_dir=cache_dir)


def _assemble(prof: ModelProfile, hw: Hardware, bounds: list[int], slots: list[int], M: int, sim: SimResult,
              res: MipResult, base: dict, base_bounds: dict, mapping: str) -> Plan:
    stages = _stage_plans(prof, hw, bounds, slots, M, sim)
    total = sim.total_bytes()
    traffic = {"total_bytes": total, "h2d_bytes": sum(sim.h2d_bytes), "d2h_bytes": sum(sim.d2h_bytes),
               "p2p_bytes": sum(sim.p2p_bytes), "x_param_bytes": total / max(prof.param_bytes(), 1),
               "x_fp32_param_bytes": total / max(4 * prof.param_count(), 1),
               **{f"{k}_bytes": v for k, v in sim.bytes_by_kind.items()}}
    best = res.best
    mip_info = {"num_stages": best.num_stages, "status": best.status, "encoding": best.encoding,
                "stage_counts_tried": len(res.per_stage_count), "max_variables": res.max_size[0],
                "max_constraints": res.max_size[1], "lower_bound_s": res.lower_bound}
    return Plan(boundaries=bounds, slots=slots, num_gpus=hw.num_gpus, micro_batches=M,
                micro_batch_size=prof.micro_batch_size, seq_len=prof.seq_len, precision=prof.precision,
                predicted_step_s=sim.step_s, model_step_s=best.predicted_s, solver=res.solver, solve_s=res.solve_s,
                gap=res.gap, baselines=base, baseline_boundaries=base_bounds, profile_source=prof.source,
                device_name=prof.device_name, stages=stages, peak_bytes=list(sim.peak_bytes),
                traffic=traffic, unit_names=[u.name for u in prof.units], mapping_kind=mapping, hardware=hw.describe(),
                gpu_memory_bytes=hw.gpu_memory_bytes, param_count=prof.param_count(), mip=mip_info)


def _stage_plans(prof: ModelProfile, hw: Hardware, bounds: list[int], slots: list[int], M: int,
                 sim: SimResult) -> list[StagePlan]:
    costs = stage_costs(prof, bounds)
    shape = PipelineShape(len(costs), len(slots), M)
    names = [u.name for u in prof.units]
    out = []
    for j, sc in enumerate(costs):
        prev = j - len(slots)
        limit = hw.gpu_memory_bytes - shape.fwd_peak(costs[prev], prev) if prev >= 0 else hw.gpu_memory_bytes
        units = names[sc.first] if sc.end - sc.first == 1 else f"{names[sc.first]}..{names[sc.end - 1]}"
        timing = sim.stages[j]
        out.append(StagePlan(index=j, first_unit=sc.first, end_unit=sc.end, units=units, gpu=slots[j % len(slots)],
                             param_bytes=sc.param_bytes, fwd_s=sc.fwd_s, bwd_s=sc.bwd_s,
                             fwd_peak_bytes=shape.fwd_peak(sc, j), bwd_peak_bytes=shape.bwd_peak(sc, j),
                             prefetch_limit_bytes=max(0, limit), prefetch_bytes=int(timing.fwd_prefetched),
                             bwd_prefetch_bytes=int(timing.bwd_prefetched), resident_backward=shape.is_resident(j)))
    return out
