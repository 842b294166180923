"""The model's parameters as the flat layouts see them (:class:`mobius.layout.ParamInfo`), and unit
modules built without memory for the runtimes to bind to their buffers."""

from __future__ import annotations

from torch import nn

from mobius.layout import ParamInfo
from mobius.models import ModelConfig, on_meta, tied_weights, unit_prefix, unit_specs
from mobius.models.lora import trains
from mobius.optim import takes_decay


def build_units(cfg: ModelConfig, first: int, end: int) -> nn.ModuleList:
    """Units ``[first, end)`` on the meta device (no memory): parameters are bound later."""
    specs = unit_specs(cfg)
    with on_meta():
        return nn.ModuleList(specs[k].build() for k in range(first, end))


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
    return [ParamInfo(tuple(n), shape, tuple(u), d, trains(cfg, n[0])) for n, shape, u, d in rows]


def stage_params(params: list[ParamInfo], first: int, end: int) -> list[ParamInfo]:
    """The parameters units ``[first, end)`` use, each under the names those units give it (a tied
    weight whose two ends are both there keeps both names), in forward-use order: a tied head's end
    whose embedding is in an earlier stage comes last (after the head's norm), so that the range a
    stage updates itself, when another stage updates the tied weight, is one prefix of its buffer."""
    out, later = [], []
    for p in params:
        mine = [(n, u) for n, u in zip(p.names, p.units) if first <= u < end]
        if mine:
            info = ParamInfo(tuple(n for n, _ in mine), p.shape, tuple(u for _, u in mine), p.decay, p.trains)
            (later if p.units[0] < first else out).append(info)
    return out + later
