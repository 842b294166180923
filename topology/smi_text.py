"""Parse the text of ``nvidia-smi topo -m`` (optionally followed by ``nvidia-smi topo -p2p r``).

The matrix has a header row ``GPU0 GPU1 ... [NIC0 ... | mlx5_0 ...] CPU Affinity [NUMA Affinity]
[GPU NUMA ID]`` and one row per device. Entries are ``X`` (self), ``PIX``, ``PXB``, ``PHB``, ``NODE``,
``SYS`` (``SOC`` in old drivers) or ``NV#`` (# bonded NVLinks, which hides the PCIe path of that
pair). Columns may be separated by tabs (as nvidia-smi prints) or spaces (as pasted into issues);
terminal colour codes are removed. The Legend block and anything else is ignored.

Root complexes: GPUs linked by PIX, PXB or PHB share one. Where NVLink hides the PCIe path of a
pair, a NIC column can still tell: two GPUs that both reach one NIC without leaving a host bridge
(PIX/PXB/PHB) are under that host bridge. Without such evidence the pair is kept apart.

Peer access is not part of ``topo -m``; a ``topo -p2p r`` block in the same text (entries ``OK``,
``CNS``, ``GNS``, ``TNS``, ``NS``, ``DR``, ``U``) supplies it. Without one, NVLink pairs are taken as
peer-capable and PCIe pairs as not (the safe assumption for consumer GPUs).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from topology.errors import TopologyFileError
from topology.model import GPU, SHARED_ROOT_PATHS, HostBridge, PCIeSwitch, Topology, _UnionFind

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_LINK = re.compile(r"^(X|PIX|PXB|PHB|NODE|SYS|SOC|NV\d+)$")
_P2P_CODES = frozenset({"X", "OK", "CNS", "GNS", "TNS", "NS", "DR", "U"})
_GPU_COL = re.compile(r"^GPU(\d+)$")
_TRAILING = {("CPU", "Affinity"): "cpu", ("NUMA", "Affinity"): "numa", ("GPU", "NUMA", "ID"): "gpu_numa"}


@dataclass
class _Block:
    """One matrix found in the text: its device columns, trailing column names and rows."""

    line: int
    columns: list[str]
    trailing: list[str]
    rows: dict[str, list[str]] = field(default_factory=dict)

    def entries(self, name: str) -> list[str]:
        """The link entries of row ``name``, one per device column."""
        return self.rows[name][: len(self.columns)]

    def extra(self, name: str) -> dict[str, str]:
        """The trailing values (CPU / NUMA affinity) of row ``name``."""
        return dict(zip(self.trailing, self.rows[name][len(self.columns):]))

    def gpu_count(self) -> int:
        """Number of GPU columns."""
        return sum(1 for c in self.columns if _GPU_COL.match(c))


def _parse_header(tokens: list[str]) -> tuple[list[str], list[str]]:
    """Device column names and trailing column names ("cpu", "numa", "gpu_numa") of a header row."""
    columns: list[str] = []
    trailing: list[str] = []
    i = 0
    while i < len(tokens):
        for words, name in _TRAILING.items():
            if tuple(tokens[i:i + len(words)]) == words:
                trailing.append(name)
                i += len(words)
                break
        else:
            if trailing:
                raise TopologyFileError(f"unexpected column {tokens[i]!r} after {trailing[-1]!r}")
            columns.append(tokens[i])
            i += 1
    return columns, trailing


def _is_header(tokens: list[str]) -> bool:
    """A header row starts with GPU0 and, unlike the GPU0 row, is not followed by ``X``."""
    return bool(tokens) and tokens[0] == "GPU0" and (len(tokens) == 1 or tokens[1] != "X")


def _find_blocks(text: str) -> list[_Block]:
    """Every matrix whose header starts with GPU0, with the rows that follow it."""
    lines = [_ANSI.sub("", line) for line in text.splitlines()]
    blocks: list[_Block] = []
    k = 0
    while k < len(lines):
        tokens = lines[k].split()
        if not _is_header(tokens):
            k += 1
            continue
        columns, trailing = _parse_header(tokens)
        block = _Block(line=k + 1, columns=columns, trailing=trailing)
        k += 1
        while k < len(lines) and lines[k].split() and lines[k].split()[0] in columns:
            row = lines[k].split()
            block.rows[row[0]] = row[1:]
            k += 1
        blocks.append(block)
    return blocks


def _check_block(block: _Block, allowed: "re.Pattern[str] | frozenset[str]") -> bool:
    """Whether all GPU-row entries of ``block`` are of the allowed kind."""
    ok = (lambda t: bool(allowed.match(t))) if isinstance(allowed, re.Pattern) else (lambda t: t in allowed)
    return all(ok(t) for name in block.rows if _GPU_COL.match(name) for t in block.entries(name))


def _gpu_rows(block: _Block) -> int:
    """Number of GPUs of a block, checking that columns and rows are GPU0..GPU{n-1}."""
    n = block.gpu_count()
    expected = [f"GPU{i}" for i in range(n)]
    if block.columns[:n] != expected:
        raise TopologyFileError(f"line {block.line}: GPU columns must come first as GPU0..GPU{n - 1}, got {block.columns[:n]}")
    for name in expected:
        if name not in block.rows:
            raise TopologyFileError(f"line {block.line}: no row for {name}")
        if len(block.rows[name]) < len(block.columns):
            raise TopologyFileError(f"line {block.line}: row {name} has {len(block.rows[name])} entries for {len(block.columns)} columns")
    return n


def _link_matrix(block: _Block, n: int) -> list[list[str]]:
    """The GPU x GPU link tokens, checked for symmetry (SOC read as SYS)."""
    m = [[("SYS" if t == "SOC" else t) for t in block.entries(f"GPU{i}")[:n]] for i in range(n)]
    for i in range(n):
        if m[i][i] != "X":
            raise TopologyFileError(f"line {block.line}: GPU{i} row must have X in column GPU{i}, got {m[i][i]!r}")
        for j in range(i):
            if m[i][j] != m[j][i]:
                raise TopologyFileError(f"line {block.line}: GPU{i}/GPU{j} is {m[i][j]} but GPU{j}/GPU{i} is {m[j][i]}")
    return m


def _nic_pairs(block: _Block, n: int, links: list[list[str]], kinds: frozenset[str]) -> list[tuple[int, int]]:
    """GPU pairs hidden by NVLink that both reach one NIC through a path of ``kinds``."""
    pairs = []
    for c, nic in enumerate(block.columns[n:], start=n):
        near = [i for i in range(n) if block.entries(f"GPU{i}")[c] in kinds]
        pairs += [(a, b) for a in near for b in near if a < b and links[a][b].startswith("NV")]
    return pairs


def _groups(block: _Block, n: int, links: list[list[str]], kinds: frozenset[str]) -> list[list[int]]:
    """GPUs joined by a path of ``kinds``, directly or through a NIC where NVLink hides the path."""
    uf = _UnionFind(n)
    for i in range(n):
        for j in range(i + 1, n):
            if links[i][j] in kinds:
                uf.union(i, j)
    for a, b in _nic_pairs(block, n, links, kinds):
        uf.union(a, b)
    return uf.groups(range(n))


def _int_or_none(value: str | None) -> int | None:
    return int(value) if value is not None and value.isdigit() else None


def _p2p_matrix(blocks: list[_Block], n: int, nvlink: list[list[int]]) -> list[list[bool]]:
    """Peer access from a ``topo -p2p`` block when present, else NVLink pairs only."""
    for block in blocks:
        if block.gpu_count() == n and _check_block(block, _P2P_CODES) and all(f"GPU{i}" in block.rows for i in range(n)):
            return [[i == j or block.entries(f"GPU{i}")[j] == "OK" for j in range(n)] for i in range(n)]
    return [[i == j or nvlink[i][j] > 0 for j in range(n)] for i in range(n)]


def parse_topo_matrix(text: str, source: str = "nvidia-smi topo -m") -> Topology:
    """The :class:`Topology` described by ``nvidia-smi topo -m`` text.

    GPU names, memory sizes and bus ids are not in that text: they read "unknown", 0 and "".
    Raises :class:`TopologyFileError` when no matrix is found or it is malformed.
    """
    blocks = _find_blocks(text)
    topo_blocks = [b for b in blocks if _check_block(b, _LINK)]
    if not topo_blocks:
        raise TopologyFileError("no `nvidia-smi topo -m` matrix found (a header row starting with GPU0, then rows GPU0 X ...)")
    block = topo_blocks[0]
    n = _gpu_rows(block)
    if n == 0:
        raise TopologyFileError(f"line {block.line}: the matrix has no GPU columns")
    links = _link_matrix(block, n)
    nvlink = [[int(t[2:]) if t.startswith("NV") else 0 for t in row] for row in links]
    paths = [["" if t.startswith("NV") else t for t in row] for row in links]
    rcs = _groups(block, n, links, SHARED_ROOT_PATHS)
    switch_groups = [g for g in _groups(block, n, links, frozenset({"PIX", "PXB"})) if len(g) > 1]
    gpus = []
    for i in range(n):
        extra = block.extra(f"GPU{i}")
        cpu = extra.get("cpu")
        gpus.append(GPU(index=i, name="unknown", memory_bytes=0, pci_bus_id="", numa_node=_int_or_none(extra.get("numa")),
                        pcie_gen=None, pcie_width=None, cpu_affinity=cpu if cpu and cpu != "N/A" else None))
    bridges = []
    for k, g in enumerate(rcs):
        numas = {gpus[i].numa_node for i in g}
        bridges.append(HostBridge(f"rc{k}", numas.pop() if len(numas) == 1 else None))
    return Topology.assemble(
        gpus, rcs, source=source, nvlink=nvlink, p2p=_p2p_matrix(blocks, n, nvlink), pcie_paths=paths,
        host_bridges=bridges, switches=[PCIeSwitch("", g) for g in switch_groups],
    )


def looks_like_topo_matrix(text: str) -> bool:
    """Whether ``text`` holds an ``nvidia-smi topo -m`` matrix header."""
    return any(_is_header(_ANSI.sub("", line).split()) for line in text.splitlines())
