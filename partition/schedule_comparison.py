"""The pipeline's schedules planned side by side, and the one ``mobius train`` runs.

:func:`plan_schedules` plans the swapped pipeline (:func:`partition.plan.plan_model`) and, where
``PlanRequest.schedule`` asks, the round-robin family on the same GPUs under the same settings
(:func:`partition.roundrobin_plan.plan_round_robin`): ``round_robin`` runs it, ``auto`` runs the faster predicted.
The :class:`ScheduleComparison` it returns is what ``mobius plan`` prints and ``plan.json`` holds; its
:attr:`~ScheduleComparison.runs` is the plan an engine runs, a :class:`~partition.swapped_plan.SwappedPlan` or a
:class:`~partition.roundrobin_plan.RoundRobinPlan`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from mobius.errors import MobiusError
from partition.costs import ModelProfile
from partition.hardware import Hardware
from partition.plan import plan_model
from partition.request import PlanRequest, update_name
from partition.roundrobin_plan import RoundRobinPlan, plan_round_robin, round_robin_options
from partition.swapped_plan import SwappedPlan, finite


@dataclass(frozen=True)
class PlannedSchedule:
    """One schedule planned for a pipeline run, as the plan's JSON gives it: the one ``mobius train`` runs at its
    top level, the others under ``other_schedules``."""

    schedule: str  # "swapped" (the swapped pipeline) or "round_robin" (the round-robin family)
    update: str  # train.update: "sync" or "delayed"
    predicted_step_s: float  # the schedule simulated on the topology
    tokens_per_s: float
    time_split: dict[str, float]  # where its simulated step goes (SimResult.time_split)

    @classmethod
    def of(cls, plan: SwappedPlan | RoundRobinPlan) -> "PlannedSchedule":
        return cls(plan.schedule, update_name(plan.options.delayed), plan.predicted_step_s,
                   plan.tokens_per_step / plan.predicted_step_s, dict(plan.time_split))


@dataclass(frozen=True)
class ScheduleComparison:
    """The pipeline's schedules planned for a run: the swapped pipeline, the round-robin family's plan beside it
    when it was asked for (or why it could not be made), and which of the two runs."""

    swapped: SwappedPlan
    round_robin: RoundRobinPlan | None = None  # None: not asked for, or not possible (round_robin_error says why)
    round_robin_error: str = ""
    round_robin_runs: bool = False

    def __post_init__(self) -> None:
        assert self.round_robin is not None or not self.round_robin_runs, "the round-robin plan runs, but none was made"

    @property
    def runs(self) -> SwappedPlan | RoundRobinPlan:
        """The plan ``mobius train`` runs: its type picks the engine (``mobius.app.launch.make_engine``)."""
        return self.round_robin if self.round_robin_runs and self.round_robin is not None else self.swapped

    def schedules(self) -> list[PlannedSchedule]:
        """Every schedule planned, the one that runs first."""
        runs = self.runs
        others = [p for p in (self.swapped, self.round_robin) if p is not None and p is not runs]
        return [PlannedSchedule.of(p) for p in [runs, *others]]

    def to_json(self) -> dict:
        """A JSON-ready dict (what ``mobius plan --json`` prints and ``plan.json`` holds): the swapped plan's
        (:meth:`SwappedPlan.to_json`); the round-robin family's under ``round_robin`` with whether it ``runs`` and its
        ``summary`` lines (``{"error": why}`` where it could not be made, ``{}`` where it was not asked for); and at
        the top level the schedule that runs -- its ``schedule``, ``update``, ``predicted_step_s``, ``tokens_per_s``
        and ``time_split`` -- with the others, the same fields each, under ``other_schedules``."""
        out = self.swapped.to_json()
        out["round_robin"] = self._round_robin_json()
        runs, *others = self.schedules()
        out.update(asdict(runs))
        out["other_schedules"] = [asdict(o) for o in others]
        return finite(out)

    def _round_robin_json(self) -> dict:
        if self.round_robin is None:
            return {"error": self.round_robin_error} if self.round_robin_error else {}
        return {**self.round_robin.to_json(), "runs": self.round_robin_runs, "summary": self._round_robin_lines()}

    @classmethod
    def from_json(cls, data: dict) -> "ScheduleComparison":
        """The comparison :meth:`to_json` wrote (``plan.json``, a kept plan): the swapped plan with its own step and
        split (from ``other_schedules`` when another schedule runs), the round-robin plan on its GPUs and settings."""
        running = data.get("schedule", "swapped")
        if running != "swapped":
            own = next(s for s in data["other_schedules"] if s["schedule"] == "swapped")
            data = {**data, "predicted_step_s": own["predicted_step_s"], "time_split": own["time_split"]}
        swapped, rr = SwappedPlan.from_json(data), data.get("round_robin") or {}
        if "error" in rr or not rr:
            return cls(swapped, round_robin_error=rr.get("error", ""))
        robin = RoundRobinPlan.from_json(rr, swapped.worker_gpus, swapped.micro_batches, swapped.tokens_per_step,
                                         round_robin_options(swapped.options))
        return cls(swapped, robin, round_robin_runs=running == "round_robin")

    def headline(self) -> str:
        """One line: the schedule that runs, its update rule, predicted step and tokens/s, and the other's."""
        s, n = self.swapped, len(self.swapped.worker_gpus)
        gpus = f"{n} GPU{'s' if n > 1 else ''}"
        swapped = (f"swapped pipeline ({s.num_stages} stages on {gpus}), update {update_name(s.options.delayed)}: "
                   f"{s.predicted_step_s:.3f} s per step predicted, {s.tokens_per_step / s.predicted_step_s:,.0f} "
                   f"tokens/s")
        rr = self.round_robin
        if rr is None:
            return f"schedule: {swapped}"
        rule, other = update_name(rr.options.delayed), update_name(not rr.options.delayed)
        robin = (f"round-robin ({rr.cuts.num_forward} forward + 1 fused + {rr.cuts.num_backward} backward ops "
                 f"per round on {gpus}), update {rule}: {rr.predicted_step_s:.3f} s per step "
                 f"predicted, {rr.tokens_per_s():,.0f} tokens/s ({rr.tokens_per_s(rr.other_step_s):,.0f} {other})")
        if self.round_robin_runs:
            return f"schedule: {robin}; not run: the {swapped}"
        return f"schedule: {swapped}; not run: the {robin}"

    def summary(self) -> str:
        """The swapped plan's report (:meth:`SwappedPlan.summary`), then the round-robin family's lines."""
        if self.round_robin is None:
            robin = [f"round-robin schedule: {self.round_robin_error}"] if self.round_robin_error else []
        else:
            robin = self._round_robin_lines()
        return "\n".join([self.swapped.summary(), *robin])

    def _round_robin_lines(self) -> list[str]:
        assert self.round_robin is not None
        return self.round_robin.lines(self.swapped.predicted_step_s, self.round_robin_runs)


def plan_schedules(profile: ModelProfile, hardware: Hardware, request: PlanRequest) -> ScheduleComparison:
    """The swapped pipeline's plan of ``request`` (:func:`plan_model`) and, unless ``request.schedule`` is swapped, the
    round-robin family's on the same GPUs under the same update rule and gradient dtype, and which runs
    (``schedule`` round_robin, or auto and faster predicted); where it cannot be made, why (an error when the run
    asks for it)."""
    swapped = plan_model(profile, hardware, request)
    if request.schedule == "swapped":
        return ScheduleComparison(swapped)
    try:
        if len(swapped.worker_gpus) < 2:
            raise ValueError(f"it needs at least 2 workers, the run has {len(swapped.worker_gpus)}")
        rr = plan_round_robin(profile, hardware, swapped.worker_gpus, request.micro_batches, swapped.options,
                              hardware.gpu_memory_bytes, request.sharing)
    except ValueError as e:
        if request.schedule == "round_robin":
            raise MobiusError(f"parallel.schedule=round_robin: {e}") from e
        return ScheduleComparison(swapped, round_robin_error=str(e))
    runs = request.schedule == "round_robin" or rr.predicted_step_s < swapped.predicted_step_s
    return ScheduleComparison(swapped, rr, round_robin_runs=runs)
