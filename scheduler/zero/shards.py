"""Where each rank's shards of the chunks live, and their AdamW.

Every rank owns ``1/N`` of every chunk (elements ``[rank x s, (rank + 1) x s)``): the fp32 master,
AdamW's m and v, and the fp32 gradient shard the reduce-scatter fills.

* :class:`Shards` -- those four flat buffers for a set of chunks on one device, and the one
  :class:`~mobius.optim.FlatAdamW` over the chunks' decay runs (weight decay on matrices, none on
  biases and norms). The GPU chunks of a rank share one :class:`Shards` on the GPU, updated in one
  fused step at the end of the backward.
* :class:`HostChunk` -- one offloaded chunk: its :class:`Shards` in (pinned) host memory, the
  half-precision copy that gathers upload (the CPU master copy: nothing is written back when rCache
  evicts the chunk; the update writes it in the same pass), and an event set when its CPU update
  has refreshed that copy.

``train.update: delayed``: what gathers read is a *compute copy*, one update behind the master: on
the GPU a copy of the GPU chunks' shards in the training dtype (:attr:`Shards.compute`; the gather
casts to it anyway, so storing it there is exact), on the host the half copy (a separate pinned fp32
copy in fp32 training). An update first copies the master (w_{t-1}) into it -- an fp16-skipped step
too -- then runs AdamW on the master alone; an offloaded chunk's gathers wait for that copy only
(``ready``), the next download of its gradient for the AdamW to have read the gradient shard
(``consumed``).
"""

from __future__ import annotations

import contextlib
import threading

import torch

from mobius.config import TrainSection
from mobius.optim import FlatAdamW
from mobius.states import Moments
from mobius.layout import ChunkLayout
from partition.costs import compute_copy_work
from scheduler.pinned import host_zeros


class Shards:
    """This rank's shards of ``chunks``: fp32 master and gradient, one flat buffer each, and a
    :class:`~mobius.optim.FlatAdamW` over the chunks' decay runs (its moments beside the master).

    ``compute`` (train.update=delayed): also a compute copy in that dtype, which gathers read and the
    AdamW's :meth:`~mobius.optim.FlatAdamW.to_compute` refreshes before each update (pinned on the host
    with ``pin_compute``); ``half`` (sync) is a copy the AdamW itself rewrites."""

    def __init__(self, layout: ChunkLayout, chunks: list[int], rank: int, device: torch.device, cfg: TrainSection,
                 half: torch.Tensor | None = None, pin_master: bool = False, pin_grad: bool = False,
                 compute: torch.dtype | None = None, pin_compute: bool = False):
        s = layout.shard
        self.layout, self.chunks, self.rank = layout, list(chunks), rank
        self.base = {c: i * s for i, c in enumerate(chunks)}
        self.master = self._buffer(len(chunks) * s, device, pin_master)  # [chunks * s]
        self.grad = self._buffer(len(chunks) * s, device, pin_grad)  # [chunks * s]
        self.compute = None if compute is None else self._buffer(len(chunks) * s, device, pin_compute,
                                                                 compute)  # [chunks * s]
        runs = [(self.base[c] + lo, self.base[c] + hi, d) for c in chunks for lo, hi, d in layout.shard_runs(c, rank)]
        self.optimizer = FlatAdamW(self.master, half, runs, cfg, compute=self.compute,
                                   origins=[o for c in chunks for o in self._origins(c)])

    def _origins(self, chunk: int) -> list[tuple[int, int]]:
        """(index in these buffers, position in its parameter) of each parameter's first element in this rank's shard
        of ``chunk`` (where a parameter starts in it, or continues from the shard or chunk before)."""
        s, base = self.layout.shard, self.rank * self.layout.shard
        out = []
        for seg in self.layout.chunks[chunk].segments:
            a = max(seg.offset, base)
            if a < min(seg.offset + seg.numel, base + s):
                out.append((self.base[chunk] + a - base, seg.start + a - seg.offset))
        return out

    def _buffer(self, numel: int, device: torch.device, pin: bool, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Zeros on ``device``; in host memory page-locked at the exact size when ``pin``."""
        if device.type == "cpu":
            return host_zeros(numel, dtype, pin, self)
        return torch.zeros(numel, dtype=dtype, device=device)

    def master_of(self, chunk: int) -> torch.Tensor:
        b = self.base[chunk]
        return self.master[b:b + self.layout.shard]

    def grad_of(self, chunk: int) -> torch.Tensor:
        b = self.base[chunk]
        return self.grad[b:b + self.layout.shard]

    def compute_of(self, chunk: int) -> torch.Tensor:
        """The chunk's compute copy (train.update=delayed: what its gathers read)."""
        assert self.compute is not None
        b = self.base[chunk]
        return self.compute[b:b + self.layout.shard]

    def master_to_compute(self) -> None:
        """The first part of a delayed update (and of loading weights): the compute copy takes the
        master (w_{t-1}, what the next step computes with); no compute copy: nothing."""
        self.optimizer.to_compute()

    def newest(self) -> contextlib.AbstractContextManager:
        """While open, the compute copy holds the master (the newest weights: an evaluation;
        :meth:`~mobius.optim.FlatAdamW.newest`). Call with no update in flight."""
        return self.optimizer.newest()

    def step(self, lr: float, factor: float) -> None:
        """AdamW with gradient x ``factor`` (clipping, loss-scale removal), folded into the kernel."""
        if self.chunks:
            self.optimizer.step(self.grad, lr, factor)

    def update(self, lr: float, factor: float, skip: bool, copied: threading.Event | None) -> None:
        """:meth:`FlatAdamW.update` of the shard (no chunks: the compute copy only)."""
        self.optimizer.update(self.grad, lr, factor, skip or not self.chunks, copied)

    def moments_of(self, chunk: int) -> Moments | None:
        """AdamW's moments of a chunk's shard (a view, in the rule's storage); None before the first update."""
        if self.optimizer.steps == 0:
            return None
        return self.optimizer.moments.part(self.base[chunk], self.layout.shard)

    def load_moments_of(self, chunk: int, moments: Moments, step: int, at: int = 0) -> None:
        """Set the AdamW state of elements ``[at, at + moments.numel)`` of a chunk's shard (``step`` updates
        taken)."""
        self.optimizer.load(moments, step, self.base[chunk] + at)


class HostChunk:
    """An offloaded chunk's shard in host memory, with the half-precision copy gathers upload (under
    ``delayed`` the compute copy: :attr:`Shards.compute`, fp32 too in fp32 training)."""

    def __init__(self, layout: ChunkLayout, chunk: int, rank: int, dtype: torch.dtype, cfg: TrainSection, pin: bool,
                 delayed: bool = False):
        self.delayed = delayed
        shared = dtype == torch.float32 and not delayed  # fp32 (sync): gathers upload the master itself
        half = None if shared or delayed else host_zeros(layout.shard, dtype, pin, self)
        self.shards = Shards(layout, [chunk], rank, torch.device("cpu"), cfg, half, pin_master=pin and shared,
                             pin_grad=pin, compute=dtype if delayed else None, pin_compute=pin)
        self.half = self.shards.master if shared else self.shards.compute if delayed else half
        self.ready = threading.Event()  # the half copy holds what the next gather must upload (no copy pending)
        self.ready.set()
        # set when the last update has read the gradient shard (the next download may overwrite it): under
        # delayed when its AdamW ends, after `ready`; otherwise the same moment, the same event
        self.consumed = threading.Event() if delayed else self.ready
        self.consumed.set()

    def refresh_half(self) -> None:
        if self.half is not self.shards.master:
            self.half.copy_(self.shards.master)

    def to_compute(self) -> int:
        """``delayed``: the half copy takes the master (w_{t-1}, what the next step's gathers upload; a skipped
        step too), as the chunk's gradient lands and ahead of every AdamW (the optimizer thread then sets
        ``ready``); returns that work in CPU updates of parameters (:func:`partition.costs.compute_copy_work`)."""
        self.shards.master_to_compute()
        precision = "fp32" if self.half.dtype == torch.float32 else "half"  # the compute copy's
        return round(self.shards.master.numel() * compute_copy_work(precision))

    def update(self, lr: float, factor: float, skip: bool = False) -> None:
        """CPU AdamW on the master shard, writing the half copy the next gather uploads in the same pass;
        ``skip`` (an fp16 overflow): none. ``delayed``: AdamW makes the newest weights in the master alone, the
        half copy having taken the master before (:meth:`to_compute`); the optimizer thread sets ``consumed``
        at the end."""
        if not self.delayed:
            self.shards.update(lr, factor, skip, None)
        elif not skip:
            self.shards.step(lr, factor)
