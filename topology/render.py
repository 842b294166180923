"""Plain-text tables for ``mobius topo`` (strings only; the command prints them)."""

from __future__ import annotations

from typing import Sequence

from topology.bandwidth import Bandwidth
from topology.mapping import Mapping
from topology.model import GiB, Topology


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Left-aligned columns separated by two spaces."""
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[k]) for r in cells) for k in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def _opt(value: object, fmt: str = "{}") -> str:
    return "?" if value is None else fmt.format(value)


def _pcie(gen: int | None, width: int | None) -> str:
    if gen is None and width is None:
        return "?"
    return f"gen{_opt(gen)} x{_opt(width)}"


def format_gpus(topo: Topology) -> str:
    """One row per GPU: name, memory, bus id, NUMA node, PCIe link, root complex."""
    rows = []
    for g in topo.gpus:
        mem = f"{g.memory_bytes / GiB:.1f} GiB" if g.memory_bytes else "?"
        rc = f"{g.root_complex} ({topo.host_bridges[g.root_complex].name})"
        rows.append([g.index, g.name, mem, g.pci_bus_id or "?", _opt(g.numa_node), _pcie(g.pcie_gen, g.pcie_width), rc])
    return table(["GPU", "Name", "Memory", "PCI bus id", "NUMA", "PCIe", "Root complex"], rows)


def format_root_complexes(topo: Topology) -> str:
    """Root complexes with their GPUs and the switches below them."""
    lines = ["Root complexes (GPUs of one share its PCIe bandwidth to host memory):"]
    for k, (group, hb) in enumerate(zip(topo.root_complexes, topo.host_bridges)):
        lines.append(f"  RC{k} {hb.name}  NUMA {_opt(hb.numa_node)}  GPUs {', '.join(map(str, group))}")
        for s in topo.switches:
            if s.gpus and s.gpus[0] in group:
                uplink = f", uplink {_pcie(s.pcie_gen, s.pcie_width)}" if s.pcie_gen or s.pcie_width else ""
                lines.append(f"      switch {s.bus_id or '(inferred)'}: GPUs {', '.join(map(str, s.gpus))}{uplink}")
    return "\n".join(lines)


def format_matrix(topo: Topology, cell: str) -> str:
    """GPU x GPU matrix of links (``cell="link"``) or peer access (``cell="p2p"``)."""
    n = topo.num_gpus
    head = [""] + [f"GPU{j}" for j in range(n)]
    rows = []
    for i in range(n):
        if cell == "link":
            vals = [topo.link_label(i, j) for j in range(n)]
        else:
            vals = ["X" if i == j else ("yes" if topo.p2p[i][j] else "no") for j in range(n)]
        rows.append([f"GPU{i}"] + vals)
    return table(head, rows)


def format_topology(topo: Topology) -> str:
    """The full ``mobius topo`` report."""
    nv = "every pair (NVLink/NVSwitch)" if topo.has_nvlink else ("some pairs" if any(any(r) for r in topo.nvlink) else "none")
    parts = [
        f"{topo.num_gpus} GPU(s), {len(topo.root_complexes)} root complex(es); source: {topo.source}",
        format_gpus(topo),
        format_root_complexes(topo),
        "Links (X self, NV# NVLinks, PIX/PXB one switch tree, PHB one host bridge, NODE/SYS other root complex):\n"
        + format_matrix(topo, "link"),
        f"NVLink: {nv}",
        "Peer access (P2P):\n" + format_matrix(topo, "p2p"),
    ]
    return "\n\n".join(parts)


def format_mapping(m: Mapping) -> str:
    """Cross mapping: GPU of each worker and stage, contention beside the sequential mapping's."""
    lines = [f"Cross mapping of {m.num_stages} stage(s) onto {len(m.worker_gpus)} GPU(s) ({m.method} search):",
             "  worker -> GPU: " + "  ".join(f"{k}->{g}" for k, g in enumerate(m.worker_gpus)),
             "  stage -> GPU: " + " ".join(f"{j}:{g}" for j, g in enumerate(m.stage_gpus()))]
    change = f" ({m.reduction:.0%} less)" if m.sequential_contention > 0 else ""
    lines.append(f"  contention (eq. 13): {m.contention:.3f}; sequential mapping: {m.sequential_contention:.3f}{change}")
    return "\n".join(lines)


def format_streams(bw: Bandwidth) -> str | None:
    """Aggregate rate of k concurrent copy streams per root complex and direction; None when not measured."""
    rows = [[",".join(map(str, r.gpus)), label, *(f"{x:.1f}" for x in rates)]
            for r in bw.root_complexes
            for label, rates in (("H2D", r.h2d_total_GBps_by_streams), ("D2H", r.d2h_total_GBps_by_streams)) if rates]
    if not rows:
        return None
    k_max = max(len(r) for r in rows) - 2
    padded = [r + [""] * (k_max + 2 - len(r)) for r in rows]
    return ("k copy streams at once, dealt round-robin over the root complex's GPUs: aggregate GB/s\n"
            + table(["GPUs", "", *(f"k={k}" for k in range(1, k_max + 1))], padded))


def format_bandwidth(bw: Bandwidth) -> str:
    """Per-GPU, per-root-complex (all GPUs, then k streams) and peer-copy tables of a benchmark."""
    gpu_rows = [[g.index, g.name, f"{g.h2d_GBps:.1f}", f"{g.d2h_GBps:.1f}", f"{g.bidir_GBps:.1f}"] for g in bw.gpus]
    rc_rows = [[",".join(map(str, r.gpus)), f"{r.h2d_concurrent_GBps_per_gpu:.1f}", f"{r.d2h_concurrent_GBps_per_gpu:.1f}",
                f"{r.h2d_total_GBps:.1f}", f"{r.d2h_total_GBps:.1f}"] for r in bw.root_complexes]
    n = bw.num_gpus
    peer = [[f"GPU{i}"] + ["X" if i == j else ("-" if x is None else f"{x:.1f}") for j, x in enumerate(row)]
            for i, row in enumerate(bw.p2p_GBps)]
    parts = [
        f"Pinned copies of {bw.buffer_bytes / (1 << 20):.0f} MiB on {bw.host} (torch {bw.torch}), GB/s:",
        table(["GPU", "Name", "H2D", "D2H", "both at once"], gpu_rows),
        "All GPUs of a root complex at once, GB/s:\n"
        + table(["GPUs", "H2D per GPU", "D2H per GPU", "H2D total", "D2H total"], rc_rows),
        format_streams(bw),
        "Peer copies row -> column, GB/s ('-' not allowed):\n" + table([""] + [f"GPU{j}" for j in range(n)], peer),
    ]
    return "\n\n".join(p for p in parts if p is not None)
