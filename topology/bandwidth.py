"""The measured bandwidth model: what ``mobius topo --bench`` writes and partition/ reads.

Schema ``"mobius.bandwidth/1"`` (one JSON object; GB/s are 10^9 bytes per second)::

    {
      "schema": "mobius.bandwidth/1",
      "measured_at": "2025-01-31T12:00:00+00:00",   # ISO 8601, UTC
      "host": "box1",                               # hostname
      "torch": "2.5.1+cu124",                       # torch version used to measure
      "buffer_bytes": 268435456,                    # size of each copy
      "gpus": [                                     # one per GPU, index = CUDA index
        {"index": 0, "name": "NVIDIA GeForce RTX 3090",
         "h2d_GBps": 12.1,      # pinned host -> this GPU, alone
         "d2h_GBps": 13.0,      # this GPU -> pinned host, alone
         "bidir_GBps": 20.2}    # both directions at once on this GPU, sum of the two
      ],
      "root_complexes": [                           # one per CPU root complex (GPU groups)
        {"gpus": [0, 1],
         "h2d_concurrent_GBps_per_gpu": 6.1,   # rate of the slowest GPU while all GPUs of the group
         "d2h_concurrent_GBps_per_gpu": 6.4,   # upload (download) at once = total / len(gpus)
         "h2d_total_GBps": 12.2,               # the group's aggregate upload rate
         "d2h_total_GBps": 12.8,
         "h2d_total_GBps_by_streams": [12.1, 12.2],  # optional: aggregate rate of k = 1, 2, ...
         "d2h_total_GBps_by_streams": [13.0, 12.8]}  # concurrent copy streams (index k - 1)
      ],
      "p2p_GBps": [[null, 9.8], [9.7, null]]        # N x N, GPU i -> GPU j; null where peer copies
    }                                               # are not allowed, not measured, or i == j

A root complex of one GPU gets its single-GPU figures as concurrent figures (nothing to share).

``*_total_GBps_by_streams[k - 1]`` is the aggregate rate of k copy streams running at once, dealt
round-robin over the group's GPUs (stream s on ``gpus[s % len(gpus)]``), for k = 1 ..
``max(len(gpus), 2)``: a one-GPU group also gets k = 2 (two streams on that GPU: do its copy
engines share the link?). For groups of two or more GPUs, ``*_total_GBps`` equals the entry at
k = ``len(gpus)``. Files written before these keys existed lack them and stay valid.
Readers must ignore keys they do not know; new keys may be added without changing the schema name.

How partition/ uses it: a stage upload on GPU g while k GPUs of its root complex upload runs at
about ``min(h2d_GBps[g], total(k) / k)``, where ``total(k)`` is the measured aggregate of k streams
(:meth:`RootComplexBandwidth.aggregate_GBps`; ``h2d_total_GBps`` in older files);
:meth:`Bandwidth.upload_GBps` gives that estimate (and :meth:`Bandwidth.download_GBps` the same for
downloads). Activations between GPUs go peer to peer at ``p2p_GBps[i][j]`` when not null, else
through host memory (a download then an upload).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from topology._json import field_of, square_matrix
from topology.errors import TopologyFileError

SCHEMA = "mobius.bandwidth/1"
DIRECTIONS = ("h2d", "d2h")  # host -> GPU, GPU -> host
_NUM = (int, float)
_BY_STREAMS = tuple(f"{d}_total_GBps_by_streams" for d in DIRECTIONS)


@dataclass
class GPUBandwidth:
    """Pinned host<->GPU rates of one GPU measured alone (GB/s)."""

    index: int
    name: str
    h2d_GBps: float
    d2h_GBps: float
    bidir_GBps: float


@dataclass
class RootComplexBandwidth:
    """Rates while GPUs of one root complex copy at once (GB/s).

    ``h2d_total_GBps_by_streams[k - 1]`` (``d2h_...`` likewise) is the aggregate rate of k
    concurrent copy streams dealt round-robin over ``gpus``; empty when the file predates them.
    """

    gpus: list[int]
    h2d_concurrent_GBps_per_gpu: float
    d2h_concurrent_GBps_per_gpu: float
    h2d_total_GBps: float
    d2h_total_GBps: float
    h2d_total_GBps_by_streams: list[float] = field(default_factory=list)
    d2h_total_GBps_by_streams: list[float] = field(default_factory=list)

    def aggregate_GBps(self, direction: str, streams: int) -> float:
        """Aggregate rate of ``streams`` concurrent copies in ``direction`` ("h2d" or "d2h") on this root complex.

        The measured figure for that many streams; beyond the measured range, the one for the most
        streams measured; without per-stream figures (older files), the all-GPUs total.
        """
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
        if streams < 1:
            raise ValueError(f"the number of streams must be >= 1, got {streams}")
        measured = getattr(self, f"{direction}_total_GBps_by_streams")
        if measured:
            return measured[min(streams, len(measured)) - 1]
        return getattr(self, f"{direction}_total_GBps")


@dataclass
class Bandwidth:
    """A ``mobius.bandwidth/1`` document (see the module docstring for every field)."""

    measured_at: str
    host: str
    torch: str
    buffer_bytes: int
    gpus: list[GPUBandwidth]
    root_complexes: list[RootComplexBandwidth]
    p2p_GBps: list[list[float | None]]
    schema: str = SCHEMA

    @property
    def num_gpus(self) -> int:
        """Number of GPUs measured."""
        return len(self.gpus)

    def root_complex_of(self, gpu: int) -> RootComplexBandwidth:
        """The root complex entry that holds ``gpu``."""
        for rc in self.root_complexes:
            if gpu in rc.gpus:
                return rc
        raise KeyError(f"GPU {gpu} is in no root complex of this bandwidth file")

    def upload_GBps(self, gpu: int, concurrent: int = 1) -> float:
        """Estimated host->GPU rate of ``gpu`` while ``concurrent`` GPUs of its root complex upload."""
        alone = self.gpus[gpu].h2d_GBps
        return alone if concurrent <= 1 else min(alone, self.root_complex_of(gpu).aggregate_GBps("h2d", concurrent) / concurrent)

    def download_GBps(self, gpu: int, concurrent: int = 1) -> float:
        """Estimated GPU->host rate of ``gpu`` while ``concurrent`` GPUs of its root complex download."""
        alone = self.gpus[gpu].d2h_GBps
        return alone if concurrent <= 1 else min(alone, self.root_complex_of(gpu).aggregate_GBps("d2h", concurrent) / concurrent)

    def p2p(self, src: int, dst: int) -> float | None:
        """Peer copy rate src -> dst, or None where peer copies are not allowed or not measured."""
        return self.p2p_GBps[src][dst]

    def to_json(self) -> dict[str, Any]:
        """The JSON-ready dict, keys in schema order (per-stream lists left out when not measured)."""
        d = asdict(self)
        for rc in d["root_complexes"]:
            for key in _BY_STREAMS:
                if not rc[key]:
                    del rc[key]
        return {"schema": d.pop("schema"), **d}

    @classmethod
    def from_json(cls, d: Any) -> "Bandwidth":
        """Read and check a ``mobius.bandwidth/1`` dict; errors name the bad key."""
        schema = field_of(d, "schema", str, "")
        if schema != SCHEMA:
            raise TopologyFileError(f"key 'schema' is {schema!r}, expected {SCHEMA!r}")
        gpus = [_gpu(g, k) for k, g in enumerate(field_of(d, "gpus", list, ""))]
        n = len(gpus)
        if n == 0 or [g.index for g in gpus] != list(range(n)):
            raise TopologyFileError(f"key 'gpus' must list GPUs with index 0..{max(n - 1, 0)} in order")
        rcs = [_rc(r, k, n) for k, r in enumerate(field_of(d, "root_complexes", list, ""))]
        flat = sorted(i for r in rcs for i in r.gpus)
        if flat != list(range(n)):
            raise TopologyFileError(f"key 'root_complexes' must hold each GPU index 0..{n - 1} exactly once, got {[r.gpus for r in rcs]}")
        p2p = square_matrix(field_of(d, "p2p_GBps", list, ""), n, "p2p_GBps", _NUM, allow_none=True)
        return cls(
            measured_at=field_of(d, "measured_at", str, ""), host=field_of(d, "host", str, ""), torch=field_of(d, "torch", str, ""),
            buffer_bytes=_positive(d, "buffer_bytes", "", int), gpus=gpus, root_complexes=rcs,
            p2p_GBps=[[None if x is None else float(x) for x in row] for row in p2p],
        )


def _positive(d: Any, key: str, where: str, kind: type | tuple[type, ...] = _NUM) -> Any:
    value = field_of(d, key, kind, where)
    if value <= 0:
        raise TopologyFileError(f"key {(where + '.' if where else '') + key!r} must be > 0, got {value}")
    return value


def _gpu(d: Any, k: int) -> GPUBandwidth:
    where = f"gpus[{k}]"
    return GPUBandwidth(field_of(d, "index", int, where), field_of(d, "name", str, where),
                        *(float(_positive(d, key, where)) for key in ("h2d_GBps", "d2h_GBps", "bidir_GBps")))


def _rc(d: Any, k: int, n: int) -> RootComplexBandwidth:
    where = f"root_complexes[{k}]"
    gpus = field_of(d, "gpus", list, where)
    if not gpus or any(not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < n for i in gpus):
        raise TopologyFileError(f"key '{where}.gpus' must be a non-empty list of GPU indices 0..{n - 1}")
    keys = ("h2d_concurrent_GBps_per_gpu", "d2h_concurrent_GBps_per_gpu", "h2d_total_GBps", "d2h_total_GBps")
    return RootComplexBandwidth(list(gpus), *(float(_positive(d, key, where)) for key in keys),
                                *(_rates(d, key, where) for key in _BY_STREAMS))


def _rates(d: Any, key: str, where: str) -> list[float]:
    """An optional list of positive rates; missing or null reads as empty."""
    values = field_of(d, key, list, where, None)
    for k, x in enumerate(values or []):
        if not isinstance(x, _NUM) or isinstance(x, bool) or x <= 0:
            raise TopologyFileError(f"key '{where}.{key}[{k}]' must be a number > 0, got {x!r:.40}")
    return [float(x) for x in values or []]


def load_bandwidth(path: str | Path) -> Bandwidth:
    """Read a bandwidth file written by ``mobius topo --bench``; errors name the file and the key."""
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise TopologyFileError(f"{p}: no such file (write one with `mobius topo --bench --bench-out {p}`)") from None
    except OSError as e:
        raise TopologyFileError(f"{p}: cannot be read ({e.strerror or e})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TopologyFileError(f"{p}: not valid JSON ({e})") from None
    try:
        return Bandwidth.from_json(data)
    except TopologyFileError as e:
        raise TopologyFileError(f"{p}: {e}") from None


def save_bandwidth(bw: Bandwidth, path: str | Path) -> Path:
    """Write ``bw`` as indented JSON; returns the path."""
    p = Path(path)
    p.write_text(json.dumps(bw.to_json(), indent=2) + "\n", encoding="utf-8")
    return p
