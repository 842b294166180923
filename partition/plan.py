"""The plan the trainer runs: stages, their GPUs, the runtime's memory settings, predicted time and
memory, and how it was found.

:func:`plan_model` is the one entry point: profile (or estimate) the units, solve the MIP over every
stage count under each memory setting the run allows (two device slots or one; boundary inputs kept
on the GPU or in host memory), simulate the best plan's schedule on the real topology (root-complex
contention included) and the baselines beside it. The runtime takes ``boundaries``, ``slots``,
``num_slots`` and ``offload_inputs`` from the plan and builds the same schedule the simulator ran.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from partition.baselines import BASELINES
from partition.costs import ModelProfile, stage_costs
from partition.evaluate import PipelineOptions, stage_exprs
from partition.gpus import GB, GiB
from partition.hardware import Hardware
from partition.lp import SolverName
from partition.mapping import MappingKind, SlotsFor, as_slots_function
from partition.mip import (DEFAULT_REL_GAP, BandwidthView, MipResult, explain_infeasible, given_partition,
                           solve_partition)
from partition.simulate import SimResult, Sharing, simulate
from partition.timing import Numbers, Shape, worker_needs

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
    bwd_s: float  # per micro-batch: recompute + backward (+ fp32 sums); the last stage's FB
    fwd_peak_bytes: int  # its worker's device memory during the stage's forward
    bwd_peak_bytes: int  # ... and during its backward
    resident_backward: bool  # the backward follows the forward on the GPU without re-uploading
    upload_wait_s: float  # simulated time its compute waited for its uploads (prefetch not hiding them)


@dataclass
class Plan:
    """A partition of the model into stages mapped to GPUs, the runtime's settings and the predicted cost."""

    boundaries: list[int]
    slots: list[int]
    num_gpus: int
    micro_batches: int
    micro_batch_size: int
    seq_len: int
    precision: str
    num_slots: int  # device slots per worker: 2 = the next stage uploads while the current one computes
    offload_inputs: bool  # boundary inputs wait for their backward in host memory
    barrier: bool  # updates wait for the global gradient norm (clipping, fp16)
    predicted_step_s: float  # the runtime's schedule simulated on the topology (contention included)
    model_step_s: float  # the MIP's own figure (no root-complex contention)
    solver: str
    solve_s: float
    gap: float
    status: str  # "optimal" only when proven; else how close
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
    cpu_adam_params_per_s: float
    mip: dict[str, Any] = field(default_factory=dict)

    @property
    def num_stages(self) -> int:
        return len(self.boundaries) - 1

    def gpu_of_stage(self, j: int) -> int:
        return self.slots[j % len(self.slots)]

    @property
    def options(self) -> PipelineOptions:
        return PipelineOptions(self.num_slots, self.offload_inputs, self.barrier)

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

    def runtime_settings(self) -> dict:
        """What the runtime takes from the plan (the test that the plan shown is the plan run compares these)."""
        return {"boundaries": list(self.boundaries), "stage_gpus": [self.gpu_of_stage(j) for j in range(self.num_stages)],
                "num_slots": self.num_slots, "offload_inputs": self.offload_inputs, "barrier": self.barrier}

    def summary(self) -> str:
        """A human-readable report: stages table, settings, predicted time, memory, traffic, baselines."""
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
             f"{'upload wait':>11}  {'peak fwd':>9}  {'peak bwd':>9}"]
    for s in p.stages:
        lines.append(f"  {s.index:>5}  {s.units:<22} {s.gpu:>3}  {_gb(s.param_bytes):>9}  {s.fwd_s * 1e3:>6.1f}ms  "
                     f"{s.bwd_s * 1e3:>6.1f}ms  {s.upload_wait_s * 1e3:>9.1f}ms  {s.fwd_peak_bytes / GiB:>6.2f}GiB  "
                     f"{s.bwd_peak_bytes / GiB:>6.2f}GiB")
    slots = "2 per GPU (the next stage uploads while one computes)" if p.num_slots == 2 else "1 per GPU (no prefetch)"
    lines.append(f"runtime: device slots {slots}; boundary inputs {'in host memory' if p.offload_inputs else 'kept on the GPU'}"
                 f"; CPU AdamW at {p.cpu_adam_params_per_s / 1e9:.2f} G params/s per worker, "
                 + ("after the global norm (clipping or fp16), overlapping the next forward" if p.barrier
                    else "as each stage's gradients arrive"))
    lines.append(f"predicted step time: {p.predicted_step_s:.3f} s (the runtime's schedule simulated with root-complex "
                 f"contention; the MIP's contention-free model says {p.model_step_s:.3f} s; solver {p.solver}, "
                 f"{p.solve_s:.2f} s, {p.status})")
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
               min_stages: int = 1, boundaries: list[int] | None = None, offload_inputs: str = "auto",
               barrier: bool = False) -> Plan:
    """Profile (or take) the unit costs, find the best partition and runtime settings, simulate it
    and the baselines.

    ``mapping``: "cross" or "sequential" (``topology``'s search for each stage count), a fixed slot
    order, or a function of the stage count. ``bandwidth_view``: how the MIP sees shared root
    complexes (see :func:`partition.mip.build_model`); the simulator always models them.
    ``min_stages``: the fewest stages allowed (a runtime that keeps every GPU busy needs ``N``).
    ``boundaries``: a partition to evaluate instead of solving for one (``parallel.stages``).
    ``prefetch``: two device slots allowed; ``offload_inputs``: "on", "off" or "auto" (both tried);
    ``barrier``: the run clips gradients or scales fp16 losses (updates wait for the global norm).
    """
    prof = _profile(specs_or_profile, micro_batch_size, seq_len, precision, profile, gpu, cache_dir)
    slots_for = as_slots_function(mapping, hardware.groups)
    t0 = time.perf_counter()
    res, options = _search(prof, hardware, slots_for, micro_batches, solver, time_limit_s, bandwidth_view, rel_gap,
                           prefetch, min_stages, boundaries, offload_inputs, barrier)
    bounds = res.best.boundaries
    slots = slots_for(len(bounds) - 1)
    sim = simulate(prof, bounds, hardware, slots, micro_batches, options, sharing)
    base, base_bounds = {}, {}
    if with_baselines:
        for name, fn in BASELINES.items():
            b = fn(prof, hardware, len(slots), micro_batches, options)
            base_bounds[name] = b
            base[name] = (simulate(prof, b, hardware, slots_for(len(b) - 1), micro_batches, options, sharing,
                                   record=False).step_s if b else None)
    res.solve_s = time.perf_counter() - t0
    label = mapping if isinstance(mapping, str) else "given"
    return _assemble(prof, hardware, bounds, slots, micro_batches, options, sim, res, base, base_bounds, label)


def _option_sets(prefetch: bool, offload_inputs: str, barrier: bool) -> list[list[PipelineOptions]]:
    """The runtime settings to try, in tiers: one slot is tried only when no two-slot plan fits."""
    offloads = {"on": [True], "off": [False]}.get(offload_inputs, [False, True])
    tiers = [[PipelineOptions(k, o, barrier) for o in offloads] for k in ((2, 1) if prefetch else (1,))]
    return tiers


def _search(prof: ModelProfile, hw: Hardware, slots_for: SlotsFor, M: int, solver: SolverName, time_limit_s: float,
            view: BandwidthView, rel_gap: float, prefetch: bool, min_stages: int, boundaries: list[int] | None,
            offload_inputs: str, barrier: bool) -> tuple[MipResult, PipelineOptions]:
    """The best partition under the best runtime settings (the MIP's model decides)."""
    t0 = time.perf_counter()
    counts = list(range(max(1, min_stages), prof.num_units + 1))
    best: tuple[MipResult, PipelineOptions] | None = None
    for tier in _option_sets(prefetch, offload_inputs, barrier):
        for options in tier:
            if boundaries is not None:
                res = given_partition(prof, hw, slots_for, M, boundaries, view, options)
            else:
                left = max(1.0, time_limit_s - (time.perf_counter() - t0))
                res = solve_partition(prof, hw, slots_for, M, solver, left, stage_counts=counts, bandwidth=view,
                                      rel_gap=rel_gap, options=options)
            if res.best is not None and res.best.boundaries is not None and math.isfinite(res.best.predicted_s):
                if best is None or res.best.predicted_s < best[0].best.predicted_s:
                    best = (res, options)
        if best is not None:
            return best
    raise explain_infeasible(prof, hw, M, _option_sets(prefetch, offload_inputs, barrier)[-1][-1])


def _profile(specs_or_profile: Any, mbs: int, seq: int, precision: str, mode: str, gpu: Any,
             cache_dir: str | None) -> ModelProfile:
    if isinstance(specs_or_profile, ModelProfile):
        return specs_or_profile
    from partition.profile import get_profile

    return get_profile(list(specs_or_profile), mbs, seq, precision, mode, gpu, cache_dir=cache_dir)


def _assemble(prof: ModelProfile, hw: Hardware, bounds: list[int], slots: list[int], M: int,
              options: PipelineOptions, sim: SimResult, res: MipResult, base: dict, base_bounds: dict,
              mapping: str) -> Plan:
    stages = _stage_plans(prof, bounds, slots, M, options, sim)
    total = sim.total_bytes()
    traffic = {"total_bytes": total, "h2d_bytes": sum(sim.h2d_bytes), "d2h_bytes": sum(sim.d2h_bytes),
               "p2p_bytes": sum(sim.p2p_bytes), "x_param_bytes": total / max(prof.param_bytes(), 1),
               "x_fp32_param_bytes": total / max(4 * prof.param_count(), 1),
               **{f"{k}_bytes": v for k, v in sim.bytes_by_kind.items()}}
    best = res.best
    per_count = [{"num_stages": r.num_stages, "status": r.status, "predicted_s": r.predicted_s, "bound": r.bound}
                 for r in res.per_stage_count]
    mip_info = {"num_stages": best.num_stages, "status": best.status, "encoding": best.encoding,
                "stage_counts_tried": len(res.per_stage_count), "stage_counts_skipped": res.stage_counts_skipped,
                "max_variables": res.max_size[0], "max_constraints": res.max_size[1],
                "lower_bound_s": res.lower_bound, "per_stage_count": per_count}
    return Plan(boundaries=bounds, slots=slots, num_gpus=hw.num_gpus, micro_batches=M,
                micro_batch_size=prof.micro_batch_size, seq_len=prof.seq_len, precision=prof.precision,
                num_slots=options.num_slots, offload_inputs=options.offload_inputs, barrier=options.barrier,
                predicted_step_s=sim.step_s, model_step_s=best.predicted_s, solver=res.solver, solve_s=res.solve_s,
                gap=res.gap, status=res.status_text(), baselines=base, baseline_boundaries=base_bounds,
                profile_source=prof.source, device_name=prof.device_name, stages=stages,
                peak_bytes=list(sim.peak_bytes), traffic=traffic, unit_names=[u.name for u in prof.units],
                mapping_kind=mapping, hardware=hw.describe(), gpu_memory_bytes=hw.gpu_memory_bytes,
                param_count=prof.param_count(), cpu_adam_params_per_s=hw.cpu_adam_params_per_s, mip=mip_info)


def _stage_plans(prof: ModelProfile, bounds: list[int], slots: list[int], M: int, options: PipelineOptions,
                 sim: SimResult) -> list[StagePlan]:
    costs = stage_costs(prof, bounds)
    half = prof.precision != "fp32"
    shape = Shape(len(costs), len(slots), M, options.num_slots, options.offload_inputs, options.barrier)
    needs = {what: float(n) for per in worker_needs(Numbers(), [stage_exprs(c, half) for c in costs], shape).values()
             for what, n in per}
    names = [u.name for u in prof.units]
    out = []
    for j, sc in enumerate(costs):
        units = names[sc.first] if sc.end - sc.first == 1 else f"{names[sc.first]}..{names[sc.end - 1]}"
        out.append(StagePlan(index=j, first_unit=sc.first, end_unit=sc.end, units=units, gpu=slots[j % len(slots)],
                             param_bytes=sc.param_bytes, fwd_s=sc.fwd_s, bwd_s=sc.bwd_s + sc.acc_s,
                             fwd_peak_bytes=int(needs[f"stage {j} forward"] * GB),
                             bwd_peak_bytes=int(needs[f"stage {j} backward"] * GB),
                             resident_backward=shape.resident(j), upload_wait_s=sim.stages[j].upload_wait_s))
    return out
