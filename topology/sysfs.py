"""Read the PCIe tree from Linux sysfs, the way NCCL walks it.

Each PCI device ``/sys/bus/pci/devices/<bus id>`` is a link to its place in the tree, e.g.
``/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:08.0/0000:03:00.0``: the first
component is the host bridge (one CPU root complex), the next the root port, then pairs of PCIe
switch ports (upstream port, downstream port), and last the device itself. Each device directory
has ``vendor``, ``class``, ``device``, ``numa_node`` (-1 when the firmware does not say),
``max_link_speed`` ("8.0 GT/s PCIe") and ``max_link_width`` ("16"), and ``local_cpulist``.

Paths between two GPUs follow ``nvidia-smi``: PIX (both directly below one switch), PXB (below one
switch tree, through more than one switch, or one root port), PHB (same host bridge), NODE (other
host bridge, same NUMA node) and SYS (other NUMA node).

All functions take the sysfs root as an argument so tests can point them at a fake tree. Where
``<root>/bus/pci/devices`` is missing, ``<root>/devices/pci*`` is walked instead.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

from topology.errors import TopologyUnavailable
from topology.model import GPU, HostBridge, PCIeSwitch, Topology

log = logging.getLogger(__name__)

NVIDIA_VENDOR = 0x10DE
_GPU_CLASSES = (0x0300, 0x0302)  # VGA controller, 3D controller (class >> 8)
_HOST_BRIDGE = re.compile(r"^pci[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}$")
_BDF = re.compile(r"^([0-9a-fA-F]{4,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$")
_SPEED_TO_GEN = {2.5: 1, 5.0: 2, 8.0: 3, 16.0: 4, 32.0: 5, 64.0: 6}


def normalize_bus_id(bus_id: str) -> str:
    """``00000000:01:00.0`` (NVML) or ``0000:01:00.0`` -> ``0000:01:00.0`` (lower case, 4-digit domain)."""
    m = _BDF.match(bus_id.strip())
    if not m:
        return bus_id.strip().lower()
    domain, bus, dev, fn = m.groups()
    return f"{int(domain, 16):04x}:{bus.lower()}:{dev.lower()}.{fn}"


def link_gen(speed: str | None) -> int | None:
    """PCIe generation from a ``max_link_speed`` text such as ``"16.0 GT/s PCIe"`` (None if unknown)."""
    if not speed:
        return None
    m = re.match(r"\s*([0-9.]+)\s*GT/s", speed)
    return _SPEED_TO_GEN.get(float(m.group(1))) if m else None


@dataclass(frozen=True)
class PciDevice:
    """One PCI function and its chain from the host bridge (``chain[0]``) to itself (``chain[-1]``)."""

    bus_id: str
    chain: tuple[str, ...]
    vendor: int | None
    pci_class: int | None
    device_id: int | None
    numa_node: int | None
    gen: int | None
    width: int | None
    cpulist: str | None

    @property
    def host_bridge(self) -> str:
        """The host bridge (root complex) this device hangs off, e.g. ``pci0000:00``."""
        return self.chain[0]

    @property
    def is_nvidia_gpu(self) -> bool:
        """NVIDIA vendor id and a VGA or 3D controller class (not audio functions or NVSwitches)."""
        return self.vendor == NVIDIA_VENDOR and self.pci_class is not None and (self.pci_class >> 8) in _GPU_CLASSES


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _hex(text: str | None) -> int | None:
    try:
        return int(text, 16) if text else None
    except ValueError:
        return None


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text else None
    except ValueError:
        return None


def _device_paths(root: Path) -> list[Path]:
    """Real paths of all PCI devices: from ``bus/pci/devices`` links, else by walking ``devices``."""
    bus = root / "bus" / "pci" / "devices"
    if bus.is_dir():
        return [p.resolve() for p in sorted(bus.iterdir())]
    found: list[Path] = []
    stack = [p for p in (root / "devices").glob("pci*") if _HOST_BRIDGE.match(p.name)]
    while stack:
        d = stack.pop()
        for child in d.iterdir():
            if _BDF.match(child.name) and child.is_dir() and not child.is_symlink():
                found.append(child)
                stack.append(child)
    return sorted(found)


def _chain(path: Path) -> tuple[str, ...] | None:
    parts = path.parts
    for k, part in enumerate(parts):
        if _HOST_BRIDGE.match(part):
            return (part,) + tuple(normalize_bus_id(p) for p in parts[k + 1:])
    return None


def _device(path: Path) -> PciDevice | None:
    chain = _chain(path)
    if chain is None or len(chain) < 2:
        return None
    numa = _int(_read(path / "numa_node"))
    return PciDevice(
        bus_id=chain[-1], chain=chain, vendor=_hex(_read(path / "vendor")), pci_class=_hex(_read(path / "class")),
        device_id=_hex(_read(path / "device")), numa_node=numa if numa is not None and numa >= 0 else None,
        gen=link_gen(_read(path / "max_link_speed")), width=_int(_read(path / "max_link_width")), cpulist=_read(path / "local_cpulist"),
    )


def _min(a: int | None, b: int | None) -> int | None:
    return a if b is None else b if a is None else min(a, b)


class PciTree:
    """The PCI devices under a sysfs root, with the questions topology detection asks of them."""

    def __init__(self, root: str | Path = "/sys") -> None:
        self.root = Path(root)
        self.devices: dict[str, PciDevice] = {}
        for p in _device_paths(self.root):
            dev = _device(p)
            if dev is not None:
                self.devices[dev.bus_id] = dev

    def gpus(self) -> list[PciDevice]:
        """NVIDIA GPUs in bus id order."""
        return sorted((d for d in self.devices.values() if d.is_nvidia_gpu), key=lambda d: d.bus_id)

    def get(self, bus_id: str) -> PciDevice | None:
        """The device with this bus id (any domain width or case), or None."""
        return self.devices.get(normalize_bus_id(bus_id))

    def link(self, dev: PciDevice) -> tuple[int | None, int | None]:
        """(generation, width) of the link above ``dev``: the lesser of the device and its port."""
        port = self.devices.get(dev.chain[-2]) if len(dev.chain) > 2 else None
        if port is None:
            return dev.gen, dev.width
        return _min(dev.gen, port.gen), _min(dev.width, port.width)

    def switches(self, dev: PciDevice) -> list[str]:
        """Upstream ports of the PCIe switches between the root port and ``dev``, top first."""
        bridges = list(dev.chain[1:-1])
        below_root_port = bridges[1:]
        return below_root_port[0::2]

    def numa(self, dev: PciDevice) -> int | None:
        """NUMA node of ``dev``, else of the nearest bridge above it that has one."""
        for bus_id in reversed(dev.chain[1:]):
            d = self.devices.get(bus_id)
            if d is not None and d.numa_node is not None:
                return d.numa_node
        return None

    def path(self, a: PciDevice, b: PciDevice) -> str:
        """PIX / PXB / PHB / NODE / SYS between two devices (``nvidia-smi topo -m`` names)."""
        if a.bus_id == b.bus_id:
            return "X"
        if a.host_bridge != b.host_bridge:
            return "NODE" if self.numa(a) == self.numa(b) else "SYS"
        sa, sb = self.switches(a), self.switches(b)
        common = 0
        while common < min(len(sa), len(sb)) and sa[common] == sb[common]:
            common += 1
        if common == 0:
            same_port = len(a.chain) > 2 and len(b.chain) > 2 and a.chain[1] == b.chain[1]
            return "PXB" if same_port else "PHB"
        return "PIX" if len(sa) == common and len(sb) == common else "PXB"


def _switch_list(tree: PciTree, devs: list[PciDevice]) -> list[PCIeSwitch]:
    """Every switch above the given GPUs (indices = positions in ``devs``), with its uplink."""
    members: dict[str, list[int]] = {}
    for i, d in enumerate(devs):
        for usp in tree.switches(d):
            members.setdefault(usp, []).append(i)
    out = []
    for usp, gpus in members.items():
        port = tree.devices.get(usp)
        gen, width = tree.link(port) if port is not None else (None, None)
        out.append(PCIeSwitch(usp, gpus, gen, width))
    return out


def _bridge_numa(tree: PciTree, devs: list[PciDevice], gpus: list[GPU]) -> int | None:
    """NUMA node of a host bridge: from sysfs, else the one node all its GPUs report."""
    known = tree.numa(devs[0])
    if known is not None:
        return known
    nodes = {g.numa_node for g in gpus}
    return nodes.pop() if len(nodes) == 1 else None


def topology_from_devices(tree: PciTree, devs: list[PciDevice], gpus: list[GPU], source: str) -> Topology:
    """A topology for GPUs whose PCI devices are ``devs`` (same order as ``gpus``).

    Root complexes are the host bridges; ``gpus`` keep their fields, with NUMA node, link and
    CPU affinity filled in from sysfs where they are None.
    """
    bridges: dict[str, list[int]] = {}
    for i, d in enumerate(devs):
        bridges.setdefault(d.host_bridge, []).append(i)
    filled = []
    for g, d in zip(gpus, devs):
        gen, width = tree.link(d)
        filled.append(GPU(g.index, g.name, g.memory_bytes, g.pci_bus_id or d.bus_id,
                          g.numa_node if g.numa_node is not None else tree.numa(d), g.pcie_gen or gen,
                          g.pcie_width or width, uuid=g.uuid, cpu_affinity=g.cpu_affinity or d.cpulist))
    paths = [[tree.path(a, b) for b in devs] for a in devs]
    host = [HostBridge(name, _bridge_numa(tree, [devs[i] for i in members], [filled[i] for i in members]))
            for name, members in bridges.items()]
    return Topology.assemble(filled, list(bridges.values()), source=source, pcie_paths=paths,
                             host_bridges=host, switches=_switch_list(tree, devs))


def topology_from_sysfs(root: str | Path = "/sys") -> Topology:
    """All NVIDIA GPUs on the PCI bus (bus id order), from sysfs alone.

    sysfs knows no GPU names or memory sizes (name reads ``NVIDIA device 0x2204``, memory 0), no
    NVLink and no peer access (all False). Raises :class:`topology.TopologyUnavailable` when no
    NVIDIA GPU is found.
    """
    tree = PciTree(root)
    devs = tree.gpus()
    if not devs:
        raise TopologyUnavailable(f"no NVIDIA GPU under {Path(root) / 'bus/pci/devices'}")
    gpus = [GPU(i, f"NVIDIA device {d.device_id:#06x}" if d.device_id is not None else "NVIDIA GPU", 0, d.bus_id, None, None, None)
            for i, d in enumerate(devs)]
    log.debug("sysfs: %d NVIDIA GPU(s) under %s", len(devs), root)
    return topology_from_devices(tree, devs, gpus, source="sysfs")
