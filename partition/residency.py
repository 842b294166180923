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
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from partition.evaluate import GB, ModelEvaluator
from partition.timing import StageExprs

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
    st = ev.exprs(boundaries)
    best_t = ev.evaluate(boundaries, dataclasses.replace(ev.options, resident=cur.resident, kept=cur.kept)).T
    while True:
        found: tuple[float, float, Move] | None = None
        for move in _moves(ev, S, cur, resident is None, kept is None):
            t = ev.evaluate(boundaries, dataclasses.replace(ev.options, resident=move.resident, kept=move.kept)).T
            if t < best_t * (1 - MIN_GAIN):
                score = (best_t - t) / _bytes(st, ev.M, cur, move)
                if found is None or score > found[0]:
                    found = (score, t, move)
        if found is None:
            return cur.resident, cur.kept, best_t
        _, best_t, cur = found
        log.debug("residency: %s -> %.4f s", cur.what, best_t)
