"""Find the GPUs of this machine and how they hang together, or load a saved description.

Sources, best first:

1. NVML through nvidia-ml-py: names, memory, bus ids, PCIe links, the common PCIe ancestor of each
   pair (the same answer ``nvidia-smi topo -m`` prints), peer-access status and NVLink state. sysfs
   then adds host bridge names, PCIe switches, NUMA nodes and CPU affinity where it can.
2. sysfs alone (no NVML): the PCIe tree of every NVIDIA GPU on the bus; names and memory come from
   ``nvidia-smi --query-gpu`` when it runs.
3. The text of ``nvidia-smi topo -m`` (no sysfs, e.g. a masked /sys in a container).

``CUDA_VISIBLE_DEVICES`` is applied to the result: the topology holds the visible GPUs in that order,
re-indexed 0..k-1 as CUDA numbers them. Integer entries are taken as PCI bus order, which is CUDA's
order when ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` and, for a box of identical GPUs, also by default.
``GPU-<uuid>`` entries (or unique prefixes) are matched against NVML's UUIDs. As in CUDA, the list
ends at the first entry that names no GPU.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import os
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Mapping as TMapping, Sequence

from topology._json import topology_from_json
from topology.errors import TopologyFileError, TopologyUnavailable
from topology.model import GPU, Topology, groups_from_pairs
from topology.smi_text import looks_like_topo_matrix, parse_topo_matrix
from topology.sysfs import PciTree, normalize_bus_id, topology_from_devices, topology_from_sysfs

log = logging.getLogger(__name__)

# NVML topology levels (nvmlGpuTopologyLevel_t) -> nvidia-smi path names.
_LEVEL_TO_PATH = {0: "PIX", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
_HOSTBRIDGE_LEVEL = 30

NO_GPU_HINT = ("To plan for another machine, save the output of `nvidia-smi topo -m` there and run "
               "`mobius topo --from FILE`.")


# ---------------------------------------------------------------------------------- NVML
def _const(nvml: Any, name: str, default: Any) -> Any:
    value = getattr(nvml, name, default)
    return value[0] if isinstance(value, tuple) else value  # pynvml spells one constant as a tuple


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class _Nvml:
    """Calls into an NVML binding (pynvml or a test double), turning unsupported queries into None."""

    def __init__(self, nvml: Any) -> None:
        self.m = nvml
        self.error: type[BaseException] = getattr(nvml, "NVMLError", Exception)

    def call(self, name: str, *args: Any, default: Any = None) -> Any:
        """``nvml.<name>(*args)``, or ``default`` when missing from the binding or unsupported."""
        fn = getattr(self.m, name, None)
        if fn is None:
            return default
        try:
            return fn(*args)
        except self.error as e:  # type: ignore[misc]
            log.debug("NVML %s%s: %s", name, args[1:], e)
            return default

    def numa_node(self, handle: Any) -> int | None:
        """The one NUMA node whose memory is near the GPU, or None."""
        mask = self.call("nvmlDeviceGetMemoryAffinity", handle, 1, _const(self.m, "NVML_AFFINITY_SCOPE_NODE", 0))
        if not mask:
            return None
        bits = [b for b in range(64) if int(mask[0]) >> b & 1]
        return bits[0] if len(bits) == 1 else None

    def gpu(self, index: int, handle: Any) -> GPU:
        """The GPU record NVML gives for one device."""
        mem = self.call("nvmlDeviceGetMemoryInfo", handle)
        uuid = self.call("nvmlDeviceGetUUID", handle)
        return GPU(
            index=index, name=_text(self.m.nvmlDeviceGetName(handle)), memory_bytes=int(mem.total) if mem is not None else 0,
            pci_bus_id=normalize_bus_id(_text(self.m.nvmlDeviceGetPciInfo(handle).busId)), numa_node=self.numa_node(handle),
            pcie_gen=self.call("nvmlDeviceGetMaxPcieLinkGeneration", handle),
            pcie_width=self.call("nvmlDeviceGetMaxPcieLinkWidth", handle), uuid=_text(uuid) if uuid else None,
        )

    def pair_paths(self, handles: Sequence[Any]) -> list[list[str]]:
        """nvidia-smi path names from each pair's common PCIe ancestor ("" when NVML does not say)."""
        n = len(handles)
        paths = [["X"] * n for _ in range(n)]
        for i in range(n):
            for j in range(i + 1, n):
                level = self.call("nvmlDeviceGetTopologyCommonAncestor", handles[i], handles[j])
                paths[i][j] = paths[j][i] = _LEVEL_TO_PATH.get(int(level), "SYS") if level is not None else ""
        return paths

    def p2p(self, handles: Sequence[Any]) -> list[list[bool]]:
        """Whether each GPU may read each other GPU's memory (NVML P2P read status OK)."""
        read, ok = _const(self.m, "NVML_P2P_CAPS_INDEX_READ", 0), _const(self.m, "NVML_P2P_STATUS_OK", 0)
        n = len(handles)
        return [[i == j or self.call("nvmlDeviceGetP2PStatus", handles[i], handles[j], read) == ok for j in range(n)] for i in range(n)]

    def nvlink(self, handles: Sequence[Any], bus_ids: Sequence[str]) -> list[list[int]]:
        """Link counts between GPUs; through NVSwitches each pair gets the lesser switch link count."""
        n, pos = len(handles), {b: i for i, b in enumerate(bus_ids)}
        counts = [[0] * n for _ in range(n)]
        to_switch = [0] * n
        enabled, switch = _const(self.m, "NVML_FEATURE_ENABLED", 1), _const(self.m, "NVML_NVLINK_DEVICE_TYPE_SWITCH", 2)
        for i, h in enumerate(handles):
            for link in range(int(_const(self.m, "NVML_NVLINK_MAX_LINKS", 18))):
                if self.call("nvmlDeviceGetNvLinkState", h, link) != enabled:
                    continue
                remote = self.call("nvmlDeviceGetNvLinkRemotePciInfo", h, link)
                j = pos.get(normalize_bus_id(_text(remote.busId))) if remote is not None else None
                if self.call("nvmlDeviceGetNvLinkRemoteDeviceType", h, link) == switch or j is None:
                    to_switch[i] += 1
                elif j != i:
                    counts[i][j] += 1
        return [[0 if i == j else max(counts[i][j], counts[j][i]) + min(to_switch[i], to_switch[j]) for j in range(n)] for i in range(n)]


def _nvml_module(nvml: ModuleType | Any | None) -> Any:
    if nvml is not None:
        return nvml
    try:
        import pynvml
    except ImportError as e:
        raise TopologyUnavailable(f"nvidia-ml-py is not installed ({e})") from None
    return pynvml


def detect_nvml(nvml: Any | None = None, sysfs_root: str | Path = "/sys") -> Topology:
    """All GPUs NVML sees (NVML order), enriched from sysfs. Raises TopologyUnavailable without NVML."""
    api = _Nvml(_nvml_module(nvml))
    try:
        api.m.nvmlInit()
    except (api.error, OSError) as e:  # type: ignore[misc]
        raise TopologyUnavailable(f"NVML did not start ({_text(e) or type(e).__name__})") from None
    try:
        count = int(api.m.nvmlDeviceGetCount())
        if count == 0:
            raise TopologyUnavailable("NVML sees no GPU")
        handles = [api.m.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        gpus = [api.gpu(i, h) for i, h in enumerate(handles)]
        levels = api.pair_paths(handles)
        p2p = api.p2p(handles)
        nvlink = api.nvlink(handles, [g.pci_bus_id for g in gpus])
    finally:
        api.call("nvmlShutdown")
    return _with_sysfs(gpus, levels, p2p, nvlink, sysfs_root)


def _with_sysfs(gpus: list[GPU], paths: list[list[str]], p2p: list[list[bool]], nvlink: list[list[int]], sysfs_root: str | Path) -> Topology:
    """NVML's answer, with host bridge names, switches, NUMA and CPU affinity from sysfs if present."""
    n = len(gpus)
    groups = groups_from_pairs(n, ((i, j) for i in range(n) for j in range(i + 1, n) if paths[i][j] in ("PIX", "PXB", "PHB")))
    try:
        tree = PciTree(sysfs_root)
    except OSError as e:
        log.debug("sysfs not readable under %s: %s", sysfs_root, e)
        tree = None
    devs = [tree.get(g.pci_bus_id) for g in gpus] if tree is not None else []
    if not devs or any(d is None for d in devs):
        return Topology.assemble(gpus, groups, source="nvml", nvlink=nvlink, p2p=p2p, pcie_paths=paths)
    base = topology_from_devices(tree, devs, gpus, source="nvml+sysfs")  # type: ignore[arg-type]
    if base.root_complexes != groups:
        log.warning("NVML groups GPUs as %s but sysfs host bridges as %s; using NVML's", groups, base.root_complexes)
    bridges = [base.host_bridges[base.gpus[g[0]].root_complex] for g in groups]
    return Topology.assemble(base.gpus, groups, source="nvml+sysfs", nvlink=nvlink, p2p=p2p, pcie_paths=paths,
                             host_bridges=bridges, switches=base.switches)


# ---------------------------------------------------------------------------------- nvidia-smi
def _run_smi(nvidia_smi: str, *args: str) -> str:
    try:
        out = subprocess.run([nvidia_smi, *args], capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise TopologyUnavailable(f"{nvidia_smi} not found") from None
    except (OSError, subprocess.TimeoutExpired) as e:
        raise TopologyUnavailable(f"{nvidia_smi} failed ({e})") from None
    if out.returncode != 0:
        raise TopologyUnavailable(f"{nvidia_smi} {' '.join(args)} failed: {(out.stdout + out.stderr).strip()[:200]}")
    return out.stdout


def smi_query(nvidia_smi: str = "nvidia-smi") -> list[dict[str, str]]:
    """``nvidia-smi --query-gpu`` as dicts with index, name, memory_mib, bus_id and uuid."""
    text = _run_smi(nvidia_smi, "--query-gpu=index,name,memory.total,pci.bus_id,uuid", "--format=csv,noheader,nounits")
    keys = ("index", "name", "memory_mib", "bus_id", "uuid")
    return [dict(zip(keys, (c.strip() for c in row))) for row in csv.reader(io.StringIO(text)) if len(row) == len(keys)]


def _named(gpu: GPU, info: dict[str, str] | None) -> GPU:
    """``gpu`` with name, memory, bus id and uuid from an ``smi_query`` row."""
    if info is None:
        return gpu
    mem = int(float(info["memory_mib"]) * (1 << 20)) if info["memory_mib"].replace(".", "", 1).isdigit() else gpu.memory_bytes
    return GPU(gpu.index, info["name"] or gpu.name, mem, gpu.pci_bus_id or normalize_bus_id(info["bus_id"]), gpu.numa_node,
               gpu.pcie_gen, gpu.pcie_width, gpu.root_complex, info["uuid"] or gpu.uuid, gpu.cpu_affinity)


def detect_without_nvml(sysfs_root: str | Path = "/sys", nvidia_smi: str = "nvidia-smi") -> Topology:
    """sysfs (names from ``nvidia-smi`` when it runs), else ``nvidia-smi topo -m``."""
    smi_error: TopologyUnavailable | None = None
    try:
        rows = smi_query(nvidia_smi)
    except TopologyUnavailable as e:
        log.debug("nvidia-smi query: %s", e)
        rows, smi_error = [], e
    try:
        topo = topology_from_sysfs(sysfs_root)
    except (TopologyUnavailable, OSError) as sysfs_error:
        if not rows:
            raise TopologyUnavailable(f"sysfs: {sysfs_error}; nvidia-smi: {smi_error or 'lists no GPU'}") from None
        topo = parse_topo_matrix(_run_smi(nvidia_smi, "topo", "-m"), source="nvidia-smi")
        topo.gpus = [_named(g, rows[g.index] if g.index < len(rows) else None) for g in topo.gpus]
        return topo
    by_bus = {normalize_bus_id(r["bus_id"]): r for r in rows}
    topo.gpus = [_named(g, by_bus.get(g.pci_bus_id)) for g in topo.gpus]
    topo.source = "sysfs+nvidia-smi" if by_bus else "sysfs"
    return topo


# ---------------------------------------------------------------------------------- CUDA_VISIBLE_DEVICES
def _resolve_entry(entry: str, topo: Topology) -> int | None:
    """The GPU index one CUDA_VISIBLE_DEVICES entry names, or None when it names none."""
    if entry.lstrip("-").isdigit():
        i = int(entry)
        return i if 0 <= i < topo.num_gpus else None
    if entry.startswith("GPU-"):
        hits = [g.index for g in topo.gpus if g.uuid and g.uuid.lower().startswith(entry.lower())]
        return hits[0] if len(hits) == 1 else None
    return None


def apply_visible_devices(topo: Topology, value: str | None, device_order: str | None = None) -> Topology:
    """The sub-topology ``CUDA_VISIBLE_DEVICES=value`` leaves visible (``value`` None: all GPUs).

    ``device_order`` is ``CUDA_DEVICE_ORDER``; with mixed GPU models a warning says when CUDA's
    default order (fastest first) may differ from the PCI order used here.
    """
    if value is None:
        return topo
    entries = [e.strip() for e in value.split(",")]
    if any(e.startswith("GPU-") for e in entries) and not all(g.uuid for g in topo.gpus):
        log.warning("CUDA_VISIBLE_DEVICES names GPU UUIDs but %s gives none; showing all GPUs", topo.source)
        return topo
    chosen: list[int] = []
    for e in entries:
        i = _resolve_entry(e, topo)
        if i is None or i in chosen:
            if e:
                log.warning("CUDA_VISIBLE_DEVICES entry %r names no GPU of the %d found; CUDA ignores it and the rest", e, topo.num_gpus)
            break
        chosen.append(i)
    if not chosen:
        raise TopologyUnavailable(f"CUDA_VISIBLE_DEVICES={value!r} leaves no GPU visible (of {topo.num_gpus} found)")
    if len({g.name for g in topo.gpus}) > 1 and device_order != "PCI_BUS_ID":
        log.warning("mixed GPU models: set CUDA_DEVICE_ORDER=PCI_BUS_ID so CUDA numbers GPUs in the order shown here")
    return topo.subset(chosen)


# ---------------------------------------------------------------------------------- entry points
def detect(
    *,
    sysfs_root: str | Path = "/sys",
    nvml: Any | None = None,
    nvidia_smi: str = "nvidia-smi",
    environ: TMapping[str, str] | None = None,
) -> Topology:
    """The topology of the GPUs this process can use.

    The keyword arguments exist for tests (a fake sysfs tree, an NVML double, another
    ``nvidia-smi``, another environment). Raises :class:`TopologyUnavailable` with the reason each
    source gave when there is no GPU, no NVML and no ``nvidia-smi``.
    """
    env = os.environ if environ is None else environ
    reasons = []
    sources: list[tuple[str, Callable[[], Topology]]] = [
        ("NVML: ", lambda: detect_nvml(nvml, sysfs_root)),
        ("", lambda: detect_without_nvml(sysfs_root, nvidia_smi)),
    ]
    for prefix, find in sources:
        try:
            topo = find()
        except TopologyUnavailable as e:
            reasons.append(f"{prefix}{e}")
            continue
        log.debug("topology from %s: %s", topo.source, topo.root_complexes)
        return apply_visible_devices(topo, env.get("CUDA_VISIBLE_DEVICES"), env.get("CUDA_DEVICE_ORDER"))
    raise TopologyUnavailable(f"no NVIDIA GPU found here ({'; '.join(reasons)}). {NO_GPU_HINT}")


def load_topology(path: str | Path) -> Topology:
    """A topology from ``mobius topo --json`` output or saved ``nvidia-smi topo -m`` text.

    The kind is recognised from the content. Errors (:class:`TopologyFileError`) name the file and
    what is wrong with it.
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        raise TopologyFileError(f"{p}: no such file") from None
    except OSError as e:
        raise TopologyFileError(f"{p}: cannot be read ({e.strerror or e})") from None
    try:
        if text.lstrip().startswith("{"):
            try:
                data = json.loads(text)
            except json.JSONDecodeError as e:
                raise TopologyFileError(f"not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
            return topology_from_json(data)
        if looks_like_topo_matrix(text):
            return parse_topo_matrix(text, source=f"nvidia-smi topo -m ({p.name})", origin=str(p))
        raise TopologyFileError("neither topology JSON (from `mobius topo --json`) nor `nvidia-smi topo -m` text "
                                "(no header row starting with GPU0)")
    except TopologyFileError as e:
        raise TopologyFileError(f"{p}: {e}") from None
