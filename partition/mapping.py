"""Stage-to-GPU slot orders for the planner, from ``topology``'s mapping search.

The planner tries every stage count, and the best cross mapping may depend on it, so it takes a
function ``gpus_for(num_stages) -> worker_gpus``. :func:`gpus_function` memoises one over
:func:`topology.cross_mapping` or :func:`topology.sequential_mapping` (imported lazily).
"""

from __future__ import annotations

from typing import Callable, Literal, Sequence

MappingKind = Literal["cross", "sequential"]
GpusFor = Callable[[int], list[int]]


def gpus_function(groups: Sequence[Sequence[int]], kind: MappingKind | str = "cross") -> GpusFor:
    """``num_stages -> worker_gpus`` for the root complexes ``groups`` (GPU indices 0..N-1)."""
    import topology

    search = {"cross": topology.cross_mapping, "sequential": topology.sequential_mapping}[kind]
    cache: dict[int, list[int]] = {}
    groups = [list(g) for g in groups]

    def gpus_for(num_stages: int) -> list[int]:
        if num_stages not in cache:
            cache[num_stages] = list(search(groups, max(1, num_stages)).worker_gpus)
        return cache[num_stages]

    return gpus_for


def as_gpus_function(mapping: MappingKind | str | Sequence[int] | GpusFor, groups: Sequence[Sequence[int]]) -> GpusFor:
    """A function for a mapping kind, a fixed slot order, or a function (as
    :class:`partition.request.PlanRequest` checks them)."""
    if callable(mapping):
        return mapping
    if isinstance(mapping, str):
        return gpus_function(groups, mapping)
    fixed = [int(s) for s in mapping]
    return lambda num_stages: fixed
