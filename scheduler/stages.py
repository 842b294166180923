"""Stage layouts: which parameters a stage holds and where they sit in its flat buffers.

Every stage keeps its parameters in one contiguous buffer per memory (fp32 master in DRAM, a
half-precision pinned copy in DRAM, a slot on the GPU), so an upload is one large copy. Parameters
that take weight decay (matrices, embeddings) come first, those that do not (biases, norms) after,
so the CPU optimizer runs on two flat tensors per stage. A weight tied between the embedding and the
head appears once per stage that holds either end.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mobius.models import ModelConfig, unit_prefix, unit_specs
from mobius.models.base import bind_parameters
from mobius.optim import takes_decay

ALIGN = 64  # elements; every parameter starts at a multiple of this (aligned vector loads and copies)


@dataclass(frozen=True)
class ParamSlot:
    names: tuple[str, ...]  # full state-dict names (two when a tied pair lives in one stage)
    shape: tuple[int, ...]
    offset: int
    numel: int


@dataclass(frozen=True)
class StageLayout:
    index: int
    first_unit: int
    end_unit: int  # exclusive
    params: tuple[ParamSlot, ...]
    numel: int  # buffer length, padding included
    decay_numel: int  # params [0, decay_numel) take weight decay, the rest do not

    def slot_of(self, name: str) -> ParamSlot | None:
        return next((p for p in self.params if name in p.names), None)

    @property
    def param_count(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def runs(self) -> list[tuple[int, int, bool]]:
        """Which elements take weight decay: the decayed parameters first, then the others."""
        return [(0, self.decay_numel, True), (self.decay_numel, self.numel, False)]


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def build_units(cfg: ModelConfig, first: int, end: int) -> nn.ModuleList:
    """The stage's unit modules on the meta device (no memory): parameters are bound later."""
    specs = unit_specs(cfg)
    with torch.device("meta"):
        return nn.ModuleList(specs[k].build() for k in range(first, end))


def stage_layout(cfg: ModelConfig, index: int, first: int, end: int, tied: list[tuple[str, str]]) -> StageLayout:
    """Lay out the parameters of units [first, end) in one flat buffer."""
    num_units = len(unit_specs(cfg))
    units = build_units(cfg, first, end)
    named: list[tuple[str, nn.Parameter]] = []
    for k, unit in zip(range(first, end), units):
        named += [(unit_prefix(k, num_units) + n, p) for n, p in unit.named_parameters()]
    names = {n for n, _ in named}
    alias = {b: a for a, b in tied if a in names and b in names}  # both ends of a tie in this stage
    groups: dict[str, list[str]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    decays: dict[str, bool] = {}
    for n, p in named:
        groups.setdefault(alias.get(n, n), []).append(n)
        shapes[n], decays[n] = tuple(p.shape), takes_decay(p)
    decay = [n for n in groups if decays[n]]
    no_decay = [n for n in groups if not decays[n]]
    params, offset = [], 0
    for n in decay:
        params.append(ParamSlot(tuple(groups[n]), shapes[n], offset, _numel(shapes[n])))
        offset = _align(offset + _numel(shapes[n]))
    decay_numel = offset
    for n in no_decay:
        params.append(ParamSlot(tuple(groups[n]), shapes[n], offset, _numel(shapes[n])))
        offset = _align(offset + _numel(shapes[n]))
    return StageLayout(index, first, end, tuple(params), offset, decay_numel)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def stage_layouts(cfg: ModelConfig, boundaries: list[int], tied: list[tuple[str, str]]) -> list[StageLayout]:
    """Layouts of all stages; stage j covers units [boundaries[j], boundaries[j+1])."""
    return [stage_layout(cfg, j, boundaries[j], boundaries[j + 1], tied) for j in range(len(boundaries) - 1)]


def views(buf: torch.Tensor, layout: StageLayout) -> dict[str, torch.Tensor]:
    """Every parameter name -> its view into a stage's flat buffer."""
    out = {}
    for p in layout.params:
        v = buf[p.offset:p.offset + p.numel].view(p.shape)
        for n in p.names:
            out[n] = v
    return out


def bind(units: nn.ModuleList, layout: StageLayout, num_units: int, params: torch.Tensor,
         grads: torch.Tensor | None, requires_grad: bool | None = None) -> None:
    """Point the stage's unit modules at views of ``params`` (and their ``.grad`` at ``grads``);
    ``requires_grad`` defaults to whether ``grads`` are given."""
    requires_grad = grads is not None if requires_grad is None else requires_grad
    pv = views(params, layout)
    gv = views(grads, layout) if grads is not None else None
    for k, unit in zip(range(layout.first_unit, layout.end_unit), units):
        bind_parameters(unit, unit_prefix(k, num_units), pv.__getitem__, requires_grad,
                        gv.__getitem__ if gv is not None else None)
