"""A rank's gradient flushes and updates: each chunk's gradient reduce-scattered into its shard when its run of
backward calls ends (:class:`~scheduler.zero.rank_cache.GradBuffers`), an offloaded chunk's CPU AdamW queued on
the optimizer thread, the step's end (the :class:`~mobius.optim.UpdateRule`'s norm, overflow check and factor;
the GPU chunks' fused AdamW on the compute stream), and the event the next pass's gathers wait for.

Without clipping and fp16 (no ``barrier``) an offloaded chunk is updated as soon as its gradient is down, during
the backward; otherwise after the norm, in the downloads' order (delayed) or in forward order (sync).
``train.update: delayed``: an offloaded chunk's copy of the master into its compute copy is queued ahead of every
AdamW as its gradient lands (``ready``); the AdamW sets ``consumed``, which the next download into the chunk's
gradient shard waits for.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from mobius.optim import UpdateRule
from scheduler.dispatch_thread import Background
from scheduler.counters import Counters
from scheduler.zero.chunk_store import ChunkStore
from scheduler.zero.rank_cache import GradBuffers, RCache, Streams
from scheduler.zero.unit_pass import PassState


class ZeroUpdates:
    """Flushes and updates of this rank's shards (``store``); ``runs``: chunk -> its gradient runs in a step;
    ``barrier``: the updates wait for the global norm (clipping or fp16)."""

    def __init__(self, store: ChunkStore, grads: GradBuffers, cache: RCache, streams: Streams, bg: Background,
                 rule: UpdateRule, counters: Counters, runs: dict[int, int], barrier: bool):
        self.store, self.grads, self.cache, self.streams, self.bg = store, grads, cache, streams, bg
        self.rule, self.counters, self.runs, self.barrier = rule, counters, runs, barrier
        self.delayed = store.delayed
        self.updated: torch.cuda.Event | None = None  # the last GPU update (gathers of the next pass wait)

    def take_updated(self) -> "torch.cuda.Event | None":
        """The event the next pass's gathers wait for (once: a pass takes it)."""
        event, self.updated = self.updated, None
        return event

    # ---- gradients ------------------------------------------------------------------------------
    def flush(self, chunk: int, st: PassState) -> None:
        """One gradient run of ``chunk`` ends: reduce-scatter it into this rank's shard; on its last run, an
        offloaded chunk's gradient goes down to its pinned host shard and (delayed: its compute copy, and without
        a barrier: its AdamW) is queued on the optimizer thread."""
        st.flushed[chunk] = st.flushed.get(chunk, 0) + 1
        final = st.flushed[chunk] == self.runs[chunk]
        host = self.store.hosts.get(chunk)
        if host is not None and final:
            if not host.consumed.is_set():  # delayed: the previous AdamW still reads the gradient shard
                host.consumed.wait()
            self.bg.check()
            host.ready.clear()  # its half copy is stale until the CPU update (delayed: until its copy)
            host.consumed.clear()
        target = host.shards.grad if host is not None else self.store.gpu.grad_of(chunk)  # [s] fp32
        done = self.grads.flush(chunk, final, target)
        if host is not None and final:
            self.counters.add(d2h=target.nbytes)
            st.arrived.append((chunk, done))
            if self.delayed:  # what the next step's gathers wait for, ahead of every AdamW (barrier or not)
                self.bg.updater.submit(host.to_compute, done, host.ready, first=True)
            if not self.barrier:  # the factor is 1: update as soon as the gradient is down
                self._queue_update(chunk, done, st.lr, 1.0, False)

    def _queue_update(self, chunk: int, done: object, lr: float, factor: float, skip: bool) -> None:
        """CPU AdamW of an offloaded chunk on the optimizer thread, once its gradient shard is in host
        memory (``done``); its half copy is rewritten in the same pass (delayed: took the master as the gradient
        landed, which set ``ready``); ``consumed`` is set at the job's end."""
        host = self.store.hosts[chunk]

        def update() -> int:
            host.update(lr, factor, skip)
            return 0 if skip else self.store.layout.shard

        self.bg.updater.submit(update, done, host.consumed)

    # ---- the step's end -------------------------------------------------------------------------
    def end_step(self, st: PassState, lr: float, sumsq: float) -> tuple[float, bool]:
        """The step's end from the sum of squares over ranks: the rule's norm, overflow check and factor, the GPU
        update, the offloaded chunks' updates that waited for the norm; rCache forgets every block (the masters
        change). Returns (global norm, skipped)."""
        norm, skipped, factor = self.rule.end(sumsq)
        self.updated = self._update_gpu(lr, factor, skipped)
        if self.barrier:  # the updates waited for the global norm: in forward order, where the next step's
            # gathers wait for them (sync), or in the downloads' order, where only its downloads do (delayed)
            for c, done in (st.arrived if self.delayed else sorted(st.arrived, key=lambda x: x[0])):
                self._queue_update(c, done, lr, factor, skipped)
        self.cache.invalidate()
        return norm, skipped

    def _update_gpu(self, lr: float, factor: float, skip: bool) -> "torch.cuda.Event | None":
        """The GPU chunks' update on the compute stream (``skip``: an fp16 overflow, no AdamW). Returns
        the event the next pass's gathers wait for: the update's end, or under delayed its first part
        (the compute copy has taken the master, w_{t-1}, a skipped step too; the AdamW after it writes the
        master alone)."""
        gpu = self.store.gpu
        gpu.master_to_compute()  # (no compute copy in sync: nothing)
        copied = self.streams.record() if self.delayed else None
        if not skip:
            gpu.step(lr, factor)
        return copied if self.delayed else self.streams.record()

    # ---- evaluation -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def newest(self) -> Iterator[None]:
        """While open, every compute copy holds its master (the newest weights; see Shards.newest) and
        gathers wait for that; afterwards the compute weights are back and rCache forgets the blocks
        gathered meanwhile. Without delayed: nothing to do."""
        if not self.delayed:
            yield
            return
        self.bg.sync()  # every AdamW has written its master
        try:
            with contextlib.ExitStack() as stack:
                for shards in self.store.all_shards():
                    stack.enter_context(shards.newest())
                self.updated = self.streams.record()
                yield
        finally:
            self.updated = self.streams.record()
            self.cache.invalidate()
