"""Flat buffers: where every parameter sits. One layout for both runtimes.

Parameters are placed, in the order the forward uses them, at multiples of :data:`ALIGN` in flat
buffers (*chunks*) of one length; each knows its names (two for a weight tied between the embedding
and the head), shape, the units that use it and whether it takes weight decay. The decay *runs* of
a buffer drive the one AdamW (:class:`~mobius.optim.FlatAdamW`).

* Zero mode (Elixir Appendix A.2) cuts the model into chunks of ``chunk_size`` elements: walk the
  parameters in forward-use order and put each into the current chunk; when it does not fit, close
  the chunk and open a new one. A parameter **used twice** (the embedding tied to the head) is laid
  out once, at its first use; both units list its chunks. A parameter **larger than a chunk** starts
  a fresh chunk and continues over as many consecutive chunks as it needs (the last one stays open);
  its unit needs all of them at once. Every chunk buffer has the same length
  :attr:`ChunkLayout.padded`: the chunk size rounded up so that it splits into ``world`` equal shards
  of a multiple of ``align`` elements (``world`` need not divide the chunk size).
* A pipeline stage is one buffer: the same placement with no chunk limit
  (:func:`single_buffer`).

No torch here: the planner lays out models it never builds.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

ALIGN = 64  # elements: parameter offsets and shard lengths are multiples of this (aligned vector loads and copies)


@dataclass(frozen=True)
class ParamInfo:
    """One parameter as the layout sees it."""

    names: tuple[str, ...]  # mobius state-dict names (two for a tied weight: the embedding's first)
    shape: tuple[int, ...]
    units: tuple[int, ...]  # the units that use it, ascending
    decay: bool  # takes weight decay
    trains: bool = True  # False: frozen (LoRA's base weights): no master, moments or gradient

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class Segment:
    """Elements ``[start, start + numel)`` of parameter ``param`` at ``offset`` in a chunk."""

    param: int
    start: int
    offset: int
    numel: int


@dataclass(frozen=True)
class Chunk:
    index: int
    segments: tuple[Segment, ...]

    @property
    def used(self) -> int:
        """Elements up to the end of the last segment."""
        last = self.segments[-1]
        return last.offset + last.numel


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


@dataclass(frozen=True)
class ChunkLayout:
    """Where every parameter lives: chunks of ``chunk_size`` elements (buffers of ``padded``)."""

    params: tuple[ParamInfo, ...]
    num_units: int
    chunk_size: int
    world: int
    align: int
    chunks: tuple[Chunk, ...]

    @property
    def num_chunks(self) -> int:
        return len(self.chunks)

    @cached_property
    def shard(self) -> int:
        """Elements of one rank's shard of a chunk."""
        return _round_up(-(-self.chunk_size // self.world), self.align)

    @property
    def padded(self) -> int:
        """Length of every chunk buffer (and rCache block): ``world`` shards."""
        return self.shard * self.world

    @cached_property
    def pieces(self) -> tuple[tuple[tuple[int, Segment], ...], ...]:
        """Per parameter: its (chunk, segment) pieces in order (one unless it is larger than a chunk)."""
        out: list[list[tuple[int, Segment]]] = [[] for _ in self.params]
        for ch in self.chunks:
            for seg in ch.segments:
                out[seg.param].append((ch.index, seg))
        return tuple(tuple(p) for p in out)

    @cached_property
    def unit_chunks(self) -> tuple[tuple[int, ...], ...]:
        """Per unit: the chunks its parameters occupy (what must be in rCache while it runs)."""
        sets: list[set[int]] = [set() for _ in range(self.num_units)]
        for i, p in enumerate(self.params):
            for u in p.units:
                sets[u].update(c for c, _ in self.pieces[i])
        return tuple(tuple(sorted(s)) for s in sets)

    @property
    def min_blocks(self) -> int:
        """The fewest rCache blocks that run the model: the most chunks one unit uses (rCache-min)."""
        return max((len(u) for u in self.unit_chunks), default=1)

    @property
    def param_numel(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def waste(self) -> float:
        """Share of the chunk buffers that holds no parameter (alignment, unfilled tails, shard padding)."""
        return 1.0 - self.param_numel / max(1, self.num_chunks * self.padded)

    def trains(self, chunk: int) -> bool:
        """Whether a chunk holds trainable parameters (else frozen ones)."""
        return self.params[self.chunks[chunk].segments[0].param].trains

    def decay_runs(self, chunk: int) -> list[tuple[int, int, bool]]:
        """``(lo, hi, decay)`` runs covering ``[0, used)`` of a chunk: consecutive elements that all
        take weight decay or all do not (alignment gaps join the run before them)."""
        runs: list[list] = []
        segs = self.chunks[chunk].segments
        for k, seg in enumerate(segs):
            hi = segs[k + 1].offset if k + 1 < len(segs) else seg.offset + seg.numel
            decay = self.params[seg.param].decay
            if runs and runs[-1][2] == decay:
                runs[-1][1] = hi
            else:
                runs.append([seg.offset, hi, decay])
        return [(lo, hi, d) for lo, hi, d in runs]

    def shard_runs(self, chunk: int, rank: int) -> list[tuple[int, int, bool]]:
        """The decay runs of ``rank``'s shard of a chunk, in shard coordinates."""
        base, s = rank * self.shard, self.shard
        out = []
        for lo, hi, d in self.decay_runs(chunk):
            a, b = max(lo, base), min(hi, base + s)
            if a < b:
                out.append((a - base, b - base, d))
        return out


def build_layout(params: list[ParamInfo] | tuple[ParamInfo, ...], num_units: int, chunk_size: int, world: int = 1,
                 align: int = ALIGN, frozen_apart: bool = True) -> ChunkLayout:
    """Group ``params`` (in forward-use order) into chunks of ``chunk_size`` elements (module docstring).
    What trains comes first and frozen parameters after, in chunks of their own: a chunk is all
    trainable (master, moments, gradients) or all frozen (one copy in the training dtype), unless not
    ``frozen_apart``."""
    assert chunk_size >= 1 and world >= 1 and align >= 1, (chunk_size, world, align)
    params = tuple([p for p in params if p.trains] + [p for p in params if not p.trains])
    chunks: list[list[Segment]] = [[]]
    pos = 0
    for i, p in enumerate(params):
        n = p.numel
        if frozen_apart and chunks[-1] and not p.trains and params[chunks[-1][-1].param].trains:
            chunks.append([])  # the first frozen parameter opens a chunk
            pos = 0
        if n <= chunk_size:
            start = _round_up(pos, align)
            if chunks[-1] and start + n > chunk_size:
                chunks.append([])
                start = 0
            chunks[-1].append(Segment(i, 0, start, n))
            pos = start + n
            continue
        if chunks[-1]:  # larger than a chunk: over fresh consecutive chunks
            chunks.append([])
        done = 0
        while done < n:
            take = min(chunk_size, n - done)
            chunks[-1].append(Segment(i, done, 0, take))
            done += take
            pos = take
            if done < n:
                chunks.append([])
    built = tuple(Chunk(k, tuple(segs)) for k, segs in enumerate(chunks) if segs)
    return ChunkLayout(tuple(params), num_units, chunk_size, world, align, built)


def single_buffer(params: list[ParamInfo] | tuple[ParamInfo, ...], num_units: int, align: int = ALIGN) -> ChunkLayout:
    """``params`` placed one after another in one buffer (a pipeline stage's flat buffers): what trains
    first, then the frozen ones, each in forward-use order."""
    params = [p for p in params if p.trains] + [p for p in params if not p.trains]
    total = sum(_round_up(p.numel, align) for p in params)
    return build_layout(params, num_units, max(total, 1), 1, align, frozen_apart=False)
