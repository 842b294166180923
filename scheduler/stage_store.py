"""A stage's optimizer-side memory: fp32 master weights, AdamW moments, the half-precision copy
the GPU computes with and where its gradients arrive, all flat; and the AdamW update on them.

A *swapped* stage keeps all of it in host memory (the half copy pinned, for uploads) and updates on
the CPU; a *resident* stage keeps it on its GPU and updates there. Host bytes per swapped parameter
with fp32 moments (``train.optimizer_states``: bf16 moments take 4 fewer, int8 5.875 fewer):

=============================  ====  ==========================================================
train precision / gradients    B     what
=============================  ====  ==========================================================
bf16/fp16, fp32 downloads      18    4 master + 8 AdamW (m, v) + 2 pinned half copy + 4 pinned fp32 gradient
bf16, half downloads           14    the gradient lands in the half copy (it is rewritten by the update)
fp32                           16    the master is the upload copy; 4 pinned fp32 gradient
fp32, train.update=delayed     20    a separate pinned fp32 upload copy (the compute weights)
=============================  ====  ==========================================================

fp32 downloads carry the gradient sums exactly as the GPU accumulated them (the reference trainer's
numbers); half downloads round them to bf16 first (half the GPU->host bytes and 4 fewer host bytes
per parameter). Every gradient of a step waits in host memory for the global norm when the run clips
(or scales fp16 losses), so a smaller pool of fp32 buffers would not bound anything there.
:func:`check_host_memory` computes the need before anything is allocated.

Under ``train.update: delayed`` the copy the GPU computes with (``half``; in fp32 a separate fp32
copy) holds the *compute weights*, one update behind the master: once a step's last upload of the stage
has read it and the stage's earlier AdamWs have run, it takes the master (w_{t-1}) and lets the next
step's uploads go (``updated``); the AdamW then runs on the master alone, beside the next step's compute,
and the next download of the stage's gradients waits for it (``consumed``). Gradients then come down in
fp32 only (a half download would land on the compute weights).

A weight tied between the embedding and the head trains once when one worker holds both ends' stages
(:class:`TiedEnd`): the embedding's store updates it, and the head's store holds no master or moments
for its end, whose upload reads the embedding's copy. Its gradient still comes down into the head's
store, for the two ends' sum.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass
from typing import Mapping

import torch

from mobius.config import TrainSection
from mobius.errors import MobiusError
from mobius.optim import FlatAdamW
from mobius.states import Moments
from partition.costs import compute_copy_work, host_bytes_per_param, tied_end_bytes_per_param
from scheduler.pinned import host_zeros
from scheduler.stages import Placement, StageLayout, trains_last
from topology.host import HOST_USABLE_FRACTION, available_host_bytes

log = logging.getLogger(__name__)


def host_bytes(layouts: list[StageLayout], train_dtype: torch.dtype, half_grads: bool = False,
               delayed: bool = False, tied_numel: int = 0, states: str = "fp32") -> int:
    """Host memory the stores of these swapped stages need (see the module docstring): what trains at
    its bytes per parameter (with ``states``' moments), a frozen parameter only its copy in the training
    dtype; ``tied_numel`` elements of them a tied head's end that another store updates (its copy and
    gradient only)."""
    precision = "fp32" if train_dtype == torch.float32 else "half"
    per = host_bytes_per_param(precision, half_grads, delayed, states)
    end = tied_end_bytes_per_param(precision, half_grads)
    return round(sum(lay.trainable_numel * per + (lay.numel - lay.trainable_numel) * train_dtype.itemsize
                     for lay in layouts) - tied_numel * (per - end))


def check_host_memory(needed: int, what: str) -> None:
    avail = available_host_bytes()
    if avail is not None and needed > avail:
        raise MobiusError(f"{what} needs {needed / 2**30:.1f} GiB of host memory for weights, optimizer states and "
                          f"transfer buffers, but only {avail / 2**30:.1f} GiB is available to them "
                          f"({HOST_USABLE_FRACTION:.0%} of the free memory)")


@dataclass(frozen=True)
class TiedEnd:
    """The head's end of a weight tied to the embedding, in the head stage's store, when one worker
    holds both stages: the embedding's store (``source``) updates the weight, the head's store does not
    (no master or moments for it), and the head's uploads read the range from the source's copy.
    ``offset``: where the end starts in the head's buffers (it is the last thing there that trains);
    ``source_offset``: where the weight starts in the source's."""

    offset: int
    numel: int
    source: "StageStore"
    source_offset: int

    def source_range(self, buf: torch.Tensor) -> torch.Tensor:
        return buf[self.source_offset:self.source_offset + self.numel]


class StageStore:
    """One stage's flat buffers and its AdamW, in host memory (``device`` cpu) or on a GPU (resident).

    ``half`` is the copy the GPU computes with (the master itself in fp32, unless ``delayed``). On
    the host it is pinned for uploads, and the stage's gradients arrive in ``grad`` (fp32) or, with
    ``half_grads``, in ``half`` itself; a resident stage's gradients stay in its device slot.

    ``delayed`` (train.update=delayed): ``half`` holds the compute weights, one update behind the
    master (a separate fp32 copy in fp32 training); :meth:`update` refreshes it from the master
    before its AdamW, which then leaves it alone.

    ``tied`` (the head's store, a :class:`TiedEnd`): elements ``[own, trainable_numel)`` are the tied end,
    which another store updates; master, moments and AdamW cover ``[0, own)``.
    """

    def __init__(self, layout: StageLayout, train_dtype: torch.dtype, cfg: TrainSection, pin: bool = False,
                 half_grads: bool = False, device: torch.device | str = "cpu", delayed: bool = False,
                 tied: TiedEnd | None = None):
        self.layout, self.dtype, self.delayed, self.tied = layout, train_dtype, delayed, tied
        n, t, device = layout.numel, layout.trainable_numel, torch.device(device)
        self.own = t if tied is None else tied.offset  # what this store's AdamW updates: [0, own)
        assert tied is None or trains_last(layout, tied.offset, tied.numel), \
            "a tied end must be the last thing that trains in its stage"
        on_host = device.type == "cpu"
        fp32 = train_dtype == torch.float32
        shared = fp32 and not delayed  # the master is the copy the GPU computes with
        own = self.own
        if on_host:  # page-locked at the exact size (scheduler/pinned.py): what host_bytes counts
            self.half = host_zeros(n, train_dtype, pin, self)
            self.master = self.half[:own] if shared else host_zeros(own, torch.float32, False, self)
        else:
            self.half = torch.zeros(n, dtype=train_dtype, device=device)
            self.master = self.half[:own] if shared else torch.zeros(own, dtype=torch.float32, device=device)
        assert not (half_grads and fp32), "half-precision downloads need a half-precision copy"
        if half_grads and delayed:
            raise MobiusError("internal error: half-precision gradient downloads land in the half copy, which under "
                              "train.update=delayed holds the compute weights; a delayed run's plan must download "
                              "fp32 gradients (parallel.grad_download=fp32)")
        self.grad = host_zeros(t, torch.float32, pin, self) if on_host and not half_grads else None
        runs = [(lo, min(hi, own), d) for lo, hi, d in layout.runs if lo < own]
        origins = [(p.offset, 0) for p in layout.params if p.offset < own]  # each parameter's first element
        self.optimizer = FlatAdamW(self.master, None if shared or delayed else self.half[:own], runs, cfg,
                                   compute=self.half[:own] if delayed else None, origins=origins)
        self.updated = threading.Event()  # set when `half` holds the weights the next upload must copy
        self.updated.set()
        # set when the last update has read its gradients (the next download may overwrite them): under
        # delayed when its AdamW ends, after `updated`; otherwise the same moment, the same event
        self.consumed = threading.Event() if delayed else self.updated
        self.consumed.set()
        self.updates_queued = 0  # AdamW jobs queued on the optimizer thread (the dispatch thread counts them)
        self.updates_run = 0  # of those, ended or failed (the optimizer thread): a compute copy waits for them

    @property
    def grads_in(self) -> torch.Tensor:
        """Where a download puts the stage's gradients (host stores): the trainable elements."""
        return self.grad if self.grad is not None else self.half[:self.layout.trainable_numel]

    def load(self, weights: Mapping[str, torch.Tensor]) -> set[str]:
        """Fill the master copy (what trains) and the half copy (everything) of the parameters that
        ``weights`` names (some of the stage's: a unit's, say); returns the names filled (both names of
        a tied pair the stage holds; not a :class:`TiedEnd`, which the source's weights fill)."""
        t, separate = self.layout.trainable_numel, self.half.data_ptr() != self.master.data_ptr()
        filled: set[str] = set()
        for p in self.layout.params:
            name = next((n for n in p.names if n in weights), None)
            if name is None or self._is_tied_end(p):
                continue
            lo, hi = p.offset, p.offset + p.numel
            if lo < t:
                self.master[lo:hi].copy_(weights[name].reshape(-1))
                if separate:
                    self.half[lo:hi].copy_(self.master[lo:hi])
            else:
                self.half[lo:hi].copy_(weights[name].reshape(-1))
            filled.update(p.names)
        return filled

    def _is_tied_end(self, p: Placement) -> bool:
        return self.tied is not None and p.offset == self.tied.offset

    @property
    def tied_names(self) -> set[str]:
        """The names of a :class:`TiedEnd` (which the source's weights fill); empty without one."""
        return {n for p in self.layout.params if self._is_tied_end(p) for n in p.names}

    def wait_ready(self) -> None:
        """Until the copy the GPU computes with holds the weights the next upload must copy (a tied
        end's too, in the source's store)."""
        self.updated.wait()
        if self.tied is not None:
            self.tied.source.updated.wait()

    def upload_pieces(self, lo: int, hi: int) -> list[tuple[int, int, torch.Tensor]]:
        """Elements ``[lo, hi)`` of the copy the GPU computes with, as (start, end, the host tensor of
        ``end - start`` elements) pieces in order: a tied end's from the source's copy."""
        if self.tied is None:
            return [(lo, hi, self.half[lo:hi])] if lo < hi else []
        a, b = self.tied.offset, self.tied.offset + self.tied.numel
        source = self.tied.source_range(self.tied.source.half)
        pieces = [(lo, min(hi, a), self.half[lo:min(hi, a)]),
                  (max(lo, a), min(hi, b), source[max(lo, a) - a:min(hi, b) - a]),
                  (max(lo, b), hi, self.half[max(lo, b):hi])]
        return [(x, y, src) for x, y, src in pieces if x < y]

    def update(self, lr: float, grad_factor: float, grad: torch.Tensor | None = None, skip: bool = False,
               copy: bool = True) -> None:
        """The stage's optimizer step: AdamW with gradient ``grad * grad_factor`` (default: the
        downloaded gradients), the half copy rewritten in the same pass; ``skip`` (an fp16 overflow):
        none. ``delayed``: first the half copy takes the master (w_{t-1}, what the next step computes
        with; a skipped step too) and ``updated`` is set, so that uploads wait for that copy only;
        then AdamW makes the newest weights in the master alone. ``copy`` False: the half copy took the
        master before (:meth:`to_compute`, after the step's last upload of the stage), so AdamW alone."""
        grads = self.grads_in if grad is None else grad
        if copy:
            self.optimizer.update(grads, lr, grad_factor, skip, self.updated if self.delayed else None)
        elif not skip:
            self.optimizer.step(grads, lr, grad_factor)

    def to_compute(self) -> int:
        """``delayed``: the half copy takes the master (w_{t-1}, what the next step computes with); returns that
        work in CPU updates of parameters (:func:`partition.costs.compute_copy_work`), as the planner counts it."""
        self.optimizer.to_compute()
        return round(self.own * compute_copy_work("fp32" if self.dtype == torch.float32 else "half"))

    def newest(self) -> contextlib.AbstractContextManager:
        """While open, the copy the GPU computes with holds the newest weights (an evaluation; under delayed
        :meth:`FlatAdamW.newest`, otherwise it holds them already). Call with no update in flight."""
        return self.optimizer.newest()

    def compute_weights(self) -> dict[str, torch.Tensor]:
        """What trains as the next step computes it (the half copy), fp32 on the CPU by parameter name:
        under delayed, one update behind :meth:`weights` (a tied end's from the source's copy)."""
        t = self.layout.trainable_numel
        half = self.half[:t].cpu().float()
        out = {}
        for p in self.layout.params:
            if self._is_tied_end(p):
                v = self.tied.source_range(self.tied.source.half).cpu().float()
                out.update({n: v.view(p.shape) for n in p.names})
            elif p.offset < t:
                out.update({n: half[p.offset:p.offset + p.numel].view(p.shape) for n in p.names})
        return out

    def load_compute(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Fill the half copy of what trains (the compute weights of a delayed checkpoint) from fp32
        weights by name (every trainable parameter of the stage, by one of its names; a tied end is the
        source's)."""
        for p in self.layout.params:
            if p.offset < self.own:
                name = next(n for n in p.names if n in weights)
                self.half[p.offset:p.offset + p.numel].copy_(weights[name].reshape(-1))

    def moments(self) -> dict[str, Moments]:
        """AdamW's moments by parameter name, copies in host memory in the rule's storage (so a run can resume
        under any partition or mode; a tied end's are the source's); empty before the first update."""
        if self.optimizer.steps == 0:
            return {}
        mo = self.optimizer.moments
        return {p.names[0]: mo.part(p.offset, p.numel).to("cpu", p.shape)
                for p in self.layout.params if p.offset < self.own}

    def weights(self, frozen: bool = True) -> dict[str, torch.Tensor]:
        """Every parameter by name (``frozen``: else only those that train), in fp32 on the CPU (the master
        for what trains, the half copy for what is frozen; a tied end's, the source's master)."""
        t = self.layout.trainable_numel
        master, half = self.master.cpu(), self.half.cpu() if frozen else None
        out = {}
        for p in self.layout.params:
            if p.offset >= t and not frozen:
                continue
            if self._is_tied_end(p):
                v = self.tied.source_range(self.tied.source.master).cpu().float().view(p.shape)
            else:
                src = master if p.offset < t else half
                v = src[p.offset:p.offset + p.numel].float().view(p.shape)
            out.update({n: v for n in p.names})
        return out

    def load_moments(self, moments: dict[str, Moments], step: int) -> None:
        """Set the AdamW state from moments by parameter name (every parameter of the stage this store
        updates; in another rule's storage, converted)."""
        if not moments:
            return
        for p in self.layout.params:
            if p.offset < self.own:
                self.optimizer.load(moments[p.names[0]], step, offset=p.offset)
