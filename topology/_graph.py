"""The networkx view of a :class:`topology.model.Topology` (:func:`topology_graph`)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Callable

import networkx as nx

from topology.model import PCIeSwitch, Topology


def _switch_node(k: int, bus_id: str) -> str:
    return f"switch:{bus_id}" if bus_id else f"switch:{k}"


def _smallest_switch(topo: Topology, accept: Callable[[PCIeSwitch], bool]) -> int | None:
    """Index of the switch with the fewest GPUs among those ``accept`` takes (the nearest one)."""
    found = [(len(sw.gpus), k) for k, sw in enumerate(topo.switches) if accept(sw)]
    return min(found)[1] if found else None


def topology_graph(topo: Topology) -> nx.Graph:
    """GPUs, switches, host bridges, NUMA nodes and the system as a networkx graph, with links.

    GPU -> [switch] -> host bridge -> NUMA node -> system, plus GPU-GPU NVLink edges. Nodes are
    ``"GPU<i>"`` (kind "gpu", with the GPU's fields), ``"switch:<id>"`` (kind "switch"), host
    bridge names (kind "host_bridge"), ``"NUMA<k>"`` (kind "numa") and ``"system"`` (kind
    "system"). Edges have ``kind`` "pcie" (GPU-switch-host bridge), "node" (host bridge-NUMA node),
    "sys" (NUMA node-system) or "nvlink" (GPU-GPU, ``count`` links). ``G.graph["p2p"]`` holds the
    peer-access matrix.
    """
    g = nx.Graph(source=topo.source, p2p=[list(r) for r in topo.p2p])
    g.add_node("system", kind="system")
    for k, hb in enumerate(topo.host_bridges):
        g.add_node(hb.name, kind="host_bridge", root_complex=k, numa_node=hb.numa_node, gpus=list(topo.root_complexes[k]))
        numa = f"NUMA{hb.numa_node}" if hb.numa_node is not None else None
        if numa is None:
            g.add_edge(hb.name, "system", kind="sys")
        else:
            g.add_node(numa, kind="numa", numa_node=hb.numa_node)
            g.add_edge(hb.name, numa, kind="node")
            g.add_edge(numa, "system", kind="sys")
    names = [_switch_node(k, sw.bus_id) for k, sw in enumerate(topo.switches)]
    for k, sw in enumerate(topo.switches):
        g.add_node(names[k], kind="switch", bus_id=sw.bus_id, gpus=list(sw.gpus), pcie_gen=sw.pcie_gen, pcie_width=sw.pcie_width)
    for k, sw in enumerate(topo.switches):
        parent = _smallest_switch(topo, lambda other: set(sw.gpus) < set(other.gpus))
        up = names[parent] if parent is not None else topo.host_bridges[topo.gpus[sw.gpus[0]].root_complex].name
        g.add_edge(names[k], up, kind="pcie", pcie_gen=sw.pcie_gen, pcie_width=sw.pcie_width)
    for gpu in topo.gpus:
        node = f"GPU{gpu.index}"
        g.add_node(node, kind="gpu", **asdict(gpu))
        below = _smallest_switch(topo, lambda other: gpu.index in other.gpus)
        up = names[below] if below is not None else topo.host_bridges[gpu.root_complex].name
        g.add_edge(node, up, kind="pcie", pcie_gen=gpu.pcie_gen, pcie_width=gpu.pcie_width)
    n = topo.num_gpus
    for i in range(n):
        for j in range(i + 1, n):
            if topo.nvlink[i][j] > 0:
                g.add_edge(f"GPU{i}", f"GPU{j}", kind="nvlink", count=topo.nvlink[i][j])
    return g
