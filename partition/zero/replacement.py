"""rCache replacement: which chunks the ``n_block`` blocks hold, decided the same way by the planner's
simulation and by the runtime (one class for both, so predicted and actual traffic agree).

* With a known call trace (the chunk sets of one step's operators, recorded on a warm-up step):
  **Belady's** rule -- evict the chunk whose next call is farthest away (never again this pass first,
  then the least recently used among equals) -- and **prefetch**: while operator ``t`` runs, gather
  what operator ``t + 1`` calls into free blocks or blocks whose chunks neither ``t`` nor ``t + 1`` use.
* While recording (the warm-up step): least-recently-used replacement, no prefetch.

Decisions depend only on the trace and the block count, so every rank makes the same ones and the
collectives that follow them line up.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field


class CacheTooSmall(ValueError):
    """An operator calls more chunks than rCache has blocks."""


class CachePolicy:
    """The residency of ``n_block`` blocks, pass by pass (a pass: one step's operators)."""

    def __init__(self, n_block: int):
        assert n_block >= 1, n_block
        self.n_block = n_block
        self.holder: list[int | None] = [None] * n_block
        self.where: dict[int, int] = {}
        self.last_use: dict[int, int] = {}
        self.clock = 0
        self.t = 0
        self.trace: list[tuple[int, ...]] | None = None
        self.recorded: list[tuple[int, ...]] | None = None
        self._uses: dict[int, list[int]] = {}

    # ---- passes ---------------------------------------------------------------------------------
    def begin(self, trace: list[tuple[int, ...]] | None) -> None:
        """Start a pass: Belady's rule from ``trace``, or record the calls (LRU, no prefetch)."""
        self.t = 0
        self.trace = [tuple(s) for s in trace] if trace is not None else None
        self.recorded = None if trace is not None else []
        self._uses = {}
        for t, chunks in enumerate(self.trace or []):
            for c in chunks:
                self._uses.setdefault(c, []).append(t)

    def end(self) -> list[tuple[int, ...]] | None:
        """Finish the pass; returns the recorded trace (None when the pass followed a known one)."""
        recorded, self.recorded = self.recorded, None
        return recorded

    def invalidate(self) -> None:
        """Forget every block's content (the parameters changed)."""
        self.holder = [None] * self.n_block
        self.where.clear()

    # ---- one operator ---------------------------------------------------------------------------
    def need(self, chunks: tuple[int, ...]) -> list[tuple[int, int]]:
        """The current operator calls ``chunks``: the (chunk, block) gathers to start now."""
        chunks = tuple(chunks)
        if self.trace is not None and (self.t >= len(self.trace) or self.trace[self.t] != chunks):
            raise ValueError(f"operator {self.t} calls chunks {chunks}, not the recorded "
                             f"{self.trace[self.t] if self.t < len(self.trace) else 'end of the pass'}")
        if self.recorded is not None:
            self.recorded.append(chunks)
        if len(set(chunks)) > self.n_block:
            raise CacheTooSmall(f"an operator calls {len(set(chunks))} chunks but rCache has {self.n_block} blocks")
        moves = [(c, self._place(c, set(chunks))) for c in chunks if c not in self.where]
        self.clock += 1
        for c in chunks:
            self.last_use[c] = self.clock
        return moves

    def prefetch(self) -> list[tuple[int, int]]:
        """Gathers to start for the next operator without evicting anything in use (known trace only)."""
        if self.trace is None or self.t + 1 >= len(self.trace):
            return []
        protect = set(self.trace[self.t]) | set(self.trace[self.t + 1])
        moves = []
        for c in self.trace[self.t + 1]:
            if c in self.where:
                continue
            b = self._place(c, protect, required=False)
            if b is None:
                break
            moves.append((c, b))
        return moves

    def done(self) -> None:
        """The current operator has been issued; move to the next."""
        self.t += 1

    # ---- replacement ----------------------------------------------------------------------------
    def next_use(self, chunk: int) -> float:
        """Index of the chunk's next call after the current operator in this pass (inf: none)."""
        uses = self._uses.get(chunk, [])
        k = bisect.bisect_right(uses, self.t)
        return uses[k] if k < len(uses) else math.inf

    def _place(self, chunk: int, protect: set[int], required: bool = True) -> int | None:
        free = [b for b, h in enumerate(self.holder) if h is None]
        if free:
            b = free[0]
        else:
            candidates = [b for b, h in enumerate(self.holder) if h not in protect]
            if not candidates:
                if required:
                    raise CacheTooSmall(f"no block to evict among {self.n_block}")
                return None
            if self.trace is not None:  # Belady: farthest next call; least recently used among equals
                b = max(candidates, key=lambda b: (self.next_use(self.holder[b]), -self.last_use[self.holder[b]]))
            else:
                b = min(candidates, key=lambda b: self.last_use[self.holder[b]])
            del self.where[self.holder[b]]
        self.holder[b] = chunk
        self.where[chunk] = b
        return b


@dataclass
class CacheRun:
    """What one pass over a trace gathers: per operator, the demand gathers (before it runs) and the
    prefetched ones (started while it runs, for the next operator)."""

    demand: list[list[tuple[int, int]]] = field(default_factory=list)
    prefetched: list[list[tuple[int, int]]] = field(default_factory=list)

    @property
    def gathers(self) -> int:
        return sum(len(d) for d in self.demand) + sum(len(p) for p in self.prefetched)

    def gathered_chunks(self) -> list[int]:
        """Every gathered chunk, in the order the gathers start."""
        out = []
        for d, p in zip(self.demand, self.prefetched):
            out += [c for c, _ in d] + [c for c, _ in p]
        return out


def simulate_cache(trace: list[tuple[int, ...]], n_block: int, prefetch: bool = True) -> CacheRun:
    """One pass of the trace from an empty rCache, deciding exactly as the runtime does."""
    policy = CachePolicy(n_block)
    policy.begin(trace)
    run = CacheRun()
    for chunks in trace:
        run.demand.append(policy.need(chunks))
        run.prefetched.append(policy.prefetch() if prefetch else [])
        policy.done()
    return run
