"""Stage-to-GPU slot orders for the planner, from ``topology``'s mapping search.

The planner tries every stage count, and the best cross mapping may depend on it, so it takes a
function ``gpus_for(num_stages) -> worker_gpus``. :func:`gpus_function` memoises one over
:func:`topology.cross_mapping` or :func:`topology.sequential_mapping` (imported lazily).
"""

from __future__ import annotations

from typing import Callable, Literal, Sequence

from mobius.errors import ConfigError

MappingKind = Literal["cross", "sequential"]
GpusFor = Callable[[int], list[int]]


def gpus_function(groups: Sequence[Sequence[int]], kind: MappingKind | str = "cross") -> GpusFor:
    """``num_stages -> worker_gpus`` for the root complexes ``groups`` (GPU indices 0..N-1)."""
    import topology

    if kind not in ("cross", "sequential"):
        raise ConfigError(f"parallel.mapping must be cross or sequential, got {kind!r}")
    search = topology.cross_mapping if kind == "cross" else topology.sequential_mapping
    cache: dict[int, list[int]] = {}
    groups = [list(g) for g in groups]

    def gpus_for(num_stages: int) -> list[int]:
        if num_stages not in cache:
            cache[num_stages] = list(search(groups, max(1, num_stages)).worker_gpus)
        return cache[num_stages]

    return gpus_for


def as_gpus_function(mapping: MappingKind | str | Sequence[int] | GpusFor, groups: Sequence[Sequence[int]]) -> GpusFor:
    """Accept a mapping kind, a fixed slot order, or a function, and return a function."""
    if callable(mapping):
        return mapping
    if isinstance(mapping, str):
        return gpus_function(groups, mapping)
    fixed = [int(s) for s in mapping]
    if sorted(fixed) != list(range(len(fixed))):
        raise ConfigError(f"worker_gpus {fixed} must be a permutation of the GPUs 0..{len(fixed) - 1}")
    return lambda num_stages: fixed
