"""rCache on one rank, and the gradient buffers whose reduce-scatter fills the owners' shards.

Streams and collectives (see README.md for who owns which buffer):

* everything is issued by the dispatch thread (the engine's caller), in program order, on one
  collective group -- the same order on every rank, since replacement depends on the trace alone;
* a **gather** fills this rank's slice of a block on the gather stream (a cast of the GPU master
  shard, or an upload of an offloaded chunk's half-precision copy once its CPU update is done) and
  all-gathers the block; the compute stream waits for it before reading the block;
* operator ``t`` is enqueued first, then the gathers of operator ``t + 1`` (prefetch), so on a GPU a
  wait for a CPU update holds only the host while the GPU computes; a block is overwritten only after
  the compute that last read it (an event per operator);
* a chunk's gradient is reduce-scattered on the reduce stream once its run of backward calls ends.

On CPU worker processes (gloo) the streams are absent and copies synchronous; all-gathers are
asynchronous (gloo's threads) and waited for before use.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import torch

from mobius.layout import ChunkLayout
from partition.zero import CachePolicy
from scheduler.collectives import all_gather_flat, reduce_scatter_flat
from scheduler.counters import Counters


class Streams:
    """The compute stream's side streams on a GPU; every method is a no-op on the CPU."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.gather = torch.cuda.Stream(device) if self.cuda else None
        self.reduce = torch.cuda.Stream(device) if self.cuda else None

    def on(self, stream: Any) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream) if self.cuda else contextlib.nullcontext()

    def record(self, stream: Any = None) -> "torch.cuda.Event | None":
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(stream or torch.cuda.current_stream(self.device))
        return event

    def wait(self, event: "torch.cuda.Event | None", stream: Any = None) -> None:
        if event is not None:
            (stream or torch.cuda.current_stream(self.device)).wait_event(event)


@dataclass
class _Held:
    """A tensor autograd saved that lives in an rCache block: found again by chunk after the chunk moves."""

    chunk: int
    offset: int  # in the chunk
    size: tuple[int, ...]
    stride: tuple[int, ...]


class RCache:
    """``n_block`` blocks of one padded chunk each; replacement by :class:`~partition.zero.CachePolicy`."""

    def __init__(self, layout: ChunkLayout, n_block: int, dtype: torch.dtype, rank: int, world: int,
                 group: Any, streams: Streams, fill: Callable[[int, torch.Tensor], None], prefetch: bool,
                 counters: Counters):
        self.layout, self.rank, self.world, self.group = layout, rank, world, group
        self.counters = counters
        self.streams, self.fill, self.prefetching = streams, fill, prefetch
        self.blocks = torch.zeros(n_block, layout.padded, dtype=dtype, device=streams.device)  # [n_block, P]
        # gathers write through an alias with its own autograd version counter: they refill blocks that no
        # pending backward reads directly (saved block tensors are packed by chunk), so autograd's
        # in-place checks on the compute side must not count them
        self._gathering = self.blocks.data
        self._storage = self.blocks.untyped_storage().data_ptr()
        self.policy = CachePolicy(n_block)
        self.traces: dict[str, list[tuple[int, ...]]] = {}
        self.key = ""
        self.free_after: list[torch.cuda.Event | None] = [None] * n_block  # the last compute that read a block
        self.pending: dict[int, tuple[Any, Any]] = {}  # chunk -> (all-gather work, fill event)
        self.gathered: list[int] = []  # chunks gathered this pass (counters)

    # ---- passes ---------------------------------------------------------------------------------
    def begin(self, key: str, after: "torch.cuda.Event | None" = None) -> None:
        """Start a pass of program ``key``: Belady from its recorded trace, or record it now. Gathers
        of this pass start after ``after`` (the last update of the master shards)."""
        self.key = key
        self.gathered = []
        self.policy.begin(self.traces.get(key))
        self.streams.wait(after, self.streams.gather)

    def end(self) -> None:
        assert not self.pending, sorted(self.pending)
        recorded = self.policy.end()
        if recorded is not None:
            self.traces[self.key] = recorded

    def invalidate(self) -> None:
        """The master shards change: no block holds current parameters any more."""
        self.policy.invalidate()

    # ---- operators ------------------------------------------------------------------------------
    def acquire(self, chunks: tuple[int, ...]) -> None:
        """Make ``chunks`` resident for the current operator; the compute stream waits for their
        gathers (the host only on the CPU)."""
        for c, b in self.policy.need(chunks):
            self._gather(c, b)
        for c in chunks:
            work, done = self.pending.pop(c, (None, None))
            if work is not None:
                work.wait()
            self.streams.wait(done)

    def release(self, chunks: tuple[int, ...]) -> None:
        """The current operator's compute is enqueued: its blocks may be refilled after it; start the
        next operator's gathers (prefetch)."""
        event = self.streams.record()
        for c in chunks:
            self.free_after[self.policy.where[c]] = event
        if self.prefetching:
            for c, b in self.policy.prefetch():
                self._gather(c, b)
        self.policy.done()

    def view(self, chunk: int) -> torch.Tensor:
        """The block holding ``chunk`` (resident), [P]."""
        return self.blocks[self.policy.where[chunk]]

    def _gather(self, chunk: int, block: int) -> None:
        """Fill this rank's slice of the block, then all-gather the block (both asynchronous)."""
        s = self.layout.shard
        buf = self._gathering[block]
        mine = buf[self.rank * s:(self.rank + 1) * s]
        self.gathered.append(chunk)
        with self.streams.on(self.streams.gather):
            self.streams.wait(self.free_after[block], self.streams.gather)
            self.fill(chunk, mine)
            work = None
            if self.world > 1:
                work = all_gather_flat(buf, mine, self.group, async_op=True)
                self.counters.add(allgather=(self.world - 1) * mine.nbytes)  # the other ranks' slices
            self.counters.add(replaced=buf.nbytes)
            self.pending[chunk] = (work, self.streams.record(self.streams.gather))

    # ---- autograd's saved tensors (no activation checkpointing) ----------------------------------
    def pack(self, t: torch.Tensor) -> Any:
        """A saved tensor in a block is kept as (chunk, offset, shape): its block may be reused before
        the backward, which finds the chunk wherever it is then."""
        if t.device != self.blocks.device or t.untyped_storage().data_ptr() != self._storage:
            return t
        P = self.layout.padded
        block, offset = divmod(t.storage_offset(), P)
        return _Held(self.policy.holder[block], offset, tuple(t.size()), tuple(t.stride()))

    def unpack(self, held: Any) -> torch.Tensor:
        if not isinstance(held, _Held):
            return held
        P = self.layout.padded
        base = self.policy.where[held.chunk] * P + held.offset
        return self.blocks.view(-1).as_strided(held.size, held.stride, base)


class GradBuffers:
    """fp32 gradients of the chunks in backward use (at most ``limit`` buffers of one padded chunk),
    reduce-scattered into the owners' shards when a chunk's run of backward calls ends."""

    def __init__(self, layout: ChunkLayout, limit: int, rank: int, world: int, group: Any, streams: Streams,
                 counters: Counters):
        self.layout, self.limit, self.rank, self.world, self.group = layout, limit, rank, world, group
        self.streams, self.counters = streams, counters
        self.free: list[tuple[torch.Tensor, Any]] = []  # (buffer, event after which it may be reused)
        self.count = 0
        self.live: dict[int, torch.Tensor] = {}
        self.partial: dict[int, torch.Tensor] = {}  # reduced shard of a chunk flushed more than once
        self.sumsq: list[torch.Tensor] = []  # per finished chunk shard, on the device

    def get(self, chunk: int) -> torch.Tensor:
        """The chunk's gradient buffer [P] (a zeroed one on its first call this run)."""
        if chunk in self.live:
            return self.live[chunk]
        if self.count < self.limit:  # a fresh buffer while allowed: no wait for an earlier reduction
            buf = torch.zeros(self.layout.padded, device=self.streams.device)  # [P] fp32
            self.count += 1
        else:
            buf, ready = self.free.pop(0)  # the oldest
            self.streams.wait(ready)
            buf.zero_()
        self.live[chunk] = buf
        return buf

    def flush(self, chunk: int, final: bool, target: torch.Tensor) -> "torch.cuda.Event | None":
        """Reduce-scatter the chunk's gradient (the sum over ranks) into this rank's shard; ``final``:
        its last run this step -- write the shard (summed with earlier runs) into ``target`` (the GPU
        gradient shard, or the pinned host one) and count its squares. Returns the write's event."""
        buf = self.live.pop(chunk)
        ready = self.streams.record()
        with self.streams.on(self.streams.reduce):
            self.streams.wait(ready, self.streams.reduce)
            if self.world > 1:
                out = torch.empty(self.layout.shard, device=buf.device)  # [s]
                reduce_scatter_flat(out, buf, self.group)
                self.counters.add(reduce_scatter=(self.world - 1) * out.nbytes)  # the others' parts of my shard
            else:
                out = buf
            if chunk in self.partial:
                out = self.partial.pop(chunk).add_(out)
            if not final:
                self.partial[chunk] = out.clone() if out is buf else out
            else:
                self.sumsq.append(torch.dot(out, out))
                target.copy_(out, non_blocking=True)
            done = self.streams.record(self.streams.reduce)
        self.free.append((buf, done))
        return done

    def take_sumsq(self) -> float:
        """Sum of squares of this step's finished gradient shards (waits for the reductions)."""
        if self.streams.cuda:
            self.streams.reduce.synchronize()
        total = float(torch.stack(self.sumsq).sum()) if self.sumsq else 0.0
        self.sumsq = []
        return total
