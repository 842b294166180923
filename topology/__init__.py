"""GPU topology for mobius: detection, saved topologies, cross mapping and bandwidth measurement.

* :func:`detect` -- this machine's GPUs, root complexes, NVLink and peer access (NVML, sysfs, nvidia-smi).
* :func:`load_topology` -- a topology from ``mobius topo --json`` output or saved ``nvidia-smi topo -m``;
  :func:`topology_from_json` reads an already parsed JSON dict, :func:`topology_graph` gives a networkx view.
* :func:`cross_mapping` / :func:`sequential_mapping` -- stage-to-GPU mapping (Mobius eq. 12-13).
* :class:`Bandwidth` / :func:`load_bandwidth` -- the ``mobius topo --bench`` bandwidth model.

See ``topology/README.md`` for the file formats.
"""

from topology._graph import topology_graph
from topology._json import topology_from_json
from topology.bandwidth import Bandwidth, GPUBandwidth, RootComplexBandwidth, load_bandwidth, save_bandwidth
from topology.detect import apply_visible_devices, detect, load_topology
from topology.errors import TopologyFileError, TopologyUnavailable
from topology.mapping import Mapping, contention, cross_mapping, sequential_mapping
from topology.model import GPU, HostBridge, PCIeSwitch, Topology

__all__ = [
    "GPU",
    "Bandwidth",
    "GPUBandwidth",
    "HostBridge",
    "Mapping",
    "PCIeSwitch",
    "RootComplexBandwidth",
    "Topology",
    "TopologyFileError",
    "TopologyUnavailable",
    "apply_visible_devices",
    "contention",
    "cross_mapping",
    "detect",
    "load_bandwidth",
    "load_topology",
    "save_bandwidth",
    "sequential_mapping",
    "topology_from_json",
    "topology_graph",
]
