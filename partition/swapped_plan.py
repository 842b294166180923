"""The swapped pipeline's plan (:class:`SwappedPlan`): its stages, their GPUs, the runtime's settings, the
predicted time and memory, and how it was found (:class:`MipReport`), as JSON and as the report ``mobius plan``
prints. :func:`partition.plan.plan_model` makes it; ``scheduler/pipeline_engine.py`` runs it."""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar, Collection

from partition.costs import MOMENT_BYTES, ModelProfile, host_bytes_per_param
from partition.gpus import GB, GiB
from partition.hardware import Hardware
from partition.request import update_name
from partition.schedule import PipelineOptions
from partition.sim.result import SimResult
from partition.simulate import simulate, with_spread
from partition.spread import drawn_text


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
    bwd_s: float  # per micro-batch: recompute + backward (+ fp32 sums); the last stage's FB; no recompute if kept
    fwd_peak_bytes: int  # its worker's device memory during the stage's forward
    bwd_peak_bytes: int  # ... and during its backward
    backward_in_place: bool  # the backward follows the forward on the GPU without re-uploading
    upload_wait_s: float  # simulated time its compute waited for its uploads (prefetch not hiding them)
    # (whether it is resident or keeps its activations is the plan's options.resident / options.kept)

    @classmethod
    def from_json(cls, data: dict) -> "StagePlan":
        """A stage as :meth:`SwappedPlan.to_json` wrote it (keys of older plans, such as ``resident``, ignored)."""
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


@dataclass(frozen=True)
class BaselineAdopted:
    """A baseline's partition the plan took, which simulated faster than the search's."""

    name: str
    search_step_s: float  # the search's plan, simulated


@dataclass(frozen=True)
class LinkRates:
    """Each GPU's upload and download rate (GB/s) a simulated step reached, which a re-plan under contention used."""

    h2d: list[float]
    d2h: list[float]


@dataclass(frozen=True)
class PlanReuse:
    """Where a plan kept from an earlier run with the same inputs came from (``mobius.app.plan_cache``)."""

    made: str  # when it was made
    search_s: float  # its search's seconds then
    file: str


@dataclass
class MipReport:
    """How the plan's partition was found: the MIP's search over stage counts, the plans tried under contention,
    the partitions the residency pass tried, the timing model that ranked them, a baseline adopted; and, for a plan
    kept from an earlier run, when it was made. Rows of lists are JSON records, as the search writes them."""

    num_stages: int
    status: str
    encoding: str
    stage_counts_tried: int
    stage_counts_skipped: int
    max_variables: int
    max_constraints: int
    lower_bound_s: float
    per_stage_count: list[dict]  # each stage count solved: num_stages, status, predicted_s, bound
    baseline_adopted: BaselineAdopted | None = None
    contention_plans: list[dict] = field(default_factory=list)  # each plan tried: its rates ("link", "simulated"),
    # boundaries, resident and kept stages, model and simulated step (partition.plan._replan_under_contention)
    alternatives: list[dict] = field(default_factory=list)  # each partition the residency pass tried: num_stages,
    # model and simulated step, resident and kept counts (partition.plan._fastest_residency)
    ranked_by: str = "sync"  # the update rule whose timing model ranked the partitions and residency
    simulated_rates_GBps: LinkRates | None = None  # re-planned under contention at these rates (None: the links')
    reused: PlanReuse | None = None  # kept from an earlier run (None: searched now)

    def to_json(self) -> dict:
        """Its fields by name; ``simulated_rates_GBps`` and ``reused`` only where set."""
        out = asdict(self)
        for name in ("simulated_rates_GBps", "reused"):
            if out[name] is None:
                del out[name]
        return out

    @classmethod
    def from_json(cls, data: dict) -> "MipReport":
        kw = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        for name, kind in (("baseline_adopted", BaselineAdopted), ("simulated_rates_GBps", LinkRates),
                           ("reused", PlanReuse)):
            if kw.get(name) is not None:
                kw[name] = kind(**kw[name])
        return cls(**kw)


@dataclass(frozen=True)
class OtherUpdate:
    """The plan's stages under the other ``train.update`` rule (:func:`partition.plan.other_update_options`)."""

    delayed: bool
    step_s: float  # simulated, with the spreads as they slow the plan's own step
    host_bytes: int  # the swapped stages' host stores

    def to_json(self) -> dict:
        return {"update": update_name(self.delayed), "step_s": self.step_s, "host_bytes": self.host_bytes}

    @classmethod
    def from_json(cls, data: dict) -> "OtherUpdate":
        return cls(data["update"] == "delayed", data["step_s"], data["host_bytes"])


@dataclass
class SwappedPlan:
    """A partition of the model into stages mapped to GPUs, the runtime's settings and the predicted cost."""

    schedule: ClassVar[str] = "swapped"  # (parallel.schedule's name of it)
    boundaries: list[int]
    worker_gpus: list[int]
    num_gpus: int
    micro_batches: int
    micro_batch_size: int
    seq_len: int
    precision: str
    options: PipelineOptions  # the runtime's settings: device slots, offload, barrier, resident / kept stages,
    # gradient download dtype, prefetch buffer, update rule, optimizer states (the one place the plan holds them)
    predicted_step_s: float  # the swapped pipeline simulated on the topology (contention included)
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
    mip: MipReport
    host_bytes: int = 0  # host memory of the swapped stages' stores (weights, AdamW, transfer buffers)
    host_bytes_by_states: dict[str, int] = field(default_factory=dict)  # the same stores with each
    # train.optimizer_states rule's moments (the plan's own is ``options.states``)
    host_memory_bytes: int | None = None  # what the stores may take on the host (None: not known)
    grad_choice: str = ""  # why this gradient dtype
    time_split: dict[str, float] = field(default_factory=dict)  # SimResult.time_split of the predicted step
    compute_scale: dict = field(default_factory=dict)  # the factors the profile's times were scaled by to the
    # compute earlier runs measured in their steps (partition.calibrate.ComputeScale's fields; {}: as profiled)
    other_update: OtherUpdate | None = None  # the same stages under the other train.update rule

    @property
    def num_stages(self) -> int:
        return len(self.boundaries) - 1

    @property
    def tokens_per_step(self) -> int:
        return self.micro_batches * self.micro_batch_size * self.seq_len

    def gpu_of_stage(self, j: int) -> int:
        return self.worker_gpus[j % len(self.worker_gpus)]

    def to_json(self) -> dict:
        """A JSON-ready dict: the plan's fields (the MIP's report and the other rule's step as theirs), the
        options' as top-level keys (:meth:`PipelineOptions.to_json`), ``num_stages`` and ``mapping``."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "options"}
        out.update(stages=[asdict(s) for s in self.stages], mip=self.mip.to_json(),
                   other_update=self.other_update.to_json() if self.other_update else {})
        out.update(self.options.to_json())
        out["num_stages"] = self.num_stages
        out["mapping"] = {"kind": self.mapping_kind, "worker_gpus": self.worker_gpus,
                          "stage_gpus": [self.gpu_of_stage(j) for j in range(self.num_stages)]}
        return finite(out)

    @classmethod
    def from_json(cls, data: dict) -> "SwappedPlan":
        """A plan from :meth:`to_json`'s dict (derived keys such as ``mapping``, and keys of other schedules,
        ignored)."""
        names = {f.name for f in fields(cls)}
        kw = {k: v for k, v in data.items() if k in names}
        kw["stages"] = [StagePlan.from_json(s) for s in data["stages"]]
        kw["options"] = PipelineOptions.from_json(data)
        kw["mip"] = MipReport.from_json(data["mip"])
        kw["other_update"] = OtherUpdate.from_json(data["other_update"]) if data.get("other_update") else None
        return cls(**kw)

    def replay(self, profile: ModelProfile, hardware: Hardware) -> SimResult:
        """The plan's step simulated again with ``profile``'s unit times on ``hardware`` (the plan's own profile
        and machine: its prediction), with ``profile``'s spreads drawn (:func:`with_spread`)."""
        sim = functools.partial(simulate, profile, self.boundaries, hardware, self.worker_gpus, self.micro_batches,
                                self.options)
        return with_spread(sim(), profile, lambda steps, draw: sim(record=False, steps=steps, draw=draw))

    def runtime_settings(self) -> dict:
        """What the runtime takes from the plan (the test that the plan shown is the plan run compares these)."""
        return {"boundaries": list(self.boundaries), "stage_gpus": [self.gpu_of_stage(j) for j in range(self.num_stages)],
                **self.options.to_json()}

    def summary(self) -> str:
        """A human-readable report: stages table, settings, predicted time, memory, traffic, baselines."""
        return "\n".join(_summary_lines(self))


def finite(obj: Any) -> Any:
    """Replace non-finite floats by None so that the JSON is standard."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [finite(v) for v in obj]
    return obj


def _gb(n: float) -> str:
    return f"{n / GB:.2f} GB"


def _stage_list(stages: Collection[int]) -> str:
    return ", ".join(map(str, sorted(stages))) if stages else "none"


def _time_split_line(split: dict[str, float], step_s: float) -> str:
    """"where the time goes": the simulated step's seconds per GPU by what fills them."""
    names = {"forward": "forward", "backward": "backward (recompute and the last stage's forward included)",
             "device_adamw": "device AdamW", "dispatch": "messages posted to other workers",
             "upload_wait": "waiting for uploads",
             "idle": "idle (pipeline fill and drain, activations, the slower worker or compute)"}
    parts = [f"{label} {split[k]:.3f} s ({100 * split[k] / step_s:.0f}%)" for k, label in names.items()
             if split.get(k, 0.0) > 0.0005 * step_s or k in ("forward", "backward", "upload_wait")]
    return (f"where the time goes (per GPU, mean): {', '.join(parts)}; after the last backward "
            f"{split.get('tail', 0.0):.3f} s (global norm, CPU AdamW, reduce)")


def _summary_lines(p: SwappedPlan) -> list[str]:
    """The plan as ``mobius plan`` prints it: its stages, runtime, prediction, search, memory and traffic."""
    lines = _stage_lines(p) + _runtime_lines(p) + _search_lines(p)
    if p.time_split:
        lines.append(_time_split_line(p.time_split, p.predicted_step_s))
    return lines + _totals_lines(p)


def _stage_lines(p: SwappedPlan) -> list[str]:
    """The stages, one row each."""
    lines = [f"stages: {p.num_stages} on {p.num_gpus} GPU(s), {p.mapping_kind} mapping, worker GPUs {p.worker_gpus} "
             f"(stage j runs on GPU worker_gpus[j % {len(p.worker_gpus)}])",
             f"  {'stage':>5}  {'units':<22} {'gpu':>3}  {'where':<8} {'params':>9}  {'fwd/mb':>8}  {'bwd/mb':>8}  "
             f"{'upload wait':>11}  {'peak fwd':>9}  {'peak bwd':>9}"]
    opts = p.options
    for s in p.stages:
        where = ("resident" if s.index in opts.resident else "swapped")[:8]
        lines.append(f"  {s.index:>5}  {s.units:<22} {s.gpu:>3}  {where:<8} {_gb(s.param_bytes):>9}  "
                     f"{s.fwd_s * 1e3:>6.1f}ms  {s.bwd_s * 1e3:>6.1f}ms{'K' if s.index in opts.kept else ' '} "
                     f"{s.upload_wait_s * 1e3:>9.1f}ms  {s.fwd_peak_bytes / GiB:>6.2f}GiB  {s.bwd_peak_bytes / GiB:>6.2f}GiB")
    lines.append("  resident: weights, fp32 master and AdamW states live on the GPU (device AdamW, no uploads); "
                 "K: keeps its forward's activations (no recompute)")
    return lines


def _runtime_lines(p: SwappedPlan) -> list[str]:
    """What the runtime does with the stages (slots, inputs, updates, residency), and the predicted step."""
    opts, lines = p.options, []
    slots = ("2 per GPU (the next stage uploads while one computes)" if opts.num_slots == 2 else
             f"1 per GPU and a {opts.prefetch_bytes / GiB:.2f} GiB prefetch buffer (the next stage's first bytes "
             f"upload while one computes, the rest once its slot is free)" if opts.prefetch_bytes else
             "1 per GPU (no prefetch)")
    lines.append(f"runtime: device slots {slots}; boundary inputs "
                 f"{'in host memory' if opts.offload_inputs else 'kept on the GPU'}"
                 f"; CPU AdamW at {p.cpu_adam_params_per_s / 1e9:.2f} G params/s per worker (all updating), "
                 + ("after the global norm (clipping or fp16), overlapping the next forward" if opts.barrier
                    else "as each stage's gradients arrive")
                 + ("; update delayed: a stage's next uploads wait only for its master's copy into the compute copy"
                    if opts.delayed else ""))
    lines.append(f"resident stages: {_stage_list(opts.resident)}; kept activations: {_stage_list(opts.kept)}; "
                 f"gradient downloads in {opts.grad_dtype} ({p.grad_choice}); host memory for the swapped stages: "
                 f"{p.host_bytes / GiB:.1f} GiB " + (f"of {p.host_memory_bytes / GiB:.1f} GiB available"
                                                     if p.host_memory_bytes is not None else
                                                     "(not checked: set partition.host_memory_gib)"))
    lines.append(states_line(p))
    rates = p.mip.simulated_rates_GBps
    seen = (f"at the upload rates the simulated step reached ({', '.join(f'{r:.1f}' for r in rates.h2d)} GB/s "
            f"per GPU; re-planned under contention)" if rates else "contention-free")
    drawn = drawn_text(p.compute_scale, "workers")
    drawn = f", {drawn}" if drawn else ""
    lines.append(f"predicted step time: {p.predicted_step_s:.3f} s (the runtime's schedule simulated with root-complex "
                 f"contention{drawn}; the MIP's model, {seen}, says {p.model_step_s:.3f} s; solver {p.solver}, "
                 f"{p.solve_s:.2f} s, {p.status})")
    return lines


def states_line(p: SwappedPlan) -> str:
    """The optimizer states' line of a plan: the chosen rule's bytes per trained parameter and the host memory
    each rule's moments would need."""
    per = host_bytes_per_param(p.precision, p.options.grad_dtype == "half", p.options.delayed, p.options.states)
    others = ", ".join(f"{r} {b / GiB:.1f} GiB" for r, b in p.host_bytes_by_states.items())
    return (f"optimizer states: {p.options.states} ({MOMENT_BYTES[p.options.states]:g} bytes of AdamW moments, "
            f"{per:g} bytes in host memory per trained swapped parameter); the swapped stages' host memory by "
            f"train.optimizer_states: {others}")


def _search_lines(p: SwappedPlan) -> list[str]:
    """Where the plan came from: a kept plan, the other update rule, the search's alternatives, a baseline."""
    lines = []
    reused = p.mip.reused
    if reused:
        lines.append(f"plan reused: made on {reused.made} for the same profile, machine, settings "
                     f"and code (its search took {reused.search_s:.1f} s); partition.reuse_plan=false searches again")
    other = p.other_update
    if other:
        room = ("" if p.host_memory_bytes is None or other.host_bytes <= p.host_memory_bytes else
                f", but its stores need {other.host_bytes / GiB:.1f} GiB of host memory")
        lines.append(f"with train.update={update_name(other.delayed)} the same stages would take {other.step_s:.3f} s "
                     f"per step ({other.step_s / p.predicted_step_s - 1:+.0%}{room}; delayed computes each step "
                     f"with the weights one update older)")
    alts = p.mip.alternatives
    if len(alts) > 1:
        each = ", ".join(f"{a['num_stages']} stages {a['simulated_step_s']:.3f} s" for a in alts)
        ranked = ("; ranked by the sync rule's timing model, whose plan simulated faster than the delayed rule's"
                  if p.mip.ranked_by == "sync" and p.options.delayed else "")
        lines.append(f"partition: the fastest simulated, each with its own resident/kept stages, of the search's "
                     f"{len(alts)} near-best and finest ({each}{ranked})")
    adopted = p.mip.baseline_adopted
    if adopted:
        lines.append(f"partition: the {adopted.name} baseline's, which simulates faster than the search's "
                     f"({adopted.search_step_s:.3f} s; {p.status})")
    return lines


def _totals_lines(p: SwappedPlan) -> list[str]:
    """Peak GPU memory, traffic per step and the baselines."""
    lines = []
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
