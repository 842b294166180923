"""Checked reading of JSON dicts into topology values (:func:`topology_from_json`); errors name the bad key."""

from __future__ import annotations

from typing import Any

from topology.errors import TopologyFileError
from topology.model import GPU, SCHEMA, HostBridge, PCIeSwitch, Topology

_MISSING = object()


def field_of(d: Any, key: str, kinds: type | tuple[type, ...], where: str, default: Any = _MISSING) -> Any:
    """``d[key]`` checked to be of ``kinds`` (bool is never accepted as a number).

    ``where`` is the path of ``d`` in the document (``gpus[2]``) for the error message.
    """
    if not isinstance(d, dict):
        raise TopologyFileError(f"{where or 'the document'} must be an object")
    if key not in d:
        if default is _MISSING:
            raise TopologyFileError(f"missing key {_path(where, key)!r}")
        return default
    value = d[key]
    if value is None and default is None:
        return None
    allowed = _tuple(kinds)
    if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
        raise TopologyFileError(f"key {_path(where, key)!r} must be {_kind_names(kinds)}, got {type(value).__name__} {value!r:.60}")
    return value


def _tuple(kinds: type | tuple[type, ...]) -> tuple[type, ...]:
    return kinds if isinstance(kinds, tuple) else (kinds,)


def _kind_names(kinds: type | tuple[type, ...]) -> str:
    names = {int: "an integer", float: "a number", str: "a string", list: "a list", bool: "true or false", dict: "an object"}
    return " or ".join(names.get(k, k.__name__) for k in _tuple(kinds))


def _path(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def square_matrix(value: Any, n: int, where: str, cell: type | tuple[type, ...], allow_none: bool = False) -> list[list[Any]]:
    """``value`` checked to be an n x n list of lists of ``cell`` (or null where allowed)."""
    if not isinstance(value, list) or len(value) != n or any(not isinstance(r, list) or len(r) != n for r in value):
        raise TopologyFileError(f"key {where!r} must be a {n} x {n} list of lists")
    for i, row in enumerate(value):
        for j, x in enumerate(row):
            if x is None and allow_none:
                continue
            if not isinstance(x, cell) or (isinstance(x, bool) and bool not in _tuple(cell)):
                raise TopologyFileError(f"key '{where}[{i}][{j}]' must be {_kind_names(cell)}, got {x!r:.40}")
    return value


def _gpu_from_dict(d: Any, k: int) -> GPU:
    where = f"gpus[{k}]"
    return GPU(
        index=field_of(d, "index", int, where),
        name=field_of(d, "name", str, where, "unknown"),
        memory_bytes=field_of(d, "memory_bytes", int, where, 0),
        pci_bus_id=field_of(d, "pci_bus_id", str, where, ""),
        numa_node=field_of(d, "numa_node", int, where, None),
        pcie_gen=field_of(d, "pcie_gen", int, where, None),
        pcie_width=field_of(d, "pcie_width", int, where, None),
        root_complex=field_of(d, "root_complex", int, where, -1),
        uuid=field_of(d, "uuid", str, where, None),
        cpu_affinity=field_of(d, "cpu_affinity", str, where, None),
    )


def _root_complexes(d: dict[str, Any], n: int) -> list[list[int]]:
    rcs = field_of(d, "root_complexes", list, "")
    for k, g in enumerate(rcs):
        if not isinstance(g, list) or not g or any(not isinstance(i, int) or isinstance(i, bool) for i in g):
            raise TopologyFileError(f"key 'root_complexes[{k}]' must be a non-empty list of GPU indices")
    return [list(g) for g in rcs]


def _bridges(d: dict[str, Any], count: int) -> list[HostBridge] | None:
    raw = field_of(d, "host_bridges", list, "", None)
    if raw is None:
        return None
    if len(raw) != count:
        raise TopologyFileError(f"key 'host_bridges' must have one entry per root complex ({count}), got {len(raw)}")
    return [HostBridge(field_of(h, "name", str, f"host_bridges[{k}]", ""), field_of(h, "numa_node", int, f"host_bridges[{k}]", None)) for k, h in enumerate(raw)]


def _switches(d: dict[str, Any]) -> list[PCIeSwitch]:
    out = []
    for k, s in enumerate(field_of(d, "switches", list, "", [])):
        where = f"switches[{k}]"
        gpus = field_of(s, "gpus", list, where)
        if any(not isinstance(i, int) or isinstance(i, bool) for i in gpus):
            raise TopologyFileError(f"key '{where}.gpus' must be a list of GPU indices")
        out.append(PCIeSwitch(field_of(s, "bus_id", str, where, ""), list(gpus), field_of(s, "pcie_gen", int, where, None), field_of(s, "pcie_width", int, where, None)))
    return out


def topology_from_json(d: Any) -> Topology:
    """Read :meth:`Topology.to_json` output (a ``mobius.topology/1`` dict) back into a :class:`Topology`.

    Only ``gpus`` and ``root_complexes`` are required: a hand-written planning file may give GPUs as
    ``{"index": 0}`` only (names read "unknown", memory 0). Raises :class:`TopologyFileError` naming
    the bad key.
    """
    if not isinstance(d, dict):
        raise TopologyFileError("a topology must be a JSON object")
    schema = d.get("schema", SCHEMA)
    if schema != SCHEMA:
        hint = " (a bandwidth file from `mobius topo --bench`, not a topology)" if str(schema).startswith("mobius.bandwidth") else ""
        raise TopologyFileError(f"key 'schema' is {schema!r}, expected {SCHEMA!r}{hint}")
    raw_gpus = field_of(d, "gpus", list, "")
    gpus = [_gpu_from_dict(g, k) for k, g in enumerate(raw_gpus)]
    n = len(gpus)
    rcs = _root_complexes(d, n)
    topo = Topology.assemble(
        gpus, rcs, source=field_of(d, "source", str, "", "json"),
        nvlink=square_matrix(d["nvlink"], n, "nvlink", int) if "nvlink" in d else None,
        p2p=square_matrix(d["p2p"], n, "p2p", bool) if "p2p" in d else None,
        pcie_paths=square_matrix(d["pcie_paths"], n, "pcie_paths", str) if "pcie_paths" in d else None,
        host_bridges=_bridges(d, len(rcs)), switches=_switches(d),
    )
    for g_in, g in zip(gpus, topo.gpus):
        if g_in.root_complex not in (-1, g.root_complex):
            raise TopologyFileError(f"key 'gpus[{g.index}].root_complex' is {g_in.root_complex} but root_complexes puts GPU {g.index} in {g.root_complex}")
    return topo
