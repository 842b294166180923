"""The model's parameters as the chunk layout sees them, and the unit modules bound to chunk memory."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from mobius.models import ModelConfig, init_unit, tied_weights, unit_specs
from mobius.optim import takes_decay
from partition.zero import ParamInfo
from scheduler.stages import build_units, unit_prefix


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


def initial_tensors(cfg: ModelConfig, seed: int, units: set[int]) -> dict[str, torch.Tensor]:
    """Freshly initialised weights of ``units`` (each built alone, as the whole model initialises it;
    a tied head weight is the embedding's, so unit 0 must be among them for it)."""
    specs = unit_specs(cfg)
    out: dict[str, torch.Tensor] = {}
    for k in sorted(units):
        unit = specs[k].build()
        init_unit(cfg, unit, k, seed)
        out.update({unit_prefix(k, len(specs)) + n: p.detach() for n, p in unit.named_parameters()})
    for embed, head in tied_weights(cfg):
        if embed in out:
            out[head] = out[embed]
    return out


def bind(unit: nn.Module, prefix: str, tensor_of: Callable[[str], torch.Tensor],
         grad: bool) -> list[tuple[str, nn.Parameter]]:
    """Point a unit's parameters at ``tensor_of(full name)``; returns the new parameters by name."""
    bound = []
    for mod_name, mod in unit.named_modules():
        for leaf in [n for n, p in mod._parameters.items() if p is not None]:
            full = prefix + (f"{mod_name}." if mod_name else "") + leaf
            param = nn.Parameter(tensor_of(full), requires_grad=grad)
            mod._parameters[leaf] = param
            bound.append((full, param))
    return bound
