"""Where each rank's shards of the chunks live, and their AdamW.

Every rank owns ``1/N`` of every chunk (elements ``[rank x s, (rank + 1) x s)``): the fp32 master,
AdamW's m and v, and the fp32 gradient shard the reduce-scatter fills.

* :class:`Shards` -- those four flat buffers for a set of chunks on one device, and a fused AdamW over
  the chunks' decay runs (weight decay on matrices, none on biases and norms). The GPU chunks of a
  rank share one :class:`Shards` on the GPU, updated in one fused step at the end of the backward.
* :class:`HostChunk` -- one offloaded chunk: its :class:`Shards` in (pinned) host memory, the
  half-precision copy that gathers upload (the CPU master copy: nothing is written back when rCache
  evicts the chunk), and an event set when its CPU update has refreshed that copy.
"""

from __future__ import annotations

import threading

import torch
from torch import nn

from mobius.config import TrainSection
from mobius.optim import adamw, set_lr
from partition.zero import ChunkLayout
from scheduler.pinned import host_zeros


class Shards:
    """This rank's shards of ``chunks``: fp32 master, gradient and AdamW, one flat buffer each."""

    def __init__(self, layout: ChunkLayout, chunks: list[int], rank: int, device: torch.device, cfg: TrainSection,
                 pin_master: bool = False, pin_grad: bool = False):
        s = layout.shard
        self.layout, self.chunks, self.rank = layout, list(chunks), rank
        self.base = {c: i * s for i, c in enumerate(chunks)}
        self.master = self._buffer(len(chunks) * s, device, pin_master)  # [chunks * s]
        self.grad = self._buffer(len(chunks) * s, device, pin_grad)  # [chunks * s]
        self.runs: dict[int, list[tuple[int, nn.Parameter]]] = {c: [] for c in chunks}  # chunk -> (shard lo, param)
        decay: list[nn.Parameter] = []
        no_decay: list[nn.Parameter] = []
        for c in chunks:
            b = self.base[c]
            for lo, hi, d in layout.shard_runs(c, rank):
                p = nn.Parameter(self.master[b + lo:b + hi])
                p.grad = self.grad[b + lo:b + hi]
                (decay if d else no_decay).append(p)
                self.runs[c].append((lo, p))
        self.optimizer = adamw(decay, no_decay, cfg, fused=True) if decay or no_decay else None

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
        """AdamW with gradient x ``factor`` (clipping, loss-scale removal)."""
        if self.optimizer is None:
            return
        if factor != 1.0:
            self.grad.mul_(factor)
        set_lr(self.optimizer, lr)
        self.optimizer.step()

    def moments_of(self, chunk: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """AdamW (m, v) of a chunk's shard as two flat vectors; None before the first update."""
        s, out = self.layout.shard, None
        for lo, p in self.runs[chunk]:
            st = self.optimizer.state.get(p) if self.optimizer else None
            if not st:
                continue
            if out is None:
                out = (torch.zeros(s, device=p.device), torch.zeros(s, device=p.device))
            out[0][lo:lo + p.numel()] = st["exp_avg"]
            out[1][lo:lo + p.numel()] = st["exp_avg_sq"]
        return out

    def load_moments_of(self, chunk: int, m: torch.Tensor, v: torch.Tensor, step: int) -> None:
        """Set the AdamW state of a chunk's shard from two flat vectors (``step`` updates taken)."""
        for lo, p in self.runs[chunk]:
            n = p.numel()
            self.optimizer.state[p] = {"step": torch.tensor(float(step), dtype=torch.float32, device=p.device),
                                       "exp_avg": m[lo:lo + n].to(p.device).clone(),
                                       "exp_avg_sq": v[lo:lo + n].to(p.device).clone()}


class HostChunk:
    """An offloaded chunk's shard in host memory, with the half-precision copy gathers upload."""

    def __init__(self, layout: ChunkLayout, chunk: int, rank: int, dtype: torch.dtype, cfg: TrainSection, pin: bool):
        full = dtype == torch.float32  # fp32: gathers upload the master itself
        self.shards = Shards(layout, [chunk], rank, torch.device("cpu"), cfg, pin_master=pin and full, pin_grad=pin)
        self.half = self.shards.master if full else host_zeros(layout.shard, dtype, pin, self)
        self.ready = threading.Event()  # the half copy holds the current weights (no CPU update pending)
        self.ready.set()

    def refresh_half(self) -> None:
        if self.half is not self.shards.master:
            self.half.copy_(self.shards.master)

    def update(self, lr: float, factor: float) -> None:
        """CPU AdamW on the master shard, then the half copy the next gather uploads."""
        self.shards.step(lr, factor)
        self.refresh_half()
