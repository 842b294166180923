"""The plain values that describe a GPU server: :class:`GPU`, :class:`Topology` and its PCIe parts.

A :class:`Topology` is what :func:`topology.detect` returns and what ``mobius topo --json`` writes.
Everything in it is indexed by the GPU ``index`` (0..N-1 in ``CUDA_VISIBLE_DEVICES`` order):

* ``root_complexes`` -- lists of GPU indices; the GPUs of one list share one CPU root complex (host
  bridge), and so its PCIe bandwidth to host memory. GPUs behind one switch or one host bridge
  (``nvidia-smi`` paths PIX, PXB, PHB) share a root complex; NODE and SYS paths do not.
* ``nvlink[i][j]`` -- number of NVLink links between GPU i and j (through an NVSwitch: the smaller of
  the two GPUs' switch link counts); 0 without NVLink.
* ``p2p[i][j]`` -- whether GPU i may read GPU j's memory directly (CUDA peer access); diagonal True.
* ``pcie_paths[i][j]`` -- the PCIe path as ``nvidia-smi topo -m`` names it: ``X`` (self), ``PIX``,
  ``PXB``, ``PHB``, ``NODE``, ``SYS``, or ``""`` where no source told (``nvidia-smi`` hides the PCIe
  path of NVLink-connected pairs).
* ``host_bridges[k]`` describes ``root_complexes[k]``; ``switches`` lists the PCIe switches seen.

Root complexes are kept in a canonical order (by their smallest GPU index, each list sorted), and
``GPU.root_complex`` is the position of the GPU's list in ``root_complexes``.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Iterable, Sequence

from topology.errors import TopologyFileError

SCHEMA = "mobius.topology/1"
GiB = 1 << 30

# Paths whose two ends sit under one host bridge, i.e. share a CPU root complex.
SHARED_ROOT_PATHS = frozenset({"PIX", "PXB", "PHB"})


@dataclass
class GPU:
    """One GPU as the process sees it.

    ``memory_bytes`` is 0 and ``name`` is ``"unknown"`` where the source (saved ``nvidia-smi topo -m``
    text) does not say; ``numa_node``, ``pcie_gen`` and ``pcie_width`` are ``None`` when unknown.
    ``pcie_gen``/``pcie_width`` are the GPU's own link (the best it and its slot can do), not a
    switch's uplink (see :class:`PCIeSwitch`).
    """

    index: int
    name: str
    memory_bytes: int
    pci_bus_id: str
    numa_node: int | None
    pcie_gen: int | None
    pcie_width: int | None
    root_complex: int = 0
    uuid: str | None = None
    cpu_affinity: str | None = None  # e.g. "0-15,32-47", as Linux and nvidia-smi print it


@dataclass
class PCIeSwitch:
    """A PCIe switch with GPUs below it; ``bus_id`` is its upstream port ("" when only inferred).

    ``pcie_gen``/``pcie_width`` describe the uplink towards the root complex, which all GPUs below
    the switch share (the paper's servers: PCIe 3.0 x8 uplinks).
    """

    bus_id: str
    gpus: list[int]
    pcie_gen: int | None = None
    pcie_width: int | None = None


@dataclass
class HostBridge:
    """The CPU root complex (PCIe host bridge) of one entry of ``Topology.root_complexes``.

    ``name`` is the sysfs host bridge (``pci0000:00``) when known, else ``rc<k>``.
    """

    name: str
    numa_node: int | None = None


class _UnionFind:
    """Disjoint sets over 0..n-1, for grouping GPUs that share a root complex or a switch."""

    def __init__(self, n: int) -> None:
        self.parent = list(range(n))

    def find(self, x: int) -> int:
        """Representative of x's set (with path halving)."""
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def union(self, a: int, b: int) -> None:
        """Merge the sets of a and b (the smaller representative wins)."""
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)

    def groups(self, members: Iterable[int]) -> list[list[int]]:
        """The sets of ``members``, each sorted, ordered by smallest member."""
        out: dict[int, list[int]] = {}
        for m in members:
            out.setdefault(self.find(m), []).append(m)
        return sorted((sorted(g) for g in out.values()), key=lambda g: g[0])


def groups_from_pairs(n: int, pairs: Iterable[tuple[int, int]]) -> list[list[int]]:
    """Connected groups of 0..n-1 given pairs that belong together (sorted by smallest member)."""
    uf = _UnionFind(n)
    for a, b in pairs:
        uf.union(a, b)
    return uf.groups(range(n))


def _matrix(n: int, value: Any, diagonal: Any) -> list[list[Any]]:
    return [[diagonal if i == j else value for j in range(n)] for i in range(n)]


@dataclass
class Topology:
    """GPUs, their root complexes, NVLink and peer-access matrices, and the PCIe tree.

    Build one with :meth:`assemble` (canonical order), :meth:`synthetic`,
    :func:`topology.topology_from_json`, :func:`topology.detect` or :func:`topology.load_topology`;
    :func:`topology.topology_graph` gives a networkx view.
    """

    gpus: list[GPU]
    root_complexes: list[list[int]]
    nvlink: list[list[int]]
    p2p: list[list[bool]]
    source: str
    pcie_paths: list[list[str]] = field(default_factory=list)
    host_bridges: list[HostBridge] = field(default_factory=list)
    switches: list[PCIeSwitch] = field(default_factory=list)

    # ----------------------------------------------------------------- construction
    @classmethod
    def assemble(
        cls,
        gpus: Sequence[GPU],
        root_complexes: Sequence[Sequence[int]],
        *,
        source: str,
        nvlink: list[list[int]] | None = None,
        p2p: list[list[bool]] | None = None,
        pcie_paths: list[list[str]] | None = None,
        host_bridges: Sequence[HostBridge] | None = None,
        switches: Sequence[PCIeSwitch] | None = None,
    ) -> "Topology":
        """A checked topology in canonical order; missing matrices get neutral defaults.

        ``host_bridges`` (if given) is aligned with ``root_complexes`` as passed in; both are
        reordered together. Raises :class:`TopologyFileError` on inconsistent input.
        """
        n = len(gpus)
        bridges = list(host_bridges) if host_bridges is not None else [HostBridge("") for _ in root_complexes]
        if len(bridges) != len(root_complexes):
            raise TopologyFileError(f"{len(bridges)} host bridges for {len(root_complexes)} root complexes")
        pairs = sorted(zip((sorted(int(i) for i in rc) for rc in root_complexes), bridges), key=lambda p: p[0][0] if p[0] else -1)
        groups = [g for g, _ in pairs]
        named = [hb if hb.name else replace(hb, name=f"rc{k}") for k, (_, hb) in enumerate(pairs)]
        rc_of = {i: k for k, g in enumerate(groups) for i in g}
        new_gpus = [replace(g, root_complex=rc_of.get(g.index, -1)) for g in gpus]
        topo = cls(
            gpus=new_gpus,
            root_complexes=groups,
            nvlink=nvlink if nvlink is not None else _matrix(n, 0, 0),
            p2p=p2p if p2p is not None else _matrix(n, False, True),
            source=source,
            pcie_paths=pcie_paths if pcie_paths is not None else _matrix(n, "", "X"),
            host_bridges=named,
            switches=sorted((replace(s, gpus=sorted(s.gpus)) for s in switches or []), key=lambda s: s.gpus[0] if s.gpus else -1),
        )
        topo.validate()
        return topo

    @classmethod
    def synthetic(
        cls,
        groups: Sequence[Sequence[int]] | Sequence[int],
        memory_bytes: int = 24 * GiB,
        name: str = "NVIDIA GeForce RTX 3090",
        p2p: bool = False,
    ) -> "Topology":
        """A made-up PCIe box for tests and planning.

        ``groups`` is either sizes (``[2, 2]`` -> GPUs 0,1 on one root complex, 2,3 on another) or
        explicit index lists (``[[0, 2], [1, 3]]``). GPUs of one root complex sit behind one switch
        (path PIX); different root complexes are on different sockets (path SYS, NUMA node = root
        complex number). ``p2p=True`` allows peer copies between every pair.
        """
        rcs = _groups_from_spec(groups)
        n = sum(len(g) for g in rcs)
        rc_of = {i: k for k, g in enumerate(rcs) for i in g}
        gpus = [
            GPU(index=i, name=name, memory_bytes=int(memory_bytes), pci_bus_id=f"{(i + 1) >> 8:04x}:{(i + 1) & 0xFF:02x}:00.0",
                numa_node=rc_of[i], pcie_gen=None, pcie_width=None)
            for i in range(n)
        ]
        paths = [["X" if i == j else ("PIX" if rc_of[i] == rc_of[j] else "SYS") for j in range(n)] for i in range(n)]
        return cls.assemble(
            gpus, rcs, source="synthetic", p2p=_matrix(n, bool(p2p), True), pcie_paths=paths,
            host_bridges=[HostBridge(f"rc{k}", numa_node=k) for k in range(len(rcs))],
            switches=[PCIeSwitch("", list(g)) for g in rcs if len(g) > 1],
        )

    # ----------------------------------------------------------------- queries
    @property
    def num_gpus(self) -> int:
        """Number of GPUs."""
        return len(self.gpus)

    @property
    def has_nvlink(self) -> bool:
        """True when there are at least two GPUs and every pair is connected by NVLink/NVSwitch."""
        n = self.num_gpus
        return n >= 2 and all(self.nvlink[i][j] > 0 for i in range(n) for j in range(n) if i != j)

    @property
    def any_p2p(self) -> bool:
        """True when at least one pair of distinct GPUs allows peer copies."""
        n = self.num_gpus
        return any(self.p2p[i][j] for i in range(n) for j in range(n) if i != j)

    def link_label(self, i: int, j: int) -> str:
        """The ``nvidia-smi topo -m`` style label of the pair: X, NV#, PIX ... SYS, or ``?``."""
        if i == j:
            return "X"
        if self.nvlink[i][j] > 0:
            return f"NV{self.nvlink[i][j]}"
        return self.pcie_paths[i][j] or "?"

    def subset(self, indices: Sequence[int], source: str | None = None) -> "Topology":
        """The topology of the GPUs ``indices`` (in that order), re-indexed 0..k-1.

        This is how ``CUDA_VISIBLE_DEVICES`` is applied to a whole-machine topology.
        """
        pos = {old: new for new, old in enumerate(indices)}
        if len(pos) != len(indices) or any(i < 0 or i >= self.num_gpus for i in indices):
            raise TopologyFileError(f"bad GPU selection {list(indices)} for {self.num_gpus} GPUs")
        gpus = [replace(self.gpus[old], index=new) for new, old in enumerate(indices)]
        rcs, bridges = [], []
        for g, hb in zip(self.root_complexes, self.host_bridges):
            kept = [pos[i] for i in g if i in pos]
            if kept:
                rcs.append(kept)
                bridges.append(replace(hb, name="") if re.fullmatch(r"rc\d+", hb.name) else hb)  # renumbered
        sub = lambda m: [[m[a][b] for b in indices] for a in indices]  # noqa: E731
        switches = [replace(s, gpus=[pos[i] for i in s.gpus if i in pos]) for s in self.switches]
        return Topology.assemble(
            gpus, rcs, source=source or self.source, nvlink=sub(self.nvlink), p2p=sub(self.p2p),
            pcie_paths=sub(self.pcie_paths), host_bridges=bridges, switches=[s for s in switches if s.gpus],
        )

    # ----------------------------------------------------------------- checks
    def validate(self) -> None:
        """Raise :class:`TopologyFileError` unless indices, groups and matrices are consistent."""
        n = self.num_gpus
        if n == 0:
            raise TopologyFileError("a topology needs at least one GPU")
        if [g.index for g in self.gpus] != list(range(n)):
            raise TopologyFileError(f"GPU indices must be 0..{n - 1} in order, got {[g.index for g in self.gpus]}")
        flat = sorted(i for g in self.root_complexes for i in g)
        if flat != list(range(n)):
            raise TopologyFileError(f"root_complexes {self.root_complexes} must hold each GPU index 0..{n - 1} exactly once")
        for name in ("nvlink", "p2p", "pcie_paths"):
            m = getattr(self, name)
            if len(m) != n or any(len(row) != n for row in m):
                raise TopologyFileError(f"{name} must be a {n} x {n} matrix")
        if any(not self.p2p[i][i] for i in range(n)):
            raise TopologyFileError("p2p must be True on the diagonal")
        if len(self.host_bridges) != len(self.root_complexes):
            raise TopologyFileError("host_bridges must have one entry per root complex")
        for s in self.switches:
            if any(not 0 <= i < n for i in s.gpus):
                raise TopologyFileError(f"switch {s.bus_id or '?'} names GPUs {s.gpus} outside 0..{n - 1}")

    # ----------------------------------------------------------------- serialisation
    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (``mobius.topology/1``); :func:`topology.topology_from_json` reads it back."""
        return {
            "schema": SCHEMA,
            "source": self.source,
            "gpus": [asdict(g) for g in self.gpus],
            "root_complexes": [list(g) for g in self.root_complexes],
            "host_bridges": [asdict(h) for h in self.host_bridges],
            "switches": [asdict(s) for s in self.switches],
            "nvlink": [list(r) for r in self.nvlink],
            "p2p": [list(r) for r in self.p2p],
            "pcie_paths": [list(r) for r in self.pcie_paths],
        }


def _groups_from_spec(groups: Sequence[Sequence[int]] | Sequence[int]) -> list[list[int]]:
    """Root complexes from sizes (``[2, 2]``) or index lists (``[[0, 2], [1, 3]]``), checked."""
    items = list(groups)
    if not items:
        raise TopologyFileError("at least one root complex is needed")
    if all(isinstance(x, int) for x in items):
        if any(x < 1 for x in items):  # type: ignore[operator]
            raise TopologyFileError(f"root complex sizes must be >= 1, got {items}")
        out, start = [], 0
        for size in items:
            out.append(list(range(start, start + int(size))))  # type: ignore[arg-type]
            start += int(size)  # type: ignore[arg-type]
        return out
    lists = [sorted(int(i) for i in g) for g in items]  # type: ignore[union-attr]
    flat = sorted(i for g in lists for i in g)
    if flat != list(range(len(flat))) or any(not g for g in lists):
        raise TopologyFileError(f"root complexes {items} must hold each GPU index 0..{len(flat) - 1} exactly once")
    return sorted(lists, key=lambda g: g[0])
