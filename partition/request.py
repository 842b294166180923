"""What a plan is asked for: :class:`PlanRequest`, the one value :func:`partition.plan.plan_model`
takes besides the profile and the machine, checked when it is made."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Collection, Sequence, get_args

from mobius.errors import ConfigError
from partition.lp import SolverName
from partition.mapping import GpusFor, MappingKind
from partition.mip import DEFAULT_REL_GAP, BandwidthView
from partition.sim.flows import Sharing

CONTENTION_ROUNDS = 1  # re-plans at the simulated rates, at most


def update_name(delayed: bool) -> str:
    """The ``train.update`` rule a plan's ``delayed`` flag stands for, as the configuration, the plans' JSON and
    their reports name it."""
    return "delayed" if delayed else "sync"

_CHOICES = {"solver": get_args(SolverName), "bandwidth_view": get_args(BandwidthView), "sharing": get_args(Sharing),
            "offload_inputs": ("auto", "on", "off"), "grad_download": ("auto", "fp32", "half"),
            "schedule": ("swapped", "round_robin", "auto"),
            "states": ("fp32", "bf16", "int8")}


@dataclass(frozen=True)
class PlanRequest:
    """What the user asks of the planner.

    ``mapping``: "cross" or "sequential" (``topology``'s search for each stage count), a fixed slot
    order (a permutation of 0..n-1), or a function of the stage count. ``bandwidth_view``: how the
    MIP sees shared root complexes (see :func:`partition.mip.build_model`); the simulator always
    models them, sharing them as ``sharing`` says. ``min_stages``: the fewest stages allowed (a
    runtime that keeps every GPU busy needs ``N``). ``boundaries``: a partition to evaluate instead
    of solving for one (``parallel.stages``). ``prefetch``: two device slots allowed;
    ``offload_inputs``: "on", "off" or "auto" (both tried); ``barrier``: the run clips gradients or
    scales fp16 losses (updates wait for the global norm). ``resident`` / ``kept``: the stages that
    stay on their GPU / keep their activations (None: the second pass chooses, see
    :mod:`partition.residency`). ``grad_download``: "fp32", "half" or "auto" (half when host memory
    needs it or the simulator finds it clearly faster). ``contention_rounds``: how often to re-plan
    at the simulated transfer rates when contention the MIP does not see slows the simulated step
    (0: never). ``delayed``: ``train.update: delayed`` (a step computes with the weights one update older and
    does not wait for its CPU updates; :attr:`mobius.config.TrainSection.delayed`). ``states``: the AdamW moments' precision (``train.optimizer_states``:
    "fp32", "bf16" or "int8"; the host bytes per parameter and the CPU update's rate follow it). ``schedule``:
    "swapped" (the swapped pipeline alone),
    "round_robin" (also plan the round-robin family, :mod:`partition.roundrobin_plan`, on the same GPUs, and run it)
    or "auto" (plan both, run the faster predicted one). Sequences are stored as tuples and
    frozensets."""

    micro_batches: int
    mapping: MappingKind | str | Sequence[int] | GpusFor = "cross"
    solver: SolverName = "auto"
    time_limit_s: float = 3.0
    bandwidth_view: BandwidthView = "link"
    sharing: Sharing = "priority"
    with_baselines: bool = True
    rel_gap: float = DEFAULT_REL_GAP
    prefetch: bool = True
    min_stages: int = 1
    boundaries: Sequence[int] | None = None
    offload_inputs: str = "auto"
    barrier: bool = False
    resident: Collection[int] | None = None
    kept: Collection[int] | None = None
    grad_download: str = "auto"
    contention_rounds: int = CONTENTION_ROUNDS
    delayed: bool = False
    schedule: str = "swapped"
    states: str = "fp32"

    def __post_init__(self) -> None:
        for name, allowed in _CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(f"PlanRequest.{name} must be one of {'|'.join(allowed)}, got {getattr(self, name)!r}")
        _at_least("micro_batches", self.micro_batches, 1)
        _at_least("min_stages", self.min_stages, 1)
        _at_least("contention_rounds", self.contention_rounds, 0)
        if not (math.isfinite(self.time_limit_s) and self.time_limit_s > 0):
            raise ConfigError(f"PlanRequest.time_limit_s must be a finite number of seconds > 0, "
                              f"got {self.time_limit_s}")
        if not 0 <= self.rel_gap < 1:
            raise ConfigError(f"PlanRequest.rel_gap must be >= 0 and < 1, got {self.rel_gap}")
        object.__setattr__(self, "mapping", _mapping(self.mapping))
        object.__setattr__(self, "boundaries", _boundaries(self.boundaries))
        object.__setattr__(self, "resident", _stages("resident", self.resident))
        object.__setattr__(self, "kept", _stages("kept", self.kept))


def _at_least(name: str, value: Any, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ConfigError(f"PlanRequest.{name} must be a whole number >= {least}, got {value!r}")


def _mapping(mapping: Any) -> Any:
    """A mapping kind or function as given; a fixed slot order as a tuple, checked to be a permutation."""
    if callable(mapping):
        return mapping
    if isinstance(mapping, str):
        if mapping not in get_args(MappingKind):
            raise ConfigError(f"PlanRequest.mapping must be cross or sequential (or a slot order, or a function), "
                              f"got {mapping!r}")
        return mapping
    fixed = tuple(int(s) for s in mapping)
    if sorted(fixed) != list(range(len(fixed))):
        raise ConfigError(f"PlanRequest.mapping {list(fixed)} must be a permutation of the GPUs 0..{len(fixed) - 1}")
    return fixed


def _boundaries(boundaries: Sequence[int] | None) -> tuple[int, ...] | None:
    """A forced partition as a tuple: from unit 0, each stage at least one unit."""
    if boundaries is None:
        return None
    bounds = tuple(int(b) for b in boundaries)
    if len(bounds) < 2 or bounds[0] != 0 or any(b >= c for b, c in zip(bounds, bounds[1:])):
        raise ConfigError(f"PlanRequest.boundaries {list(bounds)} must start at 0 and increase (each stage at least "
                          f"one unit)")
    return bounds


def _stages(name: str, stages: Collection[int] | None) -> frozenset[int] | None:
    if stages is None:
        return None
    chosen = frozenset(int(j) for j in stages)
    if any(j < 0 for j in chosen):
        raise ConfigError(f"PlanRequest.{name} {sorted(chosen)} must be stage indices >= 0")
    return chosen
