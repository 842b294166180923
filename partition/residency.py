"""The second pass over the MIP's partition: which stages stay on their GPU for good (*resident*)
and which keep their forward's activations for the backward (*kept*), within the GPU memory the
partition leaves free.

Both trade GPU memory for time, the way Elixir's search weighs a chunk kept on the GPU (the time it
saves) against the memory it takes: a resident stage costs its weights, fp32 master, AdamW moments
and gradients on the device (20 bytes per parameter in bf16) and saves its uploads, its gradient
download and its CPU update (a device AdamW instead); a kept stage costs ``M`` micro-batches of its
autograd graph and saves one forward recompute per micro-batch. The pass is greedy and exact: each
round evaluates every single move with the timing model (:class:`~partition.evaluate.ModelEvaluator`,
memory rules included) and takes the one that saves the most time per byte, until no move saves
time. The plan then simulates the result (:mod:`partition.plan`).

Evaluating every move is what costs; three things make a round cheap without changing its choice:
the kept moves share one structure and are evaluated together, in one batch
(:class:`~partition.timing.VariantNumbers`); a resident move whose worker's memory cannot take it is dropped
by that worker's memory rules alone; and the others are bounded before they are evaluated. A move
changes one worker's stages only, so the step with that worker's uploads, downloads and CPU updates
free (and, for moves that keep activations, all its stages kept) is a lower bound on the step of
every move of that worker (:class:`~partition.timing.Variant`, in the same batch): a move whose
bound cannot beat the best time per byte found so far is not evaluated. Moves are ranked exactly as
the plain greedy ranks them (ties to the first in :func:`_moves`' order); the tests hold the pass to
the plain greedy on random cases.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field

import numpy as np

from partition.evaluate import GB, ModelEvaluator
from partition.schedule import PipelineOptions
from partition.timing import VariantNumbers, Numbers, PipelineShape, StageExprs, Variant, step_model, worker_needs

log = logging.getLogger(__name__)
MIN_GAIN = 1e-4  # a move must save this fraction of the step


@dataclass(frozen=True)
class Move:
    resident: frozenset[int]
    kept: frozenset[int]
    what: str  # e.g. "resident 3", "kept 5", "resident+kept 2"


def may_keep(num_stages: int, j: int) -> bool:
    """Any stage but the last (whose FB never recomputes) may keep its activations: a swapped
    stage's graph holds its weights by position and reads them from the backward's upload."""
    return 0 <= j < num_stages - 1


def tied_ends(ev: ModelEvaluator, S: int) -> set[int]:
    """Stages holding a tied weight's two ends: their gradients meet in host memory, never resident."""
    return {0, S - 1} if ev.profile.tied_params > 0 and S > 1 else set()


def check_choice(ev: ModelEvaluator, boundaries: list[int], resident: frozenset[int],
                 kept: frozenset[int]) -> tuple[str, str] | None:
    """Why this choice of resident and kept stages cannot run: ``(key, reason)`` with key
    ``"resident"`` or ``"kept"``, the list at fault; None when it can run."""
    S = len(boundaries) - 1
    for key, given in (("resident", resident), ("kept", kept)):
        bad = sorted(j for j in given if not 0 <= j < S)
        if bad:
            return key, f"stage(s) {bad} out of range: the plan has {S} stages (0..{S - 1})"
    ends = tied_ends(ev, S) & resident
    if ends:
        return "resident", (f"stage(s) {sorted(ends)} hold an end of the tied embedding/head weight, whose gradients "
                            f"are summed in host memory; they cannot be resident")
    wrong = sorted(j for j in kept if not may_keep(S, j))
    if wrong:
        return "kept", (f"stage(s) {wrong} cannot keep activations: the last stage ({S - 1}) runs forward, loss "
                        f"and backward together and never recomputes")
    return None


def _moves(ev: ModelEvaluator, S: int, cur: Move, free_resident: bool, free_kept: bool) -> list[Move]:
    out: list[Move] = []
    if free_resident:
        for j in sorted(set(range(S)) - cur.resident - tied_ends(ev, S)):
            res = cur.resident | {j}
            out.append(Move(res, cur.kept, f"resident {j}"))
            if free_kept and may_keep(S, j) and j not in cur.kept:
                out.append(Move(res, cur.kept | {j}, f"resident+kept {j}"))
    if free_kept:
        out += [Move(cur.resident, cur.kept | {j}, f"kept {j}") for j in range(S)
                if j not in cur.kept and may_keep(S, j)]
    return out


def _bytes(st: list[StageExprs], M: int, cur: Move, move: Move) -> float:
    """GPU bytes a move adds (the greedy's denominator)."""
    extra = sum(st[j].state for j in move.resident - cur.resident)
    extra += sum(st[j].saved * M for j in move.kept - cur.kept)  # its inputs were held for the recompute already
    return max(extra * GB, 1.0)


def choose(ev: ModelEvaluator, boundaries: list[int], resident: frozenset[int] | None = None,
           kept: frozenset[int] | None = None) -> tuple[frozenset[int], frozenset[int], float]:
    """Resident and kept stages for ``boundaries`` (those given are fixed; None: chosen here) and the
    step time the timing model predicts for them."""
    S = len(boundaries) - 1
    cur = Move(frozenset(resident or ()), frozenset(kept or ()), "start")
    rounds = _Rounds(ev, boundaries)
    best_t = rounds.times(cur, [Variant()])[0]
    while True:
        found = rounds.best_move(cur, best_t, _moves(ev, S, cur, resident is None, kept is None))
        if found is None:
            log.debug("residency: %d evaluations (batches and bounds included)", rounds.evaluations)
            return cur.resident, cur.kept, best_t
        best_t, cur = found
        log.debug("residency: %s -> %.4f s", cur.what, best_t)


@dataclass
class _Rounds:
    """The greedy's rounds on one partition: the best move of each, found with as few evaluations
    of the timing model as the bounds allow (see the module's docstring)."""

    ev: ModelEvaluator
    boundaries: list[int]
    evaluations: int = 0  # of the timing model (a batch counts once)
    _fits: dict[tuple, bool] = field(default_factory=dict)  # (worker, its resident, its kept) -> memory holds

    def __post_init__(self) -> None:
        self.S = len(self.boundaries) - 1
        self.N = len(self.ev.worker_gpus(self.S))
        self.st = self.ev.exprs(self.boundaries)
        self.rates = self.ev.rates(self.S)
        self.budget = self.ev.hw.gpu_memory_bytes / GB

    def options(self, move: Move) -> PipelineOptions:
        return dataclasses.replace(self.ev.options, resident=move.resident, kept=move.kept)

    def best_move(self, cur: Move, best_t: float, moves: list[Move]) -> tuple[float, Move] | None:
        """The plain greedy's choice among ``moves``: the largest time saved per byte among those
        saving at least ``MIN_GAIN`` (ties: the first), as (its step time, the move); None if none."""
        if not math.isfinite(best_t):  # nothing fits yet: every move scores inf, the first that fits wins
            return next(((t, m) for m in moves if math.isfinite(t := self.times(m, [Variant()])[0])), None)
        rank = {m: i for i, m in enumerate(moves)}
        best: tuple[float, int, float, Move] | None = None  # (score, -rank, time, move)

        def consider(move: Move, t: float) -> None:
            nonlocal best
            if t < best_t * (1 - MIN_GAIN):
                entry = ((best_t - t) / _bytes(self.st, self.ev.M, cur, move), -rank[move], t, move)
                best = entry if best is None or entry[:2] > best[:2] else best

        keeping = [m for m in moves if m.resident == cur.resident]
        placing = [(m, w) for m in moves if m.resident != cur.resident
                   and self.fits(m, w := next(iter(m.resident - cur.resident)) % self.N)]
        relax = sorted({(w, bool(m.kept - cur.kept)) for m, w in placing})  # the bounds these moves need
        variants = [Variant(kept=m.kept - cur.kept) for m in keeping] + [
            Variant(kept=frozenset(range(w, self.S - 1, self.N)) - cur.kept if keeps else frozenset(),
                    free=frozenset([w])) for w, keeps in relax]
        times = self.times(cur, variants, memory=[True] * len(keeping) + [False] * len(relax))
        for m, t in zip(keeping, times):
            consider(m, t)
        low = dict(zip(relax, times[len(keeping):]))
        for m, bound in _ranked(cur, best_t, placing, low, self.st, self.ev.M):
            if best is not None and bound < best[0]:
                break
            consider(m, self.times(Move(m.resident, cur.kept, "base"), [Variant(kept=m.kept - cur.kept)])[0])
        return (best[2], best[3]) if best is not None else None

    def times(self, base: Move, variants: list[Variant], memory: list[bool] | None = None) -> list[float]:
        """Step times of ``base`` plus each variant, inf where a memory rule breaks (for the variants
        whose ``memory`` flag is set; all by default): one evaluation of the timing model for all."""
        if not variants:
            return []
        self.evaluations += 1
        if len(variants) == 1 and not variants[0].free and (memory is None or memory[0]):  # one variant: in numbers,
            # the same a batch gives it (the tests hold batches to them), without arrays of one
            move = Move(base.resident, base.kept | variants[0].kept, base.what)
            return [self.ev.evaluate(self.boundaries, self.options(move)).T]
        shape = PipelineShape(self.S, self.N, self.ev.M, self.options(base), self.ev.profile.tied_params / GB, tuple(variants))
        alg = VariantNumbers(len(variants))
        step = np.broadcast_to(step_model(alg, self.st, self.rates, shape, self.budget).step, alg.broken.shape)
        check = memory or [True] * len(variants)
        return [math.inf if broken and c else float(t) for t, broken, c in zip(step, alg.broken, check)]

    def fits(self, move: Move, w: int) -> bool:
        """Whether worker ``w``'s memory rules hold under ``move`` (the other workers' do not change)."""
        mine = frozenset(range(w, self.S, self.N))
        key = (w, move.resident & mine, move.kept & mine)
        if key not in self._fits:
            alg = Numbers()
            shape = PipelineShape(self.S, self.N, self.ev.M, self.options(move), self.ev.profile.tied_params / GB)
            for what, need in worker_needs(alg, self.st, shape, [w])[w]:
                alg.require(need, self.budget, what)
            self._fits[key] = not alg.violations
        return self._fits[key]


def _ranked(cur: Move, best_t: float, placing: list[tuple[Move, int]], low: dict[tuple[int, bool], float],
            st: list[StageExprs], M: int) -> list[tuple[Move, float]]:
    """Resident moves (with their worker) ranked by an upper bound on their score: the time saved
    down to their worker's lower bound ``low[(worker, keeps)]``, per byte; those whose bound cannot
    save ``MIN_GAIN`` are left out."""
    out = []
    for m, w in placing:
        bound = low[(w, bool(m.kept - cur.kept))]
        if bound < best_t * (1 - MIN_GAIN):
            out.append((m, (best_t - bound) / _bytes(st, M, cur, m)))
    return sorted(out, key=lambda x: -x[1])
