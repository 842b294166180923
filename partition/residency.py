"""The second pass over the MIP's partition: which stages stay on their GPU for good (*resident*)
and which keep their forward's activations for the backward (*kept*), within the GPU memory the
partition leaves free.

Both trade GPU memory for time, the way Elixir's search weighs a chunk kept on the GPU (the time it
saves) against the memory it takes: a resident stage costs its weights, fp32 master, AdamW moments
and gradients on the device (20 bytes per parameter in bf16) and saves its uploads, its gradient
download and its CPU update (a device AdamW instead); a kept stage costs ``M`` micro-batches of its
autograd graph and saves one forward recompute per micro-batch. The pass is greedy and exact: each
round evaluates every move (one stage, or the same change on one stage of every worker, since when
several workers bound the step no single stage shortens it) with the timing model
(:class:`~partition.evaluate.ModelEvaluator`, memory rules included) and takes the one that saves
the most time per byte, until a round finds no move that saves time. A round of more than
``LAZY_MOVES`` moves is evaluated lazily: a move's score in an earlier round is taken to bound its
score now, so the round re-evaluates moves only while one of them could still beat the best fresh
score (a 42-stage plan on 4 GPUs: about 7x fewer evaluations, the same choice). The round that
ends the pass evaluates every move afresh. The plan then simulates the result (:mod:`partition.plan`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass

from partition.evaluate import GB, ModelEvaluator
from partition.timing import Shape, StageExprs

log = logging.getLogger(__name__)
MIN_GAIN = 1e-4  # a move must save this fraction of the step
LAZY_MOVES = 100  # rounds with more candidate moves than this are evaluated lazily


@dataclass(frozen=True)
class Move:
    resident: frozenset[int]
    kept: frozenset[int]
    what: str  # e.g. "resident 3", "kept 5", "resident+kept 2"


def may_keep(shape: Shape, j: int) -> bool:
    """Any stage but the last (whose FB never recomputes) may keep its activations: a swapped
    stage's graph holds its weights by position and reads them from the backward's upload."""
    return 0 <= j < shape.num_stages - 1


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
    shape = ev.shape(S, dataclasses.replace(ev.options, resident=resident))
    wrong = sorted(j for j in kept if not may_keep(shape, j))
    if wrong:
        return "kept", (f"stage(s) {wrong} cannot keep activations: the last stage ({S - 1}) runs forward, loss "
                        f"and backward together and never recomputes")
    return None


def _moves(ev: ModelEvaluator, S: int, cur: Move, free_resident: bool, free_kept: bool) -> list[Move]:
    """Every single-stage move, and the same move on one stage of every worker at once (stages
    ``j..j+N-1``): when several workers bound the step equally, no single stage shortens it."""
    shape = ev.shape(S, dataclasses.replace(ev.options, resident=cur.resident))
    N = shape.num_workers
    groups = [frozenset({j}) for j in range(S)] + [frozenset(range(j, j + N)) for j in range(S - N + 1) if N > 1]
    out: list[Move] = []
    for g in groups:
        name = f"{min(g)}" if len(g) == 1 else f"{min(g)}-{max(g)}"
        if free_resident:
            res = g - cur.resident - tied_ends(ev, S)
            if res:
                out.append(Move(cur.resident | res, cur.kept, f"resident {name}"))
                keep = {j for j in res if j < S - 1} - cur.kept
                if free_kept and keep:
                    out.append(Move(cur.resident | res, cur.kept | keep, f"resident+kept {name}"))
        keep = {j for j in g - cur.kept if may_keep(shape, j)}
        if free_kept and keep:
            out.append(Move(cur.resident, cur.kept | keep, f"kept {name}"))
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
    st = ev.exprs(boundaries)
    best_t = ev.evaluate(boundaries, dataclasses.replace(ev.options, resident=cur.resident, kept=cur.kept)).T
    last: dict[str, float] = {}  # each move's score when last evaluated, taken as a bound on its score now
    while True:
        found: tuple[float, float, Move] | None = None
        moves = _moves(ev, S, cur, resident is None, kept is None)
        lazy = len(moves) > LAZY_MOVES
        for move in sorted(moves, key=lambda m: -last.get(m.what, math.inf)):
            if lazy and found is not None and last.get(move.what, math.inf) <= found[0]:
                break  # no move left can beat the best fresh score
            t = ev.evaluate(boundaries, dataclasses.replace(ev.options, resident=move.resident, kept=move.kept)).T
            last[move.what] = (best_t - t) / _bytes(st, ev.M, cur, move) if t < best_t * (1 - MIN_GAIN) else 0.0
            if last[move.what] > 0 and (found is None or last[move.what] > found[0]):
                found = (last[move.what], t, move)
        if found is None:  # a whole round evaluated afresh: no move saves time
            return cur.resident, cur.kept, best_t
        _, best_t, cur = found
        log.debug("residency: %s -> %.4f s", cur.what, best_t)
