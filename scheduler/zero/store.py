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
"""

from __future__ import annotations

import threading

import torch

from mobius.config import TrainSection
from mobius.optim import FlatAdamW
from mobius.layout import ChunkLayout
from scheduler.pinned import host_zeros


class Shards:
    """This rank's shards of ``chunks``: fp32 master and gradient, one flat buffer each, and a
    :class:`~mobius.optim.FlatAdamW` over the chunks' decay runs (its moments beside the master)."""

    def __init__(self, layout: ChunkLayout, chunks: list[int], rank: int, device: torch.device, cfg: TrainSection,
                 half: torch.Tensor | None = None, pin_master: bool = False, pin_grad: bool = False):
        s = layout.shard
        self.layout, self.chunks, self.rank = layout, list(chunks), rank
        self.base = {c: i * s for i, c in enumerate(chunks)}
        self.master = self._buffer(len(chunks) * s, device, pin_master)  # [chunks * s]
        self.grad = self._buffer(len(chunks) * s, device, pin_grad)  # [chunks * s]
        runs = [(self.base[c] + lo, self.base[c] + hi, d) for c in chunks for lo, hi, d in layout.shard_runs(c, rank)]
        self.optimizer = FlatAdamW(self.master, half, runs, cfg)

    def _buffer(self, numel: int, device: torch.device, pin: bool) -> torch.Tensor:
        """Zeros on ``device``; in host memory page-locked at the exact size when ``pin``."""
        if device.type == "cpu":
            return host_zeros(numel, torch.float32, pin, self)
        return torch.zeros(numel, device=device)

    def master_of(self, chunk: int) -> torch.Tensor:
        b = self.base[chunk]
        return self.master[b:b + self.layout.shard]

    def grad_of(self, chunk: int) -> torch.Tensor:
        b = self.base[chunk]
        return self.grad[b:b + self.layout.shard]

    def step(self, lr: float, factor: float) -> None:
        """AdamW with gradient x ``factor`` (clipping, loss-scale removal), folded into the kernel."""
        if self.chunks:
            self.optimizer.step(self.grad, lr, factor)

    def moments_of(self, chunk: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """AdamW (m, v) of a chunk's shard as two flat vectors; None before the first update."""
        if self.optimizer.steps == 0:
            return None
        b, s = self.base[chunk], self.layout.shard
        return self.optimizer.m[b:b + s], self.optimizer.v[b:b + s]

    def load_moments_of(self, chunk: int, m: torch.Tensor, v: torch.Tensor, step: int) -> None:
        """Set the AdamW state of a chunk's shard from two flat vectors (``step`` updates taken)."""
        self.optimizer.load(m.to(self.master.device), v.to(self.master.device), step, self.base[chunk])


class HostChunk:
    """An offloaded chunk's shard in host memory, with the half-precision copy gathers upload."""

    def __init__(self, layout: ChunkLayout, chunk: int, rank: int, dtype: torch.dtype, cfg: TrainSection, pin: bool):
        full = dtype == torch.float32  # fp32: gathers upload the master itself
        half = None if full else host_zeros(layout.shard, dtype, pin, self)
        self.shards = Shards(layout, [chunk], rank, torch.device("cpu"), cfg, half, pin_master=pin and full,
                             pin_grad=pin)
        self.half = self.shards.master if full else half
        self.ready = threading.Event()  # the half copy holds the current weights (no CPU update pending)
        self.ready.set()

    def refresh_half(self) -> None:
        if self.half is not self.shards.master:
            self.half.copy_(self.shards.master)

    def update(self, lr: float, factor: float) -> None:
        """CPU AdamW on the master shard, writing the half copy the next gather uploads in the same pass."""
        self.shards.step(lr, factor)
