"""Stage layouts: which parameters a stage holds and where they sit in its flat buffers.

Every stage keeps its parameters in one contiguous buffer per memory (fp32 master in DRAM, a
half-precision pinned copy in DRAM, a slot on the GPU), so an upload is one large copy. The layout
is the one :mod:`mobius.layout` gives zero mode's chunks, with no chunk limit: parameters in
forward-use order at aligned offsets, the decay runs driving the stage's AdamW. A weight tied
between the embedding and the head appears once per stage that holds either end (once, under both
names, when one stage holds both).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mobius.layout import ChunkLayout, ParamInfo, single_buffer
from mobius.models import ModelConfig, tied_weights, unit_prefix
from mobius.models.base import bind_parameters
from mobius.models.params import model_params, stage_params


@dataclass(frozen=True)
class Placement:
    """One parameter in a stage's buffer."""

    names: tuple[str, ...]  # full state-dict names (two when a tied pair lives in one stage)
    shape: tuple[int, ...]
    offset: int
    numel: int


@dataclass(frozen=True)
class StageLayout:
    index: int
    first_unit: int
    end_unit: int  # exclusive
    flat: ChunkLayout  # one buffer (chunk 0) holding the stage's parameters

    @property
    def params(self) -> tuple[Placement, ...]:
        segs = self.flat.chunks[0].segments if self.flat.chunks else ()
        return tuple(Placement(self.flat.params[s.param].names, self.flat.params[s.param].shape, s.offset, s.numel)
                     for s in segs)

    @property
    def numel(self) -> int:
        """Buffer length, alignment padding included."""
        return self.flat.padded if self.flat.chunks else 0

    @property
    def param_count(self) -> int:
        return self.flat.param_numel

    @property
    def trainable_numel(self) -> int:
        """Elements ``[0, trainable_numel)`` train (master, moments, gradients); the rest are frozen."""
        frozen = [p.offset for p, info in zip(self.params, self._infos()) if not info.trains]
        return min(frozen) if frozen else self.numel

    @property
    def frozen_count(self) -> int:
        return sum(p.numel for p, info in zip(self.params, self._infos()) if not info.trains)

    def trains(self, name: str) -> bool:
        return next(info.trains for info in self.flat.params if name in info.names)

    def _infos(self) -> list[ParamInfo]:
        return [self.flat.params[s.param] for s in self.flat.chunks[0].segments] if self.flat.chunks else []

    @property
    def runs(self) -> list[tuple[int, int, bool]]:
        """Which trainable elements take weight decay (``[lo, hi)``, alignment gaps joined to the run
        before); frozen elements are in no run."""
        t = self.trainable_numel
        return [(lo, min(hi, t), d) for lo, hi, d in (self.flat.decay_runs(0) if self.flat.chunks else []) if lo < t]

    def place_of(self, name: str) -> Placement | None:
        return next((p for p in self.params if name in p.names), None)


def stage_layout(params: list[ParamInfo], index: int, first: int, end: int) -> StageLayout:
    """Lay out the parameters of units [first, end) in one flat buffer."""
    return StageLayout(index, first, end, single_buffer(stage_params(params, first, end), end))


def stage_layouts(cfg: ModelConfig, boundaries: list[int]) -> list[StageLayout]:
    """Layouts of all stages; stage j covers units [boundaries[j], boundaries[j+1])."""
    params = model_params(cfg)
    return [stage_layout(params, j, boundaries[j], boundaries[j + 1]) for j in range(len(boundaries) - 1)]


def tied_places(cfg: ModelConfig, first: StageLayout, last: StageLayout) -> tuple[Placement, Placement] | None:
    """Where a tied weight that trains lies in the layout holding the embedding and in the one holding the head
    (its two ends); None when no tied weight trains."""
    for embed, head in tied_weights(cfg):
        if first.trains(embed):
            return first.place_of(embed), last.place_of(head)
    return None


def trains_last(layout: StageLayout, offset: int, numel: int) -> bool:
    """Whether elements ``[offset, offset + numel)`` are the last parameter that trains in ``layout``'s buffer (a
    tied head's end, which another store's AdamW updates: the layout's own covers ``[0, offset)``)."""
    t = layout.trainable_numel
    return offset + numel <= t and all(p.offset + p.numel <= offset for p in layout.params
                                       if p.offset < t and p.offset != offset)


def views(buf: torch.Tensor, layout: StageLayout, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter name (``trainable_only``: of those that train) -> its view into a stage's flat
    buffer."""
    out = {}
    for p in layout.params:
        if trainable_only and p.offset >= layout.trainable_numel:
            continue
        v = buf[p.offset:p.offset + p.numel].view(p.shape)
        for n in p.names:
            out[n] = v
    return out


def bind(units: nn.ModuleList, layout: StageLayout, num_units: int, params: torch.Tensor,
         grads: torch.Tensor | None, requires_grad: bool | None = None,
         sums: torch.Tensor | None = None) -> list[tuple[nn.Parameter, torch.Tensor]]:
    """Point the stage's unit modules at views of ``params`` (and their ``.grad`` at ``grads``, which
    holds the trainable elements only); ``requires_grad`` (default: whether ``grads`` or ``sums`` are
    given) applies to what trains, frozen parameters never require gradients. With ``sums`` (fp32, the
    trainable elements) instead of ``grads``, each trainable parameter's ``.grad`` starts empty, so that
    autograd hands it each micro-batch's gradient without adding it anywhere, and the pairs (parameter,
    its view of ``sums``) are returned for :func:`add_gradients`."""
    requires_grad = grads is not None or sums is not None if requires_grad is None else requires_grad
    pv = views(params, layout)
    gv = views(grads, layout, trainable_only=True) if grads is not None else {}
    sv = views(sums, layout, trainable_only=True) if sums is not None else {}
    pairs = []
    for k, unit in zip(range(layout.first_unit, layout.end_unit), units):
        bound = bind_parameters(unit, unit_prefix(k, num_units), pv.__getitem__,
                                lambda name: requires_grad and layout.trains(name), gv.get)
        pairs += [(param, sv[name]) for name, param in bound if name in sv]
    return pairs


TIE_CHUNK = 1 << 20  # elements of a tied weight's gradients summed at a time (4 MiB of fp32: in cache for its norm)


def add_tied(x: torch.Tensor, y: torch.Tensor, into: tuple[torch.Tensor, ...] = ()) -> float:
    """The sum of a tied weight's two ends' gradients, ``x + y`` in fp32, written into each of ``into`` (x, y
    or neither), ``TIE_CHUNK`` elements at a time; returns its sum of squares. No temporary of the weight's
    size: a fresh one of an embedding's size costs more than the sum itself, in page faults. Into an fp32
    ``x`` alone (the pipeline's, whose ends are on two workers) the sum is added in place, faster than
    through a scratch chunk (on a 2-core VM 8.2 against 16.1 ms for 38.6M parameters, 39.9 against 52.5 ms
    for 128.7M)."""
    in_place = len(into) == 1 and into[0] is x and x.dtype == torch.float32
    scratch = None if in_place else torch.empty(min(TIE_CHUNK, x.numel()), dtype=torch.float32, device=x.device)
    sumsq = 0.0
    for lo in range(0, x.numel(), TIE_CHUNK):
        hi = min(lo + TIE_CHUNK, x.numel())
        if scratch is None:
            total = x[lo:hi].add_(y[lo:hi])
        else:
            total = scratch[:hi - lo].copy_(x[lo:hi]).add_(y[lo:hi])  # x + y in fp32, rounded once into each end
            for end in into:
                end[lo:hi].copy_(total)
        sumsq += float(torch.dot(total, total))
    return sumsq


def add_gradients(pairs: list[tuple[nn.Parameter, torch.Tensor]]) -> None:
    """Add each parameter's gradient of one micro-batch into its fp32 sum and drop it: one pass over the
    gradients (no half-precision buffer to accumulate into and zero again), one multi-tensor add."""
    ready = [(total, param) for param, total in pairs if param.grad is not None]
    if ready:
        torch._foreach_add_([total for total, _ in ready], [param.grad for _, param in ready])
    for _, param in ready:
        param.grad = None

