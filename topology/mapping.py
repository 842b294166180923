"""Cross mapping: which physical GPU runs which pipeline stage (Mobius paper §3.3, eq. 12-13).

Stages are dealt to N pipeline *workers* round-robin: stage j runs on worker ``j mod N``. A
:class:`Mapping` says which physical GPU each worker runs on (``worker_gpus[k]``), so stage j runs on
GPU ``worker_gpus[j % N]``. The sequential mapping puts worker k on GPU k.

Contention (eq. 12-13) of a mapping for S stages::

    contention = sum over stage pairs i < j of shared(i, j) / (j - i)

where ``shared(i, j)`` is the number of GPUs in the root complex of stage i's GPU when stage j's
GPU is in the same root complex, and 0 otherwise. Choices made where the paper is silent:

* pairs of stages on the *same* GPU are left out: their cost does not depend on the mapping, and
  one GPU's uploads are serialised anyway (the paper's shared(i, j) counts GPUs, not stages);
* ``shared`` is the size of the root complex among the GPUs of the topology (the GPUs in use);
* with fewer stages than GPUs only the first S worker_gpus carry stages; the rest still get a GPU.

Search. Contention depends only on worker pairs, so ``w[a][b]`` = sum over stage pairs with one
stage on worker a and the other on worker b of ``1/|i-j|`` is computed once and a mapping costs
``sum_{a<b} w[a][b] * share[g_a][g_b]`` (a quadratic assignment problem). The exact search walks
root-complex *label sequences* instead of GPU permutations: GPUs of one root complex are
interchangeable, GPUs alone on their root complex never contend (one label for all of them), and
root complexes of equal size may swap labels. A 4+4 box has 35 sequences instead of 40,320 orders;
every 8-GPU layout has at most a few hundred. Larger boxes (more than ``EXACT_LIMIT`` sequences)
use a heuristic: deal root complexes alternately (the paper's idea), then improve by pairwise
swaps, from that start, the sequential mapping and a few seeded random orders. Ties are broken
towards the lexicographically smallest ``worker_gpus``, so a layout where the order does not matter (all
GPUs on one root complex) gets the sequential mapping.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import factorial
from typing import TYPE_CHECKING, Iterator, Sequence

import numpy as np

from mobius.errors import MobiusError

if TYPE_CHECKING:
    from topology.model import Topology

EXACT_LIMIT = 50_000  # label sequences the exact search may visit
_HEURISTIC_RESTARTS = 8
_TIE = 1e-9


@dataclass(frozen=True)
class Mapping:
    """The GPU of each worker and its contention; ``sequential_contention`` is that of GPUs 0..N-1 in order."""

    worker_gpus: tuple[int, ...]
    contention: float
    sequential_contention: float
    method: str  # "exact", "heuristic" or "sequential"
    num_stages: int = 0

    def gpu_of_stage(self, j: int) -> int:
        """The physical GPU index that runs stage j."""
        return self.worker_gpus[j % len(self.worker_gpus)]

    def stage_gpus(self, num_stages: int | None = None) -> list[int]:
        """GPU of each stage 0..S-1 (S defaults to the stage count the mapping was made for)."""
        return [self.gpu_of_stage(j) for j in range(self.num_stages if num_stages is None else num_stages)]

    @property
    def reduction(self) -> float:
        """Fraction of the sequential mapping's contention removed (0 when that was already 0)."""
        return 0.0 if self.sequential_contention <= 0 else 1.0 - self.contention / self.sequential_contention


# ------------------------------------------------------------------------------ inputs
def as_groups(topo_or_groups: "Topology | Sequence[Sequence[int]] | Sequence[int]") -> list[list[int]]:
    """Root complexes as GPU index lists from a Topology, index lists or sizes ([2, 2])."""
    groups = getattr(topo_or_groups, "root_complexes", topo_or_groups)
    items = list(groups)  # type: ignore[arg-type]
    if items and all(isinstance(x, (int, np.integer)) for x in items):
        if any(int(x) < 1 for x in items):
            raise MobiusError(f"root complex sizes must be >= 1, got {items}")
        starts = np.cumsum([0] + [int(x) for x in items])
        return [list(range(int(starts[k]), int(starts[k + 1]))) for k in range(len(items))]
    lists = [sorted(int(i) for i in g) for g in items]
    flat = sorted(i for g in lists for i in g)
    if not lists or flat != list(range(len(flat))) or any(not g for g in lists):
        raise MobiusError(f"root complexes {items} must hold each GPU index 0..{len(flat) - 1} exactly once")
    return sorted(lists, key=lambda g: g[0])


def _share_matrix(groups: list[list[int]]) -> np.ndarray:
    """share[g][h] = size of the root complex of g and h when they share it (g != h), else 0."""
    n = sum(len(g) for g in groups)
    share = np.zeros((n, n))
    for g in groups:
        for a in g:
            for b in g:
                if a != b:
                    share[a, b] = len(g)
    return share


def worker_weights(n_workers: int, num_stages: int) -> np.ndarray:
    """w[a][b] = sum of 1/|i-j| over stage pairs with one stage on worker a, the other on worker b.

    Symmetric, zero diagonal (pairs on one worker run on one GPU and are left out).
    """
    w = np.zeros((n_workers, n_workers))
    for d in range(1, num_stages):
        i = np.arange(num_stages - d)
        np.add.at(w, (i % n_workers, (i + d) % n_workers), 1.0 / d)
    w = w + w.T
    np.fill_diagonal(w, 0.0)
    return w


def _cost(w: np.ndarray, share: np.ndarray, worker_gpus: Sequence[int]) -> float:
    p = np.asarray(worker_gpus)
    return float(np.triu(w * share[np.ix_(p, p)], 1).sum())


def contention(worker_gpus: Sequence[int], groups: "Topology | Sequence[Sequence[int]] | Sequence[int]", num_stages: int) -> float:
    """Eq. 12-13 summed directly over stage pairs (i < j on different GPUs of one root complex)."""
    rcs = as_groups(groups)
    size = {i: len(g) for g in rcs for i in g}
    rc = {i: k for k, g in enumerate(rcs) for i in g}
    gpu = [worker_gpus[j % len(worker_gpus)] for j in range(num_stages)]
    total = 0.0
    for i in range(num_stages):
        for j in range(i + 1, num_stages):
            if gpu[i] != gpu[j] and rc[gpu[i]] == rc[gpu[j]]:
                total += size[gpu[i]] / (j - i)
    return total


# ------------------------------------------------------------------------------ exact search
@dataclass
class _Labels:
    """Root complexes as labels: ``counts[l]`` GPUs carry label l; the last label is "alone"."""

    counts: list[int]
    gpus: list[list[int]]  # GPUs of each label, ascending
    size_class: list[int]  # labels of one size class may swap (-1: the "alone" label)

    @classmethod
    def of(cls, groups: list[list[int]]) -> "_Labels":
        """Labels for root complexes of two or more GPUs, plus one label for all lone GPUs."""
        shared = [g for g in groups if len(g) > 1]
        alone = sorted(i for g in groups if len(g) == 1 for i in g)
        return cls([len(g) for g in shared] + [len(alone)], [list(g) for g in shared] + [alone],
                   [len(g) for g in shared] + [-1])

    def sequence_count(self) -> int:
        """Number of distinct label sequences up to swapping equal-size root complexes."""
        total = factorial(sum(self.counts))
        for c in self.counts:
            total //= factorial(c)
        for size in set(s for s in self.size_class if s > 0):
            total //= factorial(self.size_class.count(size))
        return total

    def label_share(self) -> np.ndarray:
        """share between two labels: the root complex size on the diagonal (0 for lone GPUs)."""
        k = len(self.counts)
        m = np.zeros((k, k))
        for l in range(k - 1):
            m[l, l] = self.counts[l]
        return m

    def worker_gpus(self, seq: Sequence[int]) -> tuple[int, ...]:
        """GPU order for a label sequence: each label's GPUs in ascending order."""
        nxt = [0] * len(self.counts)
        out = []
        for l in seq:
            out.append(self.gpus[l][nxt[l]])
            nxt[l] += 1
        return tuple(out)


def _sequences(labels: _Labels) -> Iterator[tuple[int, ...]]:
    """Label sequences in which equal-size root complexes first appear in label order."""
    n, left = sum(labels.counts), list(labels.counts)
    seq: list[int] = []
    opened = [False] * len(left)

    def fits(l: int) -> bool:
        """Label l has GPUs left and opening it keeps equal-size labels in order."""
        if left[l] == 0:
            return False
        if opened[l] or labels.size_class[l] < 0:
            return True
        earlier = [m for m in range(l) if labels.size_class[m] == labels.size_class[l]]
        return all(opened[m] for m in earlier)

    def walk() -> Iterator[tuple[int, ...]]:
        """Depth-first extension of ``seq``."""
        if len(seq) == n:
            yield tuple(seq)
            return
        for l in range(len(left)):
            if fits(l):
                was = opened[l]
                left[l] -= 1
                opened[l] = True
                seq.append(l)
                yield from walk()
                seq.pop()
                opened[l] = was
                left[l] += 1

    yield from walk()


def _exact(groups: list[list[int]], w: np.ndarray) -> tuple[tuple[int, ...], float]:
    labels = _Labels.of(groups)
    seqs = np.array(list(_sequences(labels)), dtype=np.intp)
    lshare = labels.label_share()
    n = seqs.shape[1]
    costs = np.zeros(len(seqs))
    for a in range(n):
        for b in range(a + 1, n):
            if w[a, b]:
                costs += w[a, b] * lshare[seqs[:, a], seqs[:, b]]
    best = costs.min()
    tied = np.flatnonzero(costs <= best + _TIE * max(1.0, best))
    worker_gpus = min(labels.worker_gpus(seqs[k]) for k in tied)
    return worker_gpus, float(best)


# ------------------------------------------------------------------------------ heuristic
def _alternating(groups: list[list[int]]) -> list[int]:
    """Deal GPUs from the root complex with most GPUs left, never twice in a row when avoidable."""
    left = [list(g) for g in groups]
    order: list[int] = []
    last = -1
    while any(left):
        choices = sorted((-len(g), k) for k, g in enumerate(left) if g and k != last) or [(0, last)]
        k = choices[0][1]
        order.append(left[k].pop(0))
        last = k
    return order


def _local_search(w: np.ndarray, share: np.ndarray, start: Sequence[int]) -> tuple[list[int], float]:
    """Best-improvement pairwise worker swaps until none helps (QAP swap deltas, all pairs at once)."""
    p = np.array(start, dtype=np.intp)
    while True:
        x = share[np.ix_(p, p)]
        y = w @ x.T
        dy = np.diag(y)
        delta = y + y.T - dy[:, None] - dy[None, :] + 2.0 * w * x
        np.fill_diagonal(delta, 0.0)
        a, b = np.unravel_index(int(np.argmin(delta)), delta.shape)
        if delta[a, b] >= -_TIE:
            return p.tolist(), _cost(w, share, p)
        p[[a, b]] = p[[b, a]]


def _heuristic(groups: list[list[int]], w: np.ndarray, share: np.ndarray) -> tuple[tuple[int, ...], float]:
    n = share.shape[0]
    rng = np.random.default_rng(0)
    starts = [_alternating(groups), list(range(n))] + [rng.permutation(n).tolist() for _ in range(_HEURISTIC_RESTARTS)]
    results = [_local_search(w, share, s) for s in starts]
    best = min(c for _, c in results)
    return min(tuple(p) for p, c in results if c <= best + _TIE * max(1.0, best)), best


# ------------------------------------------------------------------------------ public
def _check_stages(num_stages: int) -> None:
    if not isinstance(num_stages, (int, np.integer)) or isinstance(num_stages, bool) or num_stages < 1:
        raise MobiusError(f"the number of stages must be a positive integer, got {num_stages!r}")


def sequential_mapping(topo_or_groups: "Topology | Sequence[Sequence[int]] | Sequence[int]", num_stages: int) -> Mapping:
    """Worker k on GPU k: the naive mapping of existing pipeline systems."""
    _check_stages(num_stages)
    groups = as_groups(topo_or_groups)
    n = sum(len(g) for g in groups)
    worker_gpus = tuple(range(n))
    c = _cost(worker_weights(n, num_stages), _share_matrix(groups), worker_gpus)
    return Mapping(worker_gpus, c, c, "sequential", int(num_stages))


def cross_mapping(
    topo_or_groups: "Topology | Sequence[Sequence[int]] | Sequence[int]",
    num_stages: int,
    method: str = "auto",
) -> Mapping:
    """The GPU order with the least contention for ``num_stages`` stages (eq. 13).

    ``method``: "exact" (label-sequence search), "heuristic" (alternate root complexes + swaps) or
    "auto" (exact when at most ``EXACT_LIMIT`` label sequences, which covers every box of up to 8
    GPUs and e.g. 8+8).
    """
    _check_stages(num_stages)
    if method not in ("auto", "exact", "heuristic"):
        raise MobiusError(f"unknown mapping method {method!r} (auto, exact or heuristic)")
    groups = as_groups(topo_or_groups)
    n = sum(len(g) for g in groups)
    w, share = worker_weights(n, num_stages), _share_matrix(groups)
    seq_cost = _cost(w, share, range(n))
    exact = method == "exact" or (method == "auto" and _Labels.of(groups).sequence_count() <= EXACT_LIMIT)
    worker_gpus, cost = _exact(groups, w) if exact else _heuristic(groups, w, share)
    return Mapping(tuple(int(s) for s in worker_gpus), cost, seq_cost, "exact" if exact else "heuristic", int(num_stages))
