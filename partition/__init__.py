"""partition: how to cut a model into pipeline stages, and what that will cost.

Numbers in, plans out. The pieces, in the order a plan is made:

* :mod:`partition.profile` -- unit costs, measured one distinct unit at a time (``profile_units``)
  or estimated from a GPU catalogue (``estimate_units``); ``get_profile`` picks and caches.
* :mod:`partition.hardware` -- :class:`Hardware`: GPUs, usable memory, links, shared root complexes.
* :mod:`partition.schedule` -- the pipeline step as data: the action lists the runtime executes.
* :mod:`partition.timing` -- the step's timing and memory model, written once: evaluated with numbers
  (:mod:`partition.evaluate`) and emitted as the MIP's rows (:mod:`partition.mip`, gurobipy, or HiGHS
  when the free licence refuses), seeded by :mod:`partition.heuristic`.
* :mod:`partition.simulate` -- discrete-event simulation of the schedule's action lists with contention
  (its mechanisms: :mod:`partition.sim`).
* :mod:`partition.baselines` -- minimum-stage, maximum-stage, time-balanced; exhaustive search.
* :mod:`partition.plan` -- :func:`plan_model`, the swapped pipeline's planner, and its plan, :class:`SwappedPlan`
  (:mod:`partition.swapped_plan`); what it is asked for is a :class:`PlanRequest` (:mod:`partition.request`).
* :mod:`partition.roundrobin_plan` -- the round-robin schedule family (RoundPipe's class): its memory model,
  its simulation by the same simulator, its cuts and host memory, and its plan, :class:`RoundRobinPlan`.
* :mod:`partition.schedule_comparison` -- :func:`plan_schedules`, the pipeline's entry point: the swapped
  pipeline and, where ``PlanRequest.schedule`` asks, the round-robin family planned beside it
  (:class:`ScheduleComparison`), and the one that runs (``scheduler/roundrobin_engine.py`` runs the round-robin
  family when asked for or faster predicted).

Importing the package and planning from unit descriptions with the estimated (datasheet) profile
import no torch; only measuring does, inside the functions that measure: :mod:`partition.measure`
(unit profiles), :mod:`partition.cpu_rate` (the CPU AdamW rate) and :func:`get_profile` when it may
measure (``"auto"``, ``"measured"``).
"""

from partition.baselines import BASELINES, exhaustive_search, maximum_stage, minimum_stage, time_balanced
from partition.costs import ModelProfile, StageCost, UnitCost, stage_cost, stage_costs
from partition.evaluate import ModelEvaluator, model_step_time
from partition.gpus import GPU_CATALOGUE, GPUSpec, gpu_spec, lookup_gpu
from partition.hardware import Hardware
from partition.mip import MipResult, build_model, solve_partition, solve_stage_count
from partition.plan import plan_model
from partition.estimate import estimate_units
from partition.measure import profile_units
from partition.profile import get_profile
from partition.request import PlanRequest
from partition.roundrobin_plan import RoundRobinPlan
from partition.schedule_comparison import ScheduleComparison, plan_schedules
from partition.schedule import PipelineOptions
from partition.sim.result import SimResult
from partition.simulate import simulate
from partition.swapped_plan import StagePlan, SwappedPlan

__all__ = [
    "BASELINES", "GPU_CATALOGUE", "GPUSpec", "Hardware", "MipResult", "ModelEvaluator", "ModelProfile", "PlanRequest",
    "RoundRobinPlan", "ScheduleComparison", "SimResult", "StageCost", "StagePlan", "SwappedPlan", "UnitCost",
    "build_model", "estimate_units", "exhaustive_search", "get_profile", "gpu_spec", "lookup_gpu", "maximum_stage",
    "minimum_stage", "model_step_time", "PipelineOptions", "plan_model", "plan_schedules", "profile_units", "simulate",
    "solve_partition", "solve_stage_count", "stage_cost", "stage_costs", "time_balanced",
]
