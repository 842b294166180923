"""Cross mapping (Mobius eq. 12-13): exact search against brute force, heuristic against exact."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import numpy as np
import pytest

from mobius.errors import MobiusError
from topology import Mapping, Topology, contention, cross_mapping, load_topology, sequential_mapping
from topology.mapping import EXACT_LIMIT, _cost, _Labels, _sequences, _share_matrix, as_groups, worker_weights
from topology.sysfs import topology_from_sysfs

FIXTURES = Path(__file__).parent / "fixtures" / "topology"
STAGE_COUNTS = [1, 2, 3, 5, 8, 12, 16, 48]


def _partitions(n: int, largest: int | None = None) -> list[list[int]]:
    """Integer partitions of n, parts in non-increasing order."""
    largest = n if largest is None else largest
    if n == 0:
        return [[]]
    return [[k] + rest for k in range(min(n, largest), 0, -1) for rest in _partitions(n - k, k)]


def _fixture_groups() -> dict[str, list[list[int]]]:
    out = {p.name: load_topology(p).root_complexes for p in sorted(FIXTURES.glob("*.txt"))}
    out.update({p.name: topology_from_sysfs(p).root_complexes for p in sorted(FIXTURES.glob("sysfs_*"))})
    return out


def _direct(worker_gpus: tuple[int, ...], groups: list[list[int]], num_stages: int) -> float:
    """Eq. 12-13 written out independently of the library: sum shared(i, j) / |i - j|."""
    rc = {g: k for k, grp in enumerate(groups) for g in grp}
    size = {g: len(grp) for grp in groups for g in grp}
    gpu = [worker_gpus[s % len(worker_gpus)] for s in range(num_stages)]
    return sum(size[gpu[i]] / (j - i) for i in range(num_stages) for j in range(i + 1, num_stages)
               if gpu[i] != gpu[j] and rc[gpu[i]] == rc[gpu[j]])


def _oracle_costs(perms: np.ndarray, groups: list[list[int]], num_stages: int) -> np.ndarray:
    """Eq. 12-13 for every GPU order in ``perms`` (one per row), from the definition alone.

    Stage s runs on GPU ``perm[s % N]``; every stage pair i < j on two different GPUs of one root
    complex adds the size of that root complex divided by j - i. Nothing of topology.mapping is used
    (no share matrix, no slot weights): pairs at distance d are summed directly, for all orders at once.
    """
    rc = np.empty(perms.shape[1], dtype=np.intp)
    size = np.empty(perms.shape[1])
    for k, grp in enumerate(groups):
        rc[grp], size[grp] = k, len(grp)
    gpu = perms[:, np.arange(num_stages) % perms.shape[1]]  # orders x stages: the GPU of each stage
    costs = np.zeros(len(perms))
    for d in range(1, num_stages):
        a, b = gpu[:, :-d], gpu[:, d:]  # all pairs (i, i + d)
        contends = (rc[a] == rc[b]) & (a != b)
        costs += (size[a] * contends).sum(axis=1) / d
    return costs


def _brute_force(groups: list[list[int]], num_stages: int) -> float:
    """Least contention over all N! GPU orders."""
    n = sum(len(g) for g in groups)
    perms = np.array(list(itertools.permutations(range(n))), dtype=np.intp)
    return float(_oracle_costs(perms, groups, num_stages).min())


# ------------------------------------------------------------------------------------ definition
def test_slot_weights_match_direct_sum() -> None:
    rng = np.random.default_rng(1)
    for groups in ([[0, 1], [2, 3]], [[0, 2, 5], [1], [3, 4]], [[0, 1, 2, 3], [4, 5, 6, 7]]):
        n = sum(len(g) for g in groups)
        for stages in (1, 4, 7, 30):
            worker_gpus = tuple(int(x) for x in rng.permutation(n))
            expected = _direct(worker_gpus, groups, stages)
            assert contention(worker_gpus, groups, stages) == pytest.approx(expected, abs=1e-12)
            assert _cost(worker_weights(n, stages), _share_matrix(groups), worker_gpus) == pytest.approx(expected, abs=1e-9)


def test_oracle_agrees_with_the_written_out_sum() -> None:
    """The vectorised brute-force oracle and the scalar transcription of eq. 12-13 agree order by order."""
    rng = np.random.default_rng(2)
    for groups in ([[0, 1], [2, 3]], [[0, 2, 5], [1], [3, 4]], [[0, 1, 2, 3], [4, 5, 6, 7]], [[0]]):
        n = sum(len(g) for g in groups)
        perms = np.array([rng.permutation(n) for _ in range(20)], dtype=np.intp)
        for stages in (1, 2, 5, 13, 48):
            expected = [_direct(tuple(int(x) for x in p), groups, stages) for p in perms]
            assert _oracle_costs(perms, groups, stages) == pytest.approx(expected, abs=1e-9)
    # by hand: 2+2, stages 0..3 on GPUs 0,1,2,3: pairs (0,1) and (2,3) share a root complex of 2, distance 1
    assert _oracle_costs(np.array([[0, 1, 2, 3]]), [[0, 1], [2, 3]], 4)[0] == pytest.approx(4.0)
    assert _oracle_costs(np.array([[0, 2, 1, 3]]), [[0, 1], [2, 3]], 4)[0] == pytest.approx(2 / 2 + 2 / 2)


def test_same_gpu_pairs_are_left_out() -> None:
    # One GPU: every pair of stages is on it, so nothing contends.
    assert cross_mapping([1], 10).contention == 0.0
    # Two GPUs of one root complex, 3 stages: pairs (0,1) and (1,2) cost 2/1 each; (0,2) is on one GPU.
    assert sequential_mapping([2], 3).contention == pytest.approx(4.0)


# ------------------------------------------------------------------------------------ exact = brute force
@pytest.mark.parametrize("name,groups", sorted(_fixture_groups().items()))
def test_exact_matches_brute_force_on_fixtures(name: str, groups: list[list[int]]) -> None:
    assert sum(len(g) for g in groups) <= 8
    for stages in STAGE_COUNTS:
        m = cross_mapping(groups, stages)
        assert m.method == "exact"
        assert sorted(m.worker_gpus) == list(range(sum(len(g) for g in groups)))
        assert m.contention == pytest.approx(_brute_force(groups, stages), abs=1e-9), (name, stages)
        assert m.contention == pytest.approx(_direct(m.worker_gpus, groups, stages), abs=1e-9)
        assert m.sequential_contention == pytest.approx(_direct(tuple(range(len(m.worker_gpus))), groups, stages), abs=1e-9)
        assert m.contention <= m.sequential_contention + 1e-9


@pytest.mark.parametrize("sizes", [p for n in range(2, 6) for p in _partitions(n)])
def test_exact_matches_direct_brute_force_small(sizes: list[int]) -> None:
    groups = as_groups(sizes)
    n = sum(sizes)
    for stages in (2, 5, 9):
        best = min(_direct(p, groups, stages) for p in itertools.permutations(range(n)))
        assert cross_mapping(sizes, stages).contention == pytest.approx(best, abs=1e-9)


def test_symmetry_pruning_counts() -> None:
    assert _Labels.of(as_groups([4, 4])).sequence_count() == 35
    assert _Labels.of(as_groups([2, 2, 2, 2])).sequence_count() == 105
    assert _Labels.of(as_groups([1] * 8)).sequence_count() == 1
    for sizes in _partitions(8):
        labels = _Labels.of(as_groups(sizes))
        assert sum(1 for _ in _sequences(labels)) == labels.sequence_count() <= 1000


def test_exact_search_on_every_8_gpu_layout(capsys: pytest.CaptureFixture[str]) -> None:
    """Every 8-GPU layout is solved exactly at 48 stages; the time taken is printed, not judged."""
    worst, worst_sizes = 0.0, None
    for sizes in _partitions(8):
        t0 = time.perf_counter()
        m = cross_mapping(sizes, 48)
        dt = time.perf_counter() - t0
        assert m.method == "exact" and sorted(m.worker_gpus) == list(range(8)), sizes
        assert m.contention == pytest.approx(_direct(m.worker_gpus, as_groups(sizes), 48), abs=1e-9)
        assert m.contention <= m.sequential_contention + 1e-9
        if dt > worst:
            worst, worst_sizes = dt, sizes
    t0 = time.perf_counter()
    cross_mapping([4, 4], 48)
    paper = time.perf_counter() - t0
    with capsys.disabled():
        print(f"\nexact cross mapping, 8 GPUs, 48 stages: 4+4 {paper * 1e3:.2f} ms; slowest layout {worst_sizes} {worst * 1e3:.2f} ms")


# ------------------------------------------------------------------------------------ the paper's cases
def test_paper_2x2_crosses_adjacent_stages() -> None:
    topo = load_topology(FIXTURES / "topo2x2_sys.txt")
    m = cross_mapping(topo, 8)
    rc = [topo.gpus[m.gpu_of_stage(j)].root_complex for j in range(8)]
    assert all(rc[j] != rc[j + 1] for j in range(7)), rc
    assert m.worker_gpus == (0, 2, 1, 3) and m.contention < m.sequential_contention
    assert m.stage_gpus() == [0, 2, 1, 3, 0, 2, 1, 3]


def test_one_root_complex_keeps_sequential_order() -> None:
    m = cross_mapping(Topology.synthetic([4]), 8)
    assert m.worker_gpus == (0, 1, 2, 3) and m.contention == pytest.approx(m.sequential_contention)
    single = cross_mapping(load_topology(FIXTURES / "single_gpu.txt"), 5)
    assert single.worker_gpus == (0,) and single.contention == 0.0 and single.gpu_of_stage(4) == 0


def test_paper_1x3_and_4x4() -> None:
    m13 = cross_mapping(load_topology(FIXTURES / "topo1x3_spaces.txt"), 8)
    assert m13.contention < m13.sequential_contention
    m44 = cross_mapping(load_topology(FIXTURES / "topo8_4x4_nic.txt"), 16)
    rc = [0 if m44.gpu_of_stage(j) < 4 else 1 for j in range(16)]
    assert all(rc[j] != rc[j + 1] for j in range(15))


# ------------------------------------------------------------------------------------ heuristic
@pytest.mark.parametrize("n", range(2, 9))
def test_heuristic_close_to_exact(n: int) -> None:
    for sizes in _partitions(n):
        for stages in (n, 2 * n + 1, 48):
            exact = cross_mapping(sizes, stages, method="exact")
            heur = cross_mapping(sizes, stages, method="heuristic")
            assert heur.method == "heuristic" and sorted(heur.worker_gpus) == list(range(n))
            assert heur.contention == pytest.approx(_direct(heur.worker_gpus, as_groups(sizes), stages), abs=1e-9)
            assert heur.contention <= exact.contention * 1.03 + 1e-9, (sizes, stages, heur, exact)


def test_large_boxes_use_heuristic(capsys: pytest.CaptureFixture[str]) -> None:
    sizes = [4, 4, 4, 4]
    assert _Labels.of(as_groups(sizes)).sequence_count() > EXACT_LIMIT
    t0 = time.perf_counter()
    m = cross_mapping(sizes, 32)
    with capsys.disabled():
        print(f"\nheuristic cross mapping, 4+4+4+4 GPUs, 32 stages: {(time.perf_counter() - t0) * 1e3:.1f} ms")
    assert m.method == "heuristic" and m.contention < m.sequential_contention
    rc = [m.gpu_of_stage(j) // 4 for j in range(32)]
    assert all(rc[j] != rc[j + 1] for j in range(31))
    big = cross_mapping([8, 8], 48)  # 6,435 label sequences: still exact
    assert big.method == "exact" and big.contention <= cross_mapping([8, 8], 48, method="heuristic").contention + 1e-9


# ------------------------------------------------------------------------------------ API
def test_mapping_api_and_errors() -> None:
    m = cross_mapping([[0, 2], [1, 3]], 6)
    assert isinstance(m, Mapping) and m.num_stages == 6 and m.worker_gpus == (0, 1, 2, 3)  # already crossed
    assert m.reduction == pytest.approx(0.0)
    seq = sequential_mapping([2, 2], 6)
    assert seq.method == "sequential" and seq.worker_gpus == (0, 1, 2, 3) and seq.contention == seq.sequential_contention
    assert cross_mapping([2, 2], 6).reduction > 0.3
    for bad in (0, -2, 2.5, True):
        with pytest.raises(MobiusError, match="number of stages"):
            cross_mapping([2, 2], bad)  # type: ignore[arg-type]
    with pytest.raises(MobiusError, match="exactly once"):
        cross_mapping([[0, 1], [1, 2]], 4)
    with pytest.raises(MobiusError, match="unknown mapping method"):
        cross_mapping([2, 2], 4, method="magic")
