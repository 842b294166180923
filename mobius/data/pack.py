"""Blocks of ``data.seq_len`` positions, made into :class:`~mobius.batch.MicroBatch` rows.

* Text (:class:`TextBlocks`): consecutive blocks of ``seq_len + 1`` tokens running across documents
  (neighbours share one token); every token a target, no document boundaries (``docs=None``).
* Conversations (:class:`ChatBlocks`): a conversation of ``L`` tokens takes ``L - 1`` positions (inputs
  ``t0..t(L-2)``, targets ``t1..t(L-1)`` where those are target tokens, else IGNORE). Packed, a block holds
  whole conversations chosen by best-fit decreasing (:func:`best_fit_decreasing`) and its row lists their
  lengths in ``docs``, the unused tail one more document of padding; unpacked, a row is one conversation
  and padding after it (one causal sequence: ``docs=None``).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass

import numpy as np
import torch

from mobius.batch import IGNORE, MicroBatch
from mobius.data.cache import ChatCache


class TextBlocks:
    """Consecutive blocks of ``seq_len + 1`` tokens (neighbours share one token) over a token array."""

    def __init__(self, tokens: np.ndarray, seq_len: int, start: int = 0, count: int | None = None):
        self.tokens, self.seq_len, self.start = tokens, seq_len, start
        total = (len(tokens) - 1) // seq_len
        self.count = total - start if count is None else count

    def __len__(self) -> int:
        return self.count

    def get(self, indices: np.ndarray) -> MicroBatch:
        """Blocks by index -> inputs [B, T] and targets [B, T] (every token a target), int64; no documents."""
        rows = [np.asarray(self.tokens[(self.start + i) * self.seq_len:(self.start + i + 1) * self.seq_len + 1])
                for i in indices]
        block = torch.from_numpy(np.stack(rows).astype(np.int64))  # [B, T + 1]
        return MicroBatch(block[:, :-1].contiguous(), block[:, 1:].contiguous())


PackedBlocks = TextBlocks  # (its name before conversations)


def best_fit_decreasing(sizes: list[int], capacity: int) -> list[list[int]]:
    """Items (by index) in bins of ``capacity``: the largest first, each into the open bin it fills most
    tightly (the bin with the least room that takes it), a new bin when none takes it. Deterministic; bins in
    the order they were opened, their items in the order they were placed. Every size is in 1..capacity."""
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])  # (stable: equal sizes keep their order)
    rooms: list[int] = []  # the distinct room left in open bins, ascending
    bins_with: dict[int, list[int]] = {}  # room left -> the bins with that room
    bins: list[list[int]] = []
    for i in order:
        size = sizes[i]
        k = bisect_left(rooms, size)
        if k < len(rooms):
            room = rooms[k]
            b = bins_with[room].pop()
            if not bins_with[room]:
                del bins_with[room]
                rooms.pop(k)
        else:
            b, room = len(bins), capacity
            bins.append([])
        bins[b].append(i)
        room -= size
        if room > 0:
            if room not in bins_with:
                insort(rooms, room)
                bins_with[room] = []
            bins_with[room].append(b)
    return bins


@dataclass
class ChatBlocks:
    """Blocks of whole conversations: block ``b`` holds conversations ``cache[members[bounds[b]:bounds[b + 1]]]``,
    each its first ``kept`` tokens (the same position in ``members``)."""

    cache: ChatCache
    members: np.ndarray  # [K] int64 conversation indices, grouped by block
    kept: np.ndarray  # [K] int64 tokens taken of each (<= seq_len + 1)
    bounds: np.ndarray  # [blocks + 1] int64
    seq_len: int
    pad_id: int
    packed: bool  # False: one conversation per row, docs=None

    @classmethod
    def build(cls, cache: ChatCache, index: np.ndarray, kept: np.ndarray, seq_len: int, pad_id: int,
              packed: bool) -> "ChatBlocks":
        """Conversations ``index`` ([K], each its first ``kept`` tokens, [K]) packed into blocks, or one per row."""
        if packed:
            bins = best_fit_decreasing((kept - 1).tolist(), seq_len)
            order = np.array([i for b in bins for i in b], dtype=np.int64)
            bounds = np.concatenate([[0], np.cumsum([len(b) for b in bins])]).astype(np.int64)
        else:
            order, bounds = np.arange(len(index), dtype=np.int64), np.arange(len(index) + 1, dtype=np.int64)
        return cls(cache, index[order], kept[order], bounds, seq_len, pad_id, packed)

    def __len__(self) -> int:
        return len(self.bounds) - 1

    @property
    def positions(self) -> int:
        """Positions the conversations fill (the rest is padding)."""
        return int((self.kept - 1).sum())

    @property
    def fewest(self) -> int:
        """A lower bound on the blocks any packing of these conversations takes: their positions over a block's,
        and one block for each conversation of more than half a block (no two of them share one)."""
        sizes = self.kept - 1
        return max(-(-int(sizes.sum()) // self.seq_len), int((sizes > self.seq_len // 2).sum())) if self.packed \
            else len(self)

    def get(self, indices: np.ndarray) -> MicroBatch:
        """Blocks by index -> inputs [B, T], targets [B, T] (IGNORE off the targets and on padding), int64, and
        docs [B, D] int32 (each row's document lengths, summing to T, then zeros; None unpacked)."""
        T = self.seq_len
        inputs = np.full((len(indices), T), self.pad_id, dtype=np.int64)  # [B, T]
        targets = np.full((len(indices), T), IGNORE, dtype=np.int64)  # [B, T]
        docs: list[list[int]] = []
        for row, b in enumerate(indices):
            at, lengths = 0, []
            for k in range(self.bounds[b], self.bounds[b + 1]):
                start, n = int(self.cache.starts[self.members[k]]), int(self.kept[k])
                ids = np.asarray(self.cache.tokens[start:start + n], dtype=np.int64)  # [n]
                flags = np.asarray(self.cache.targets[start + 1:start + n], dtype=bool)  # [n - 1]
                inputs[row, at:at + n - 1] = ids[:-1]
                targets[row, at:at + n - 1] = np.where(flags, ids[1:], IGNORE)
                at += n - 1
                lengths.append(n - 1)
            assert at <= T, (at, T)
            docs.append(lengths + ([T - at] if at < T else []))
        return MicroBatch(torch.from_numpy(inputs), torch.from_numpy(targets), _docs(docs) if self.packed else None)


def _docs(rows: list[list[int]]) -> torch.Tensor:
    """Rows of document lengths as [B, D] int32, zero-padded to the longest row."""
    out = np.zeros((len(rows), max(map(len, rows))), dtype=np.int32)  # [B, D]
    for r, lengths in enumerate(rows):
        out[r, :len(lengths)] = lengths
    return torch.from_numpy(out)
