"""Where this rank's shard of every chunk lives, how it is first filled, and what a gather reads from it.

The first ``gpu_chunks`` chunks on the GPU (one :class:`~scheduler.zero.shards.Shards`), the trainable rest
offloaded (a :class:`~scheduler.zero.shards.HostChunk` each), a frozen chunk (LoRA's base weights) only its
shard in the training dtype, on the GPU or in host memory. Rank ``r`` holds elements ``[r*s, (r+1)*s)`` of
every chunk (``s = P/N``).
"""

from __future__ import annotations

from typing import Callable

import torch

from mobius.assemble import WeightSource
from mobius.config import TrainSection
from mobius.errors import CheckpointError
from mobius.layout import ChunkLayout
from mobius.models import ModelConfig
from partition.costs import host_bytes_per_param
from scheduler.counters import Counters
from scheduler.pinned import host_zeros
from scheduler.stage_store import check_host_memory
from scheduler.zero.shards import HostChunk, Shards


class ChunkStore:
    """This rank's shards of the chunks of ``layout``: ``gpu`` (the GPU chunks' :class:`Shards`), ``hosts``
    (chunk -> :class:`HostChunk`), ``frozen`` (chunk -> its shard in ``dtype``). ``check`` raises a failed
    background job (called while a gather waits for a CPU update)."""

    def __init__(self, layout: ChunkLayout, gpu_chunks: int, rank: int, dtype: torch.dtype, train: TrainSection,
                 delayed: bool, device: torch.device, counters: Counters, check: Callable[[], None]):
        self.layout, self.rank, self.dtype, self.delayed = layout, rank, dtype, delayed
        self.gpu_chunks, self.counters, self.check = gpu_chunks, counters, check
        lay, s = layout, layout.shard
        n, g = lay.num_chunks, min(gpu_chunks, lay.num_chunks)
        trainable = [c for c in range(n) if lay.trains(c)]
        offloaded = [c for c in range(g, n) if lay.trains(c)]
        per = host_bytes_per_param(train.precision, False, delayed,  # as a swapped pipeline stage's
                                   train.optimizer_states)
        frozen_host = sum(1 for c in range(g, n) if not lay.trains(c)) * s * dtype.itemsize
        check_host_memory(round(len(offloaded) * s * per) + frozen_host, f"zero rank {rank}'s offloaded chunks")
        self.gpu = Shards(lay, [c for c in trainable if c < g], rank, device, train,
                          compute=dtype if delayed else None)
        pin = device.type == "cuda"
        self.hosts = {c: HostChunk(lay, c, rank, dtype, train, pin, delayed) for c in offloaded}
        self.frozen = {c: (torch.zeros(s, dtype=dtype, device=device) if c < g else host_zeros(s, dtype, pin, self))
                       for c in range(n) if not lay.trains(c)}  # [s] each

    def segments(self, chunk: int) -> list[tuple[int, int, int, int]]:
        """(param, start in the param, start in my shard, length) of what my shard of ``chunk`` holds."""
        s = self.layout.shard
        lo, hi = self.rank * s, (self.rank + 1) * s
        out = []
        for seg in self.layout.chunks[chunk].segments:
            a, b = max(seg.offset, lo), min(seg.offset + seg.numel, hi)
            if a < b:
                out.append((seg.param, seg.start + a - seg.offset, a - lo, b - a))
        return out

    def shards_of(self, chunk: int) -> Shards:
        """The :class:`Shards` holding a trainable chunk: its :class:`HostChunk`'s, or the GPU ones."""
        return self.hosts[chunk].shards if chunk in self.hosts else self.gpu

    def all_shards(self) -> list[Shards]:
        """Every :class:`Shards` of this rank: the GPU chunks', then each offloaded chunk's."""
        return [self.gpu, *(h.shards for h in self.hosts.values())]

    def load_weights(self, source: WeightSource, model_cfg: ModelConfig) -> None:
        """Fill this rank's master shards (and frozen shards) from ``source`` (only the tensors they need); the
        compute and half copies take the masters."""
        needed = {p for c in range(self.layout.num_chunks) for p, *_ in self.segments(c)}
        names = {self.layout.params[p].names[0] for p in needed}
        weights = source.load(model_cfg, names, {self.layout.params[p].units[0] for p in needed})
        missing = names - set(weights)
        if missing:
            raise CheckpointError(f"{source.base}: no weights for {sorted(missing)[:3]}")
        for c in range(self.layout.num_chunks):
            dst = self.frozen[c] if c in self.frozen else self.shards_of(c).master_of(c)
            for p, start, at, n in self.segments(c):
                flat = weights[self.layout.params[p].names[0]].reshape(-1)
                dst[at:at + n].copy_(flat[start:start + n])
        self.gpu.master_to_compute()  # delayed: the first two steps compute with w_0
        for host in self.hosts.values():
            host.refresh_half()

    def fill(self, chunk: int, mine: torch.Tensor) -> None:
        """This rank's slice ``mine`` [s] of a gathered chunk: the GPU master shard cast to the compute dtype
        (under delayed its compute copy), or the offloaded chunk's half copy uploaded once its CPU update has
        written it (delayed: once the update has copied the master into it)."""
        if chunk in self.frozen:  # LoRA's base weights: their one copy, uploaded when it lives on the host
            src = self.frozen[chunk]
            mine.copy_(src, non_blocking=True)
            if chunk >= self.gpu_chunks:  # offloaded
                self.counters.add(h2d=mine.nbytes)
            return
        host = self.hosts.get(chunk)
        if host is None:
            mine.copy_(self.gpu.compute_of(chunk) if self.delayed else self.gpu.master_of(chunk))
            return
        while not host.ready.wait(0.1):
            self.check()  # an update that failed before its copy (delayed) would leave the gather waiting
        mine.copy_(host.half, non_blocking=True)
        self.counters.add(h2d=mine.nbytes)
