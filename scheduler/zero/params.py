"""The model's parameters as the chunk layout sees them."""

from __future__ import annotations

from mobius.models import ModelConfig, tied_weights, unit_prefix, unit_specs
from mobius.optim import takes_decay
from partition.zero import ParamInfo
from scheduler.stages import build_units


def model_params(cfg: ModelConfig) -> list[ParamInfo]:
    """Every parameter in forward-use order (units in order, each unit's in registration order); a
    tied head weight is the embedding's parameter with a second name and a second unit."""
    units = build_units(cfg, 0, len(unit_specs(cfg)))
    second = {head: embed for embed, head in tied_weights(cfg)}
    rows: list[list] = []
    index: dict[str, int] = {}
    for k, unit in enumerate(units):
        for n, p in unit.named_parameters():
            full = unit_prefix(k, len(units)) + n
            if full in second and second[full] in index:
                row = rows[index[second[full]]]
                row[0].append(full)
                row[2].append(k)
                index[full] = index[second[full]]
                continue
            index[full] = len(rows)
            rows.append([[full], tuple(p.shape), [k], takes_decay(p)])
    return [ParamInfo(tuple(n), shape, tuple(u), d) for n, shape, u, d in rows]
