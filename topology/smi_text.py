"""Parse the text of ``nvidia-smi topo -m`` (optionally followed by ``nvidia-smi topo -p2p r``).

The matrix has a header row ``GPU0 GPU1 ... [NIC0 ... | mlx5_0 ...] CPU Affinity [NUMA Affinity]
[GPU NUMA ID]`` and one row per device. Entries are ``X`` (self), ``PIX``, ``PXB``, ``PHB``, ``NODE``,
``SYS`` (``SOC`` in old drivers) or ``NV#`` (# bonded NVLinks, which hides the PCIe path of that
pair). Columns may be separated by tabs (as nvidia-smi prints) or spaces (as pasted into issues);
terminal colour codes are removed. The Legend block and anything else is ignored.

Device columns (GPUs, then NICs or other devices) are the leading entries of the GPU rows that are
link types; their number is read from the rows, so the header only has to name them. The per-GPU
columns after them are read loosely, since pasted matrices are often trimmed or edited:
``CPU Affinity`` (or ``CPU``) gives the CPU list, ``NUMA Affinity`` (or ``NUMA``) the NUMA node,
and ``GPU NUMA ID`` (or ``GPU NUMA``; the node of the GPU's own memory on Grace systems, not the
host node its PCIe link hangs off) is recognised but not used. Any other column is skipped with a
warning naming it. Values are matched to names by position; when the GPU rows hold more or fewer
values than the header names, they are read from the left (a trimmed paste loses columns at the
right), up to the first unknown column, with a warning.

Root complexes: GPUs linked by PIX, PXB or PHB share one. Where NVLink hides the PCIe path of a
pair, a NIC column can still tell: two GPUs that both reach one NIC without leaving a host bridge
(PIX/PXB/PHB) are under that host bridge. Without such evidence the pair is kept apart.

Peer access is not part of ``topo -m``; a ``topo -p2p r`` block in the same text (entries ``OK``,
``CNS``, ``GNS``, ``TNS``, ``NS``, ``DR``, ``U``) supplies it. Without one, NVLink pairs are taken as
peer-capable and PCIe pairs as not (the safe assumption for consumer GPUs).

Malformed text (no matrix, GPU rows that disagree on their device columns, an asymmetric matrix)
raises :class:`TopologyFileError` naming the line.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

from topology.errors import TopologyFileError
from topology.model import GPU, SHARED_ROOT_PATHS, HostBridge, PCIeSwitch, Topology, _UnionFind

log = logging.getLogger(__name__)

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_LINK = re.compile(r"^(X|PIX|PXB|PHB|NODE|SYS|SOC|NV\d+)$")
_LINK_NAMES = "X, PIX, PXB, PHB, NODE, SYS or NV#"
_P2P_CODES = frozenset({"X", "OK", "CNS", "GNS", "TNS", "NS", "DR", "U"})
_GPU_COL = re.compile(r"^GPU(\d+)$")
_FIELD_SEP = re.compile(r"\t+| {2,}")
# Per-GPU columns after the device columns: header words (the last may be cut short) -> kind.
_KNOWN_COLUMNS = (
    (("GPU", "NUMA", "ID"), "gpu_numa"),
    (("GPU", "NUMA"), "gpu_numa"),
    (("CPU", "AFFINITY"), "cpu"),
    (("NUMA", "AFFINITY"), "numa"),
    (("CPU",), "cpu"),
    (("NUMA",), "numa"),
)
_VALUE_SHAPES = {"cpu": re.compile(r"^\d+(-\d+)?(,\d+(-\d+)?)*$"), "numa": re.compile(r"^\d+([-,]\d+)*$"),
                 "gpu_numa": re.compile(r"^\d+$")}
_KIND_NAMES = {"cpu": "a CPU list", "numa": "a NUMA node", "gpu_numa": "a NUMA id"}


@dataclass
class _Row:
    """One device row: its 1-based line number and the entries after the row name."""

    line: int
    tokens: list[str]


@dataclass
class _Block:
    """One matrix found in the text: the header line (colour codes removed) and the rows below it."""

    line: int
    header: str
    words: list[str]
    rows: dict[str, _Row] = field(default_factory=dict)

    def row(self, i: int) -> _Row:
        """The row of GPU ``i``."""
        return self.rows[f"GPU{i}"]

    def gpu_rows(self) -> list[tuple[str, _Row]]:
        """The rows named GPU<k>, in text order."""
        return [(name, r) for name, r in self.rows.items() if _GPU_COL.match(name)]


@dataclass
class _Column:
    """A per-GPU column after the device columns, as the header names it; ``kind`` None: unknown."""

    name: str
    kind: str | None


def _is_header(tokens: list[str]) -> bool:
    """A header row starts with GPU0 and, unlike the GPU0 row, is not followed by ``X``."""
    return bool(tokens) and tokens[0] == "GPU0" and (len(tokens) == 1 or tokens[1] != "X")


def _find_blocks(text: str) -> list[_Block]:
    """Every matrix whose header starts with GPU0, with the rows (named in the header) that follow it."""
    lines = [_ANSI.sub("", line) for line in text.splitlines()]
    blocks: list[_Block] = []
    k = 0
    while k < len(lines):
        words = lines[k].split()
        if not _is_header(words):
            k += 1
            continue
        block = _Block(line=k + 1, header=lines[k], words=words)
        k += 1
        while k < len(lines) and lines[k].split() and lines[k].split()[0] in words:
            tokens = lines[k].split()
            block.rows[tokens[0]] = _Row(k + 1, tokens[1:])
            k += 1
        blocks.append(block)
    return blocks


def _is_p2p(block: _Block) -> bool:
    """Whether ``block`` is a ``topo -p2p`` matrix (every GPU-row entry a peer-access code)."""
    rows = block.gpu_rows()
    return bool(rows) and all(t in _P2P_CODES for _, r in rows for t in r.tokens)


def _leading_links(tokens: list[str]) -> int:
    """How many entries at the start of a row are link types."""
    k = 0
    while k < len(tokens) and _LINK.match(tokens[k]):
        k += 1
    return k


def _device_count(block: _Block) -> int:
    """Number of device columns: the link entries that lead the GPU rows, checked to agree."""
    rows = block.gpu_rows()
    if not rows:
        raise TopologyFileError(f"line {block.line}: a header row but no GPU rows below it")
    runs = {name: _leading_links(r.tokens) for name, r in rows}
    count = max(runs.values())
    if count == 0:
        name, r = rows[0]
        raise TopologyFileError(f"line {r.line}: row {name} starts with {r.tokens[:1] or 'nothing'}, not a link type ({_LINK_NAMES})")
    for name, r in rows:
        k = runs[name]
        if k < count:
            column = block.words[k] if k < len(block.words) else f"column {k + 1}"
            got = f"has {r.tokens[k]!r}" if k < len(r.tokens) else "has no entry"
            raise TopologyFileError(f"line {r.line}: row {name} {got} under {column}, where the other GPU rows have "
                                    f"{count} link entries ({_LINK_NAMES})")
    if len(block.words) < count:
        raise TopologyFileError(f"line {block.line}: the header names {len(block.words)} column(s) "
                                f"but the GPU rows have {count} link entries")
    return count


def _gpu_count(block: _Block, devices: int) -> int:
    """Number of GPUs, checking that the device columns start GPU0..GPU{n-1} and each has a row."""
    names = block.words[:devices]
    n = sum(1 for c in names if _GPU_COL.match(c))
    expected = [f"GPU{i}" for i in range(n)]
    if names[:n] != expected:
        raise TopologyFileError(f"line {block.line}: GPU columns must come first as GPU0..GPU{n - 1}, got {names[:n]}")
    beyond = [w for w in block.words[devices:] if _GPU_COL.match(w)]
    if beyond:
        raise TopologyFileError(f"line {block.line}: the header names {beyond[0]} but the GPU rows have only {devices} link entries")
    for name in expected:
        if name not in block.rows:
            raise TopologyFileError(f"line {block.line}: no row for {name}")
    return n


def _link_matrix(block: _Block, n: int) -> list[list[str]]:
    """The GPU x GPU link tokens, checked for X on the diagonal only and symmetry (SOC read as SYS)."""
    m = [[("SYS" if t == "SOC" else t) for t in block.row(i).tokens[:n]] for i in range(n)]
    for i in range(n):
        line = block.row(i).line
        if m[i][i] != "X":
            raise TopologyFileError(f"line {line}: GPU{i} row must have X in column GPU{i}, got {m[i][i]!r}")
        for j in range(i):
            if m[i][j] == "X":
                raise TopologyFileError(f"line {line}: GPU{i}/GPU{j} is X, which only the diagonal may be")
            if m[i][j] != m[j][i]:
                raise TopologyFileError(f"line {line}: GPU{i}/GPU{j} is {m[i][j]} but GPU{j}/GPU{i} is {m[j][i]} "
                                        f"(line {block.row(j).line})")
    return m


def _known_at(words: list[str], i: int) -> tuple[int, str] | None:
    """(number of words, kind) of the known column name starting at ``words[i]``, if any."""
    for pattern, kind in _KNOWN_COLUMNS:
        got = [w.upper() for w in words[i:i + len(pattern)]]
        if len(got) == len(pattern) and got[:-1] == list(pattern[:-1]) and (
                got[-1] == pattern[-1] or (len(got[-1]) >= 3 and pattern[-1].startswith(got[-1]))):
            return len(pattern), kind
    return None


def _name_columns(words: list[str]) -> list[_Column]:
    """The columns one header field names: known names, and each run of other words as one unknown column."""
    out: list[_Column] = []
    unknown: list[str] = []
    i = 0
    while i < len(words):
        known = _known_at(words, i)
        if known is None:
            unknown.append(words[i])
            i += 1
            continue
        if unknown:
            out.append(_Column(" ".join(unknown), None))
            unknown = []
        out.append(_Column(" ".join(words[i:i + known[0]]), known[1]))
        i += known[0]
    if unknown:
        out.append(_Column(" ".join(unknown), None))
    return out


def _trailing_columns(block: _Block, devices: int) -> list[_Column]:
    """The columns the header names after its ``devices`` device columns (fields split at tabs / 2+ spaces)."""
    m = re.match(r"\s*(?:\S+(?:\s+|$)){%d}" % devices, block.header)
    rest = block.header[m.end():] if m else ""
    return [c for f in _FIELD_SEP.split(rest.strip()) if f.strip() for c in _name_columns(f.split())]


def _affinities(block: _Block, n: int, devices: int, origin: str) -> list[dict[str, str]]:
    """Per GPU, its recognised per-GPU values by kind ("cpu", "numa", "gpu_numa"); warns about what is skipped."""
    columns = _trailing_columns(block, devices)
    notes: dict[str, str] = {}
    unknown = [c.name for c in columns if c.kind is None]
    if unknown:
        notes["unknown"] = (f"skipping column(s) {', '.join(map(repr, unknown))} after the device columns "
                            "(only CPU Affinity, NUMA Affinity and GPU NUMA ID are read)")
    out = []
    for i in range(n):
        row = block.row(i)
        values = row.tokens[devices:]
        usable = columns
        if len(values) != len(columns):
            usable = columns[:next((k for k, c in enumerate(columns) if c.kind is None), len(columns))]
            notes.setdefault("count", f"row GPU{i} (line {row.line}) has {len(values)} value(s) after the device columns "
                                      f"but the header names {len(columns)} ({', '.join(c.name for c in columns) or 'none'}); "
                                      f"reading {', '.join(c.name for c in usable[:len(values)]) or 'none'} from the left")
        out.append(_row_values(usable, values, row, i, notes))
    for note in notes.values():
        log.warning("%s: line %d: %s", origin, block.line, note)
    return out


def _row_values(columns: list[_Column], values: list[str], row: _Row, i: int, notes: dict[str, str]) -> dict[str, str]:
    """The values of one GPU row under known columns; ``N/A`` and misshapen values are dropped (noted)."""
    got = {}
    for c, v in zip(columns, values):
        if c.kind is None or v == "N/A":
            continue
        if _VALUE_SHAPES[c.kind].match(v):
            got[c.kind] = v
        else:
            notes.setdefault(f"shape:{c.name}", f"ignoring values under {c.name!r} that are not {_KIND_NAMES[c.kind]}, "
                                                f"e.g. {v!r} in row GPU{i} (line {row.line})")
    return got


def _nic_pairs(block: _Block, n: int, devices: int, links: list[list[str]], kinds: frozenset[str]) -> list[tuple[int, int]]:
    """GPU pairs hidden by NVLink that both reach one NIC (device column after the GPUs) through a path of ``kinds``."""
    pairs = []
    for c in range(n, devices):
        near = [i for i in range(n) if block.row(i).tokens[c] in kinds]
        pairs += [(a, b) for a in near for b in near if a < b and links[a][b].startswith("NV")]
    return pairs


def _groups(block: _Block, n: int, devices: int, links: list[list[str]], kinds: frozenset[str]) -> list[list[int]]:
    """GPUs joined by a path of ``kinds``, directly or through a NIC where NVLink hides the path."""
    uf = _UnionFind(n)
    for i in range(n):
        for j in range(i + 1, n):
            if links[i][j] in kinds:
                uf.union(i, j)
    for a, b in _nic_pairs(block, n, devices, links, kinds):
        uf.union(a, b)
    return uf.groups(range(n))


def _p2p_matrix(blocks: list[_Block], n: int, nvlink: list[list[int]]) -> list[list[bool]]:
    """Peer access from a ``topo -p2p`` block of the same GPUs when present, else NVLink pairs only."""
    expected = [f"GPU{i}" for i in range(n)]
    for block in blocks:
        if (_is_p2p(block) and [w for w in block.words if _GPU_COL.match(w)] == expected
                and all(name in block.rows and len(block.rows[name].tokens) >= n for name in expected)):
            return [[i == j or block.row(i).tokens[j] == "OK" for j in range(n)] for i in range(n)]
    return [[i == j or nvlink[i][j] > 0 for j in range(n)] for i in range(n)]


def _gpus(values: list[dict[str, str]]) -> list[GPU]:
    """GPU records from the per-GPU values (names, memory and bus ids are not in the text)."""
    return [GPU(index=i, name="unknown", memory_bytes=0, pci_bus_id="", pcie_gen=None, pcie_width=None,
                numa_node=int(v["numa"]) if v.get("numa", "").isdigit() else None, cpu_affinity=v.get("cpu"))
            for i, v in enumerate(values)]


def parse_topo_matrix(text: str, source: str = "nvidia-smi topo -m", origin: str | None = None) -> Topology:
    """The :class:`Topology` described by ``nvidia-smi topo -m`` text.

    GPU names, memory sizes and bus ids are not in that text: they read "unknown", 0 and "".
    ``origin`` (default ``source``) names the text in warnings, e.g. the file it came from. Raises
    :class:`TopologyFileError` when no matrix is found or it is malformed.
    """
    blocks = _find_blocks(text)
    if not blocks:
        raise TopologyFileError("no `nvidia-smi topo -m` matrix found (a header row starting with GPU0, then rows GPU0 X ...)")
    block = next((b for b in blocks if not _is_p2p(b)), blocks[0])
    devices = _device_count(block)
    n = _gpu_count(block, devices)
    links = _link_matrix(block, n)
    nvlink = [[int(t[2:]) if t.startswith("NV") else 0 for t in row] for row in links]
    paths = [["" if t.startswith("NV") else t for t in row] for row in links]
    rcs = _groups(block, n, devices, links, SHARED_ROOT_PATHS)
    switch_groups = [g for g in _groups(block, n, devices, links, frozenset({"PIX", "PXB"})) if len(g) > 1]
    gpus = _gpus(_affinities(block, n, devices, origin or source))
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
