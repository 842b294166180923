"""Topology detection, saved formats, bandwidth files and the ``mobius topo`` command."""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import os
import stat
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import pytest

import topology
from mobius import cli
from mobius.commands import topo as topo_cmd
from mobius.errors import MobiusError, NotAvailableError
from topology import (
    Bandwidth,
    Topology,
    TopologyFileError,
    TopologyUnavailable,
    apply_visible_devices,
    detect,
    load_bandwidth,
    load_topology,
    topology_from_json,
    topology_graph,
)
from topology.render import format_bandwidth
from topology.smi_text import parse_topo_matrix
from topology.sysfs import PciTree, link_gen, normalize_bus_id, topology_from_sysfs

FIXTURES = Path(__file__).parent / "fixtures" / "topology"
GiB = 1 << 30

# fixture -> (root complexes, NUMA node per GPU, every pair on NVLink)
TEXT_FIXTURES = {
    "topo4_one_rc.txt": ([[0, 1, 2, 3]], [0, 0, 0, 0], False),
    "topo2x2_sys.txt": ([[0, 1], [2, 3]], [0, 0, 1, 1], False),
    "topo2x2_node.txt": ([[0, 1], [2, 3]], [0, 0, 0, 0], False),
    "topo1x3_spaces.txt": ([[0], [1, 2, 3]], [0, 1, 1, 1], False),
    "topo8_4x4_nic.txt": ([[0, 1, 2, 3], [4, 5, 6, 7]], [0] * 4 + [1] * 4, False),
    "two_socket_numa.txt": ([[0, 1], [2, 3], [4, 5], [6, 7]], [0] * 4 + [1] * 4, False),
    "mixed_phb_node_sys.txt": ([[0, 1], [2], [3, 4, 5]], [0, 0, 0, 1, 1, 1], False),
    "dgx_a100_nv12.txt": ([[0, 1], [2, 3], [4, 5], [6, 7]], [3, 3, 1, 1, 7, 7, 5, 5], True),
    "single_gpu.txt": ([[0]], [0], False),
    "rtx4090x4_phb_p2p.txt": ([[0, 1, 2, 3]], [0, 0, 0, 0], False),
    "trimmed_nvbridge_nic_spaces.txt": ([[0, 1], [2], [3]], [0, 0, 1, 1], False),
    "trimmed_header_extra_values.txt": ([[0, 1, 2], [3, 4, 5]], [0, 0, 0, 1, 1, 1], False),
    "nic_rows_unknown_column.txt": ([[0, 1], [2, 3], [4, 5], [6, 7]], [0] * 4 + [1] * 4, False),
}
SYSFS_FIXTURES = {
    "sysfs_paper_2x2": [[0, 1], [2, 3]],
    "sysfs_mixed": [[0, 1], [2, 3], [4]],
}


# ------------------------------------------------------------------------------------ text fixtures
@pytest.mark.parametrize("name", sorted(TEXT_FIXTURES))
def test_topo_m_fixture_groups(name: str) -> None:
    groups, numa, nvlink = TEXT_FIXTURES[name]
    topo = load_topology(FIXTURES / name)
    assert topo.root_complexes == groups
    assert [g.numa_node for g in topo.gpus] == numa
    assert topo.has_nvlink is nvlink
    assert [g.root_complex for g in topo.gpus] == [k for i in range(topo.num_gpus) for k, g in enumerate(groups) if i in g]
    assert all(topo.p2p[i][i] for i in range(topo.num_gpus))


def test_topo_m_details() -> None:
    dgx = load_topology(FIXTURES / "dgx_a100_nv12.txt")
    assert dgx.nvlink[0][7] == 12 and dgx.nvlink[3][3] == 0
    assert dgx.link_label(0, 5) == "NV12" and dgx.pcie_paths[0][5] == ""
    assert all(dgx.p2p[i][j] for i in range(8) for j in range(8))
    assert dgx.gpus[0].cpu_affinity == "48-63,176-191"
    mixed = load_topology(FIXTURES / "mixed_phb_node_sys.txt")
    assert [mixed.pcie_paths[0][1], mixed.pcie_paths[0][2], mixed.pcie_paths[3][4], mixed.pcie_paths[0][3]] == ["PHB", "NODE", "PXB", "SYS"]
    assert [s.gpus for s in mixed.switches] == [[3, 4]]
    assert [h.numa_node for h in mixed.host_bridges] == [0, 0, 1]
    p2p = load_topology(FIXTURES / "rtx4090x4_phb_p2p.txt")
    assert p2p.p2p == [[True, True, False, False], [True, True, False, False], [False, False, True, True], [False, False, True, True]]
    assert not load_topology(FIXTURES / "topo2x2_sys.txt").any_p2p
    assert load_topology(FIXTURES / "topo4_one_rc.txt").source == "nvidia-smi topo -m (topo4_one_rc.txt)"


def _smi_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "topology.smi_text" and r.levelno == logging.WARNING]


def test_topo_m_trimmed_and_unknown_columns(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="topology.smi_text")
    trimmed = load_topology(FIXTURES / "trimmed_nvbridge_nic_spaces.txt")  # "CPU Affinity NUMA", single spaces
    assert _smi_warnings(caplog) == []
    assert [g.cpu_affinity for g in trimmed.gpus] == ["0-15,32-47"] * 2 + ["16-31,48-63"] * 2
    assert trimmed.nvlink[0][1] == 4 and trimmed.pcie_paths[0][1] == "" and trimmed.pcie_paths[0][2] == "SYS"
    assert [h.numa_node for h in trimmed.host_bridges] == [0, 1, 1]  # GPU0/1 joined through NIC0 (PHB)

    path = FIXTURES / "trimmed_header_extra_values.txt"  # header "CPU  NUMA"; rows still carry GPU NUMA ID
    extra = load_topology(path)
    (warning,) = _smi_warnings(caplog)
    assert warning.startswith(f"{path}: line 1: row GPU0 (line 2) has 3 value(s)") and "reading CPU, NUMA from the left" in warning
    assert extra.gpus[5].cpu_affinity == "14-27,42-55" and [s.gpus for s in extra.switches] == [[3, 4, 5]]

    caplog.clear()
    path = FIXTURES / "nic_rows_unknown_column.txt"  # NIC0/NIC1 rows and an added "PCIe Link" column
    nic = load_topology(path)
    (warning,) = _smi_warnings(caplog)
    assert warning.startswith(f"{path}: line 2: skipping column(s) 'PCIe Link'")
    assert [g.cpu_affinity for g in nic.gpus] == ["0-31,64-95"] * 4 + ["32-63,96-127"] * 4
    assert [s.gpus for s in nic.switches] == [[0, 1], [2, 3], [4, 5], [6, 7]] and nic.pcie_paths[1][2] == "NODE"


def _two_gpus(tail: str, values: tuple[str, str], sep: str = "\t") -> str:
    """A 2-GPU matrix (one switch) with ``tail`` after the device columns of the header."""
    return (f"{sep}GPU0{sep}GPU1{sep}{tail}\nGPU0{sep} X {sep}PIX{sep}{values[0]}\n"
            f"GPU1{sep}PIX{sep} X {sep}{values[1]}\n\nLegend:\n\n  X    = Self\n")


# header after the device columns, values of GPU0 / GPU1 -> CPU lists, NUMA nodes, words the warning must hold
COLUMN_CASES = {
    "full": ("CPU Affinity\tNUMA Affinity\tGPU NUMA ID", ("0-7\t0\t\tN/A", "8-15\t1\t\tN/A"), ["0-7", "8-15"], [0, 1], []),
    "short names": ("CPU\tNUMA", ("0-7\t0", "8-15\t1"), ["0-7", "8-15"], [0, 1], []),
    "cut words": ("CPU Aff\tNUMA Affin\tGPU NUMA", ("0-7\t0\t2", "8-15\t1\t3"), ["0-7", "8-15"], [0, 1], []),
    "no GPU NUMA ID": ("CPU Affinity\tNUMA Affinity", ("0-7\t0", "8-15\t1"), ["0-7", "8-15"], [0, 1], []),
    "nothing after": ("", ("", ""), [None, None], [None, None], []),
    "unknown between": ("CPU Affinity\tRack Slot\tNUMA Affinity", ("0-7\tA3\t0", "8-15\tB1\t1"), ["0-7", "8-15"], [0, 1],
                        ["'Rack Slot'"]),
    "unknown, too many values": ("Slot\tCPU Affinity", ("A3\t0-7\t0", "B1\t8-15\t1"), [None, None], [None, None],
                                 ["'Slot'", "has 3 value(s)", "reading none"]),
    "too few values": ("CPU Affinity\tNUMA Affinity\tGPU NUMA ID", ("0-7", "8-15"), ["0-7", "8-15"], [None, None],
                       ["has 1 value(s)", "reading CPU Affinity from the left"]),
    "misshapen value": ("CPU Affinity\tNUMA Affinity", ("0-7\tzero", "8-15\t1"), ["0-7", "8-15"], [None, 1],
                        ["under 'NUMA Affinity'", "'zero' in row GPU0 (line 2)"]),
}


@pytest.mark.parametrize("case", sorted(COLUMN_CASES))
@pytest.mark.parametrize("sep", ["\t", "    ", " "], ids=["tabs", "spaces", "single-spaced"])
def test_topo_m_columns_after_devices(case: str, sep: str, caplog: pytest.LogCaptureFixture) -> None:
    """nvidia-smi's tabs, a terminal paste (runs of spaces) and a web page's single spaces read alike."""
    tail, values, cpus, numas, warned = COLUMN_CASES[case]
    caplog.set_level(logging.WARNING, logger="topology.smi_text")
    text = _two_gpus(tail.replace("\t", sep), (values[0].replace("\t", sep), values[1].replace("\t", sep)), sep)
    topo = parse_topo_matrix(text, origin="box.txt")
    assert topo.root_complexes == [[0, 1]] and topo.pcie_paths[0][1] == "PIX"
    assert [g.cpu_affinity for g in topo.gpus] == cpus and [g.numa_node for g in topo.gpus] == numas
    messages = " | ".join(_smi_warnings(caplog))
    assert all(w in messages for w in warned), messages
    assert bool(messages) == bool(warned) and (not messages or messages.startswith("box.txt: line 1: "))


def test_topo_m_cpu_as_device_column(caplog: pytest.LogCaptureFixture) -> None:
    """A matrix with a CPU row and column (as some write-ups show it): CPU is a device, not an affinity."""
    caplog.set_level(logging.WARNING, logger="topology.smi_text")
    topo = parse_topo_matrix("        GPU0    GPU1    CPU\nGPU0     X      NV1     PHB\nGPU1    NV1      X      PHB\n"
                             "CPU     PHB    PHB       X\n")
    assert topo.root_complexes == [[0, 1]] and topo.nvlink[0][1] == 1 and topo.gpus[0].cpu_affinity is None
    assert _smi_warnings(caplog) == []


MALFORMED = {  # file text -> the start of the error after the file name
    "asym": ("\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tPIX\t0-7\nGPU1\tSYS\t X \t0-7\n",
             "line 3: GPU1/GPU0 is SYS but GPU0/GPU1 is PIX (line 2)"),
    "short": ("\tGPU0\tGPU1\nGPU0\t X \tPIX\n", "line 1: no row for GPU1"),
    "nic entry missing": ("\tGPU0\tGPU1\tNIC0\tCPU Affinity\nGPU0\t X \tPIX\tPHB\t0-7\nGPU1\tPIX\t X \t0-7\n"
                          "NIC0\tPHB\tPHB\t X \n", "line 3: row GPU1 has '0-7' under NIC0, where the other GPU rows have 3 link entries"),
    "bad link": ("\tGPU0\tGPU1\tNIC0\nGPU0\t X \tPIX\tPHB\nGPU1\tPIX\t X \tPHX\n", "line 3: row GPU1 has 'PHX' under NIC0"),
    "row cut short": ("GPU0 GPU1 GPU2\nGPU0 X PIX PIX\nGPU1 PIX X PIX\nGPU2 PIX X\n", "line 4: row GPU2 has no entry under GPU2"),
    "header names more GPUs": ("\tGPU0\tGPU1\tGPU2\tCPU Affinity\nGPU0\t X \tPIX\t0-7\nGPU1\tPIX\t X \t0-7\n",
                               "line 1: the header names GPU2 but the GPU rows have only 2 link entries"),
    "header too short": ("\tGPU0\tGPU1\nGPU0\t X \tPIX\tPHB\nGPU1\tPIX\t X \tPHB\n",
                         "line 1: the header names 2 column(s) but the GPU rows have 3 link entries"),
    "no links": ("\tGPU0\tCPU Affinity\nGPU0\t0-7\n", "line 2: row GPU0 starts with ['0-7'], not a link type"),
    "X off the diagonal": ("\tGPU0\tGPU1\nGPU0\t X \t X \nGPU1\t X \t X \n", "line 3: GPU1/GPU0 is X"),
    "not a matrix": ("hello\n", "neither topology JSON"),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_topo_m_errors(name: str, tmp_path: Path) -> None:
    text, message = MALFORMED[name]
    path = tmp_path / f"{name.replace(' ', '_')}.txt"
    path.write_text(text)
    with pytest.raises(TopologyFileError) as info:
        load_topology(path)
    assert str(info.value).startswith(f"{path}: {message}"), str(info.value)


def test_missing_topology_file(tmp_path: Path) -> None:
    with pytest.raises(TopologyFileError, match=r"missing\.txt: no such file"):
        load_topology(tmp_path / "missing.txt")


# ------------------------------------------------------------------------------------ sysfs fixtures
@pytest.mark.parametrize("name", sorted(SYSFS_FIXTURES))
def test_sysfs_fixture_groups(name: str) -> None:
    topo = topology_from_sysfs(FIXTURES / name)
    assert topo.root_complexes == SYSFS_FIXTURES[name]
    assert topo.source == "sysfs"


def test_sysfs_paper_box_details() -> None:
    topo = topology_from_sysfs(FIXTURES / "sysfs_paper_2x2")  # read through bus/pci/devices links
    assert [g.pci_bus_id for g in topo.gpus] == ["0000:03:00.0", "0000:04:00.0", "0000:83:00.0", "0000:84:00.0"]
    assert [(g.pcie_gen, g.pcie_width) for g in topo.gpus] == [(3, 16)] * 4  # gen4 GPU in a gen3 switch port
    assert [g.numa_node for g in topo.gpus] == [0, 0, 1, 1]
    assert topo.pcie_paths[0] == ["X", "PIX", "SYS", "SYS"]
    assert [(s.bus_id, s.gpus, s.pcie_gen, s.pcie_width) for s in topo.switches] == [
        ("0000:01:00.0", [0, 1], 3, 8), ("0000:81:00.0", [2, 3], 3, 8)]  # the paper's PCIe 3.0 x8 uplinks
    assert [h.name for h in topo.host_bridges] == ["pci0000:00", "pci0000:80"]
    assert topo.gpus[2].cpu_affinity == "16-31,48-63"


def test_sysfs_mixed_box_paths() -> None:
    topo = topology_from_sysfs(FIXTURES / "sysfs_mixed")  # walked (no bus/pci/devices)
    paths = topo.pcie_paths
    assert [paths[0][1], paths[0][2], paths[2][3], paths[1][4]] == ["PHB", "NODE", "PXB", "SYS"]
    assert topo.gpus[4].name == "NVIDIA device 0x20b5" and topo.gpus[4].pcie_gen == 4
    assert sorted(s.bus_id for s in topo.switches) == ["0000:41:00.0", "0000:43:00.0", "0000:46:00.0"]


def test_sysfs_helpers(tmp_path: Path) -> None:
    assert normalize_bus_id("00000000:0A:00.0") == "0000:0a:00.0"
    assert [link_gen(s) for s in ("2.5 GT/s PCIe", "8 GT/s", "32.0 GT/s PCIe", "Unknown", None)] == [1, 3, 5, None, None]
    tree = PciTree(FIXTURES / "sysfs_paper_2x2")
    assert len(tree.gpus()) == 4  # audio functions and the ASPEED VGA are not GPUs
    with pytest.raises(TopologyUnavailable, match="no NVIDIA GPU"):
        topology_from_sysfs(tmp_path)


# ------------------------------------------------------------------------------------ NVML double
class FakeNVMLError(Exception):
    """Stands for pynvml.NVMLError."""


class FakeNVML:
    """Just enough of pynvml for detection: the paper's 2+2 box, or an NVSwitch box."""

    NVMLError = FakeNVMLError

    def __init__(self, bus_ids: list[str], levels: list[list[int]], p2p: set[tuple[int, int]] = frozenset(),
                 nvlinks: dict[int, list[tuple[str, int]]] | None = None, broken: bool = False) -> None:
        self.bus_ids, self.levels, self.ok, self.links, self.broken = bus_ids, levels, p2p, nvlinks or {}, broken
        self.shut = False

    def nvmlInit(self) -> None:
        if self.broken:
            raise FakeNVMLError("Driver Not Loaded")

    def nvmlShutdown(self) -> None:
        self.shut = True

    def nvmlDeviceGetCount(self) -> int:
        return len(self.bus_ids)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetName(self, h: int) -> str:
        return "NVIDIA GeForce RTX 3090"

    def nvmlDeviceGetMemoryInfo(self, h: int) -> SimpleNamespace:
        return SimpleNamespace(total=24 * GiB)

    def nvmlDeviceGetPciInfo(self, h: int) -> SimpleNamespace:
        return SimpleNamespace(busId=("0000" + self.bus_ids[h].upper()).encode())

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return f"GPU-{h}abc{h}-0000"

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h: int) -> int:
        return 4

    def nvmlDeviceGetMaxPcieLinkWidth(self, h: int) -> int:
        return 16

    def nvmlDeviceGetMemoryAffinity(self, h: int, size: int, scope: int) -> list[int]:
        raise FakeNVMLError("Not Supported")

    def nvmlDeviceGetTopologyCommonAncestor(self, a: int, b: int) -> int:
        return self.levels[a][b]

    def nvmlDeviceGetP2PStatus(self, a: int, b: int, index: int) -> int:
        return 0 if (a, b) in self.ok else 2

    def nvmlDeviceGetNvLinkState(self, h: int, link: int) -> int:
        if link >= len(self.links.get(h, [])):
            raise FakeNVMLError("Not Supported")
        return 1

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h: int, link: int) -> SimpleNamespace:
        return SimpleNamespace(busId=self.links[h][link][0])

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, h: int, link: int) -> int:
        return self.links[h][link][1]


PAPER_BUS = ["0000:03:00.0", "0000:04:00.0", "0000:83:00.0", "0000:84:00.0"]
PAPER_LEVELS = [[0, 10, 50, 50], [10, 0, 50, 50], [50, 50, 0, 10], [50, 50, 10, 0]]


def _paper_nvml() -> FakeNVML:
    return FakeNVML(PAPER_BUS, PAPER_LEVELS, p2p={(0, 1), (1, 0)})


def test_detect_nvml_with_sysfs() -> None:
    nvml = _paper_nvml()
    topo = detect(nvml=nvml, sysfs_root=FIXTURES / "sysfs_paper_2x2", environ={})
    assert nvml.shut
    assert topo.source == "nvml+sysfs"
    assert topo.root_complexes == [[0, 1], [2, 3]]
    assert [g.pci_bus_id for g in topo.gpus] == PAPER_BUS
    assert topo.gpus[0].memory_bytes == 24 * GiB and topo.gpus[0].name == "NVIDIA GeForce RTX 3090"
    assert [g.numa_node for g in topo.gpus] == [0, 0, 1, 1]  # NVML said nothing, sysfs did
    assert (topo.gpus[0].pcie_gen, topo.gpus[0].pcie_width) == (4, 16)  # NVML's figure is kept
    assert [h.name for h in topo.host_bridges] == ["pci0000:00", "pci0000:80"]
    assert topo.p2p[0][1] and not topo.p2p[0][2] and not topo.has_nvlink
    assert topo.pcie_paths[0] == ["X", "PIX", "SYS", "SYS"]


def test_detect_nvml_without_sysfs(tmp_path: Path) -> None:
    topo = detect(nvml=_paper_nvml(), sysfs_root=tmp_path, environ={})
    assert topo.source == "nvml" and topo.root_complexes == [[0, 1], [2, 3]]
    assert [h.name for h in topo.host_bridges] == ["rc0", "rc1"]


def test_detect_nvswitch_box(tmp_path: Path) -> None:
    bus = [f"0000:{b:02x}:00.0" for b in (0x07, 0x0F, 0x47, 0x4E)]
    levels = [[0, 20, 50, 50], [20, 0, 50, 50], [50, 50, 0, 20], [50, 50, 20, 0]]
    links = {h: [("0000:c4:00.0", 2)] * 12 for h in range(4)}  # 12 links each into NVSwitches
    topo = detect(nvml=FakeNVML(bus, levels, nvlinks=links), sysfs_root=tmp_path, environ={})
    assert topo.has_nvlink and topo.nvlink[0][3] == 12 and topo.nvlink[2][2] == 0
    assert topo.root_complexes == [[0, 1], [2, 3]] and topo.pcie_paths[0][1] == "PXB"
    direct = detect(nvml=FakeNVML(bus[:2], [[0, 20], [20, 0]], nvlinks={0: [(bus[1], 0)] * 4, 1: [(bus[0], 0)] * 4}),
                    sysfs_root=tmp_path, environ={})
    assert direct.nvlink == [[0, 4], [4, 0]] and direct.has_nvlink


def test_cuda_visible_devices() -> None:
    nvml, root = _paper_nvml(), FIXTURES / "sysfs_paper_2x2"
    topo = detect(nvml=nvml, sysfs_root=root, environ={"CUDA_VISIBLE_DEVICES": "2,0"})
    assert [g.pci_bus_id for g in topo.gpus] == [PAPER_BUS[2], PAPER_BUS[0]]
    assert [g.index for g in topo.gpus] == [0, 1] and topo.root_complexes == [[0], [1]]
    assert [h.name for h in topo.host_bridges] == ["pci0000:80", "pci0000:00"]  # new GPU0 is old GPU2
    truncated = detect(nvml=nvml, sysfs_root=root, environ={"CUDA_VISIBLE_DEVICES": "1,7,0"})
    assert [g.pci_bus_id for g in truncated.gpus] == [PAPER_BUS[1]]  # CUDA stops at the first bad entry
    by_uuid = detect(nvml=nvml, sysfs_root=root, environ={"CUDA_VISIBLE_DEVICES": "GPU-3abc,GPU-1abc1-0000"})
    assert [g.pci_bus_id for g in by_uuid.gpus] == [PAPER_BUS[3], PAPER_BUS[1]] and by_uuid.root_complexes == [[0], [1]]
    with pytest.raises(TopologyUnavailable, match="leaves no GPU visible"):
        detect(nvml=nvml, sysfs_root=root, environ={"CUDA_VISIBLE_DEVICES": ""})
    text = load_topology(FIXTURES / "topo8_4x4_nic.txt")
    assert apply_visible_devices(text, "0,1,4,5").root_complexes == [[0, 1], [2, 3]]
    assert apply_visible_devices(text, "GPU-abc").num_gpus == 8  # no UUIDs known: all GPUs, with a warning


def _broken_detect(tmp_path: Path) -> functools.partial:
    return functools.partial(detect, nvml=FakeNVML([], [], broken=True), sysfs_root=tmp_path,
                             nvidia_smi=str(tmp_path / "no-nvidia-smi"), environ={})


def test_detect_without_gpu_is_clear(tmp_path: Path) -> None:
    with pytest.raises(TopologyUnavailable) as info:
        _broken_detect(tmp_path)()
    msg = str(info.value)
    assert isinstance(info.value, NotAvailableError) and isinstance(info.value, MobiusError)
    assert "no NVIDIA GPU found" in msg and "Driver Not Loaded" in msg and "mobius topo --from FILE" in msg


def _fake_smi(tmp_path: Path, topo_text: Path) -> str:
    script = tmp_path / "nvidia-smi"
    script.write_text(
        "#!/bin/sh\n"
        'case "$1" in\n'
        "  --query-gpu=*) printf '0, NVIDIA GeForce RTX 3090, 24576, 00000000:03:00.0, GPU-a\\n"
        "1, NVIDIA GeForce RTX 3090, 24576, 00000000:04:00.0, GPU-b\\n"
        "2, NVIDIA GeForce RTX 3090, 24576, 00000000:83:00.0, GPU-c\\n"
        "3, NVIDIA GeForce RTX 3090, 24576, 00000000:84:00.0, GPU-d\\n' ;;\n"
        f"  topo) cat '{topo_text}' ;;\n"
        "  *) exit 1 ;;\n"
        "esac\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


@pytest.mark.skipif(sys.platform == "win32", reason="shell script stands in for nvidia-smi")
def test_detect_without_nvml(tmp_path: Path) -> None:
    smi = _fake_smi(tmp_path, FIXTURES / "topo2x2_sys.txt")
    broken = FakeNVML([], [], broken=True)
    from_sysfs = detect(nvml=broken, sysfs_root=FIXTURES / "sysfs_paper_2x2", nvidia_smi=smi, environ={})
    assert from_sysfs.source == "sysfs+nvidia-smi" and from_sysfs.root_complexes == [[0, 1], [2, 3]]
    assert from_sysfs.gpus[3].name == "NVIDIA GeForce RTX 3090" and from_sysfs.gpus[3].memory_bytes == 24 * GiB
    from_text = detect(nvml=broken, sysfs_root=tmp_path / "empty", nvidia_smi=smi, environ={"CUDA_VISIBLE_DEVICES": "GPU-d,GPU-b"})
    assert from_text.source == "nvidia-smi" and from_text.root_complexes == [[0], [1]]
    assert [g.pci_bus_id for g in from_text.gpus] == ["0000:84:00.0", "0000:04:00.0"]


# ------------------------------------------------------------------------------------ JSON and model
@pytest.mark.parametrize("name", sorted(TEXT_FIXTURES))
def test_json_round_trip(name: str, tmp_path: Path) -> None:
    topo = load_topology(FIXTURES / name)
    path = tmp_path / "topo.json"
    path.write_text(json.dumps(topo.to_json()))
    back = load_topology(path)
    assert back.to_json() == topo.to_json()
    assert back == topo


def test_from_json_minimal_and_errors(tmp_path: Path) -> None:
    topo = topology_from_json({"gpus": [{"index": 0}, {"index": 1}, {"index": 2}], "root_complexes": [[0, 2], [1]]})
    assert topo.root_complexes == [[0, 2], [1]] and topo.gpus[1].root_complex == 1 and topo.gpus[0].name == "unknown"
    cases = {
        '{"gpus": [{"index": 0, "memory_bytes": "24G"}], "root_complexes": [[0]]}': "gpus[0].memory_bytes' must be an integer",
        '{"gpus": [{"index": 0}, {"index": 1}], "root_complexes": [[0]]}': "must hold each GPU index 0..1 exactly once",
        '{"gpus": [{"index": 0}], "root_complexes": [[0]], "p2p": [[false]]}': "p2p must be True on the diagonal",
        '{"gpus": [{"index": 0}]}': "missing key 'root_complexes'",
        '{"schema": "mobius.bandwidth/1", "gpus": []}': "a bandwidth file",
        '{"gpus": [': "not valid JSON",
    }
    for k, (text, message) in enumerate(cases.items()):
        path = tmp_path / f"bad{k}.json"
        path.write_text(text)
        with pytest.raises(TopologyFileError) as info:
            load_topology(path)
        assert str(info.value).startswith(f"{path}: ") and message in str(info.value)


def test_synthetic_and_subset() -> None:
    topo = Topology.synthetic([2, 2])
    assert topo.num_gpus == 4 and topo.root_complexes == [[0, 1], [2, 3]] and topo.source == "synthetic"
    assert topo.gpus[0].memory_bytes == 24 * GiB and not topo.any_p2p and not topo.has_nvlink
    assert Topology.synthetic([[0, 2], [1, 3]], p2p=True).root_complexes == [[0, 2], [1, 3]]
    assert Topology.synthetic([[0, 2], [1, 3]], p2p=True).any_p2p
    assert Topology.synthetic([1]).num_gpus == 1 and not Topology.synthetic([1]).has_nvlink
    with pytest.raises(MobiusError):
        Topology.synthetic([[0, 1], [1, 2]])
    sub = Topology.synthetic([4, 4]).subset([5, 1, 4])
    assert [g.pci_bus_id for g in sub.gpus] == [Topology.synthetic([4, 4]).gpus[i].pci_bus_id for i in (5, 1, 4)]
    assert sub.root_complexes == [[0, 2], [1]] and sub.pcie_paths[0] == ["X", "SYS", "PIX"]


def test_graph_view() -> None:
    import networkx as nx

    dgx = topology_graph(load_topology(FIXTURES / "dgx_a100_nv12.txt"))
    assert sum(1 for *_, k in dgx.edges(data="kind") if k == "nvlink") == 28
    assert dgx.nodes["GPU3"]["kind"] == "gpu" and dgx.nodes["GPU3"]["numa_node"] == 1
    box = topology_graph(topology_from_sysfs(FIXTURES / "sysfs_paper_2x2"))
    path = nx.shortest_path(box, "GPU0", "GPU2")
    assert "system" in path and "switch:0000:01:00.0" in path
    assert nx.shortest_path(box, "GPU0", "GPU1") == ["GPU0", "switch:0000:01:00.0", "GPU1"]


def _topology_imports() -> dict[str, set[str]]:
    """Module -> the topology modules it imports anywhere (test_imports's walker, one for the suite)."""
    from test_imports import graph

    g = graph()
    return {m: {d for d in g.successors(m) if d.split(".")[0] == "topology"} for m in g if m.split(".")[0] == "topology"}


def test_topology_imports_form_a_dag() -> None:
    import networkx as nx

    imports = _topology_imports()
    g = nx.DiGraph([(a, b) for a, deps in imports.items() for b in deps])
    assert "topology.model" in imports and "topology.smi_text" in imports
    assert nx.is_directed_acyclic_graph(g), f"import circle: {nx.find_cycle(g)}"
    assert imports["topology.model"] == {"topology.errors"}  # the plain values import nothing above them
    assert {"topology.model"} <= imports["topology._json"] and {"topology.model"} <= imports["topology._graph"]


# ------------------------------------------------------------------------------------ bandwidth files
def test_bench_fixture_loads() -> None:
    bw = load_bandwidth(FIXTURES / "bench_4gpu_2x2.json")
    assert isinstance(bw, Bandwidth) and bw.num_gpus == 4 and bw.buffer_bytes == 256 << 20
    assert bw.gpus[2].h2d_GBps == pytest.approx(12.66) and bw.root_complex_of(3).gpus == [2, 3]
    assert bw.upload_GBps(0) == pytest.approx(12.61)
    assert bw.upload_GBps(0, concurrent=2) == pytest.approx(6.4)  # half the root complex total
    assert bw.download_GBps(1, concurrent=2) == pytest.approx(6.6)
    assert bw.p2p(0, 1) == pytest.approx(11.9) and bw.p2p(0, 2) is None
    assert Bandwidth.from_json(json.loads(json.dumps(bw.to_json()))) == bw
    assert list(bw.to_json())[:3] == ["schema", "measured_at", "host"]


def test_bench_file_errors(tmp_path: Path) -> None:
    good = json.loads((FIXTURES / "bench_4gpu_2x2.json").read_text())
    edits = {
        "missing": (lambda d: d["gpus"][1].pop("d2h_GBps"), "missing key 'gpus[1].d2h_GBps'"),
        "schema": (lambda d: d.update(schema="mobius.bandwidth/0"), "key 'schema' is 'mobius.bandwidth/0'"),
        "p2p": (lambda d: d["p2p_GBps"].pop(), "'p2p_GBps' must be a 4 x 4"),
        "rc": (lambda d: d["root_complexes"][1].update(gpus=[2]), "each GPU index 0..3 exactly once"),
        "neg": (lambda d: d["root_complexes"][0].update(h2d_total_GBps=0), "h2d_total_GBps' must be > 0"),
        "type": (lambda d: d["gpus"][0].update(h2d_GBps="fast"), "gpus[0].h2d_GBps' must be a"),
    }
    _assert_bandwidth_errors(good, edits, tmp_path)
    with pytest.raises(TopologyFileError, match="no such file"):
        load_bandwidth(tmp_path / "none.json")


def _assert_bandwidth_errors(good: dict, edits: dict, tmp_path: Path) -> None:
    """Each edit of a good bandwidth file is refused with its message, naming the file."""
    for name, (edit, message) in edits.items():
        doc = json.loads(json.dumps(good))
        edit(doc)
        path = tmp_path / f"{name.replace(' ', '_')}.json"
        path.write_text(json.dumps(doc))
        with pytest.raises(TopologyFileError) as info:
            load_bandwidth(path)
        assert str(info.value).startswith(f"{path}: ") and message in str(info.value), name


def test_bench_streams_fixture() -> None:
    bw = load_bandwidth(FIXTURES / "bench_3gpu_streams.json")
    pair, single = bw.root_complexes
    assert pair.h2d_total_GBps_by_streams == [12.6, 12.9] and single.d2h_total_GBps_by_streams == [26.05, 26.2]
    assert [pair.aggregate_GBps("h2d", k) for k in (1, 2, 3, 8)] == [12.6, 12.9, 12.9, 12.9]  # beyond: last measured
    assert [single.aggregate_GBps("d2h", k) for k in (1, 2, 3)] == [26.05, 26.2, 26.2]
    assert bw.upload_GBps(2, concurrent=2) == pytest.approx(25.3 / 2)  # two streams on the one GPU of its root complex
    assert bw.download_GBps(0, concurrent=2) == pytest.approx(13.2 / 2) and bw.upload_GBps(1) == pytest.approx(12.58)
    assert Bandwidth.from_json(json.loads(json.dumps(bw.to_json()))) == bw
    assert bw.to_json()["root_complexes"][1]["h2d_total_GBps_by_streams"] == [24.85, 25.3]
    with pytest.raises(ValueError, match="direction"):
        pair.aggregate_GBps("up", 1)
    with pytest.raises(ValueError, match=">= 1"):
        pair.aggregate_GBps("h2d", 0)


def test_bench_old_file_without_streams() -> None:
    """Files from before the stream sweep load, fall back to the all-GPU totals and are written back unchanged."""
    raw = json.loads((FIXTURES / "bench_4gpu_2x2.json").read_text())
    bw = Bandwidth.from_json(raw)
    rc = bw.root_complex_of(2)
    assert rc.h2d_total_GBps_by_streams == [] and rc.d2h_total_GBps_by_streams == []
    assert [rc.aggregate_GBps("h2d", k) for k in (1, 2, 5)] == [12.85] * 3 and rc.aggregate_GBps("d2h", 1) == 13.24
    assert bw.to_json() == raw


def test_bench_streams_file_errors(tmp_path: Path) -> None:
    good = json.loads((FIXTURES / "bench_3gpu_streams.json").read_text())
    edits = {
        "zero": (lambda d: d["root_complexes"][0]["h2d_total_GBps_by_streams"].append(0),
                 "key 'root_complexes[0].h2d_total_GBps_by_streams[2]' must be a number > 0, got 0"),
        "text": (lambda d: d["root_complexes"][1].update(d2h_total_GBps_by_streams=["fast"]),
                 "key 'root_complexes[1].d2h_total_GBps_by_streams[0]' must be a number > 0"),
        "not a list": (lambda d: d["root_complexes"][1].update(d2h_total_GBps_by_streams=26.0),
                       "key 'root_complexes[1].d2h_total_GBps_by_streams' must be a list"),
    }
    _assert_bandwidth_errors(good, edits, tmp_path)
    doc = json.loads(json.dumps(good))
    doc["root_complexes"][0]["h2d_total_GBps_by_streams"] = None  # null reads as not measured
    assert Bandwidth.from_json(doc).root_complexes[0].aggregate_GBps("h2d", 1) == 12.9


def test_stream_plan_and_aggregate() -> None:
    from topology.bench import aggregate_GBps, max_streams, stream_plan

    assert [max_streams(g) for g in ([3], [0, 1], [0, 1, 2, 3])] == [2, 2, 4]
    assert stream_plan([5], 2) == [(5, 0), (5, 1)]  # one GPU: the second stream is a second lane on it
    assert stream_plan([0, 1, 2], 2) == [(0, 0), (1, 0)]
    assert stream_plan([2, 3], 5) == [(2, 0), (3, 0), (2, 1), (3, 1), (2, 2)]
    assert aggregate_GBps(2e9, [1.0]) == pytest.approx(2.0)
    assert aggregate_GBps(2e9, [0.5, 1.0, 0.8]) == pytest.approx(6.0)  # all bytes over the slowest stream's time
    for bad in (lambda: stream_plan([], 1), lambda: stream_plan([0], 0), lambda: aggregate_GBps(1e9, []),
                lambda: aggregate_GBps(1e9, [1.0, 0.0])):
        with pytest.raises(ValueError):
            bad()


def _shared_link(per_stream: float, link: float, plans: list[list[tuple[int, int]]]) -> Callable[[list[tuple[int, int]]], list[float]]:
    """A stand-in for the CUDA timing: k streams split one link of ``link`` GB/s, each at most ``per_stream``."""
    def time_plan(plan: list[tuple[int, int]]) -> list[float]:
        assert len(set(plan)) == len(plan)  # every stream has its own buffers
        plans.append(plan)
        rate = min(per_stream, link / len(plan))
        return [(1 + 0.01 * s) / rate for s in range(len(plan))]  # 1 GB each; later streams finish a little later
    return time_plan


def test_stream_sweep_without_gpu() -> None:
    from topology.bench import root_complex_figures, stream_sweep

    plans: list[list[tuple[int, int]]] = []
    h2d = stream_sweep([4, 5, 6], 1e9, _shared_link(12.0, 20.0, plans))
    assert [len(p) for p in plans] == [1, 2, 3] and plans[2] == [(4, 0), (5, 0), (6, 0)]
    assert h2d == pytest.approx([12.0, 20.0 / 1.01, 20.0 / 1.02])
    rc = root_complex_figures([4, 5, 6], (12.0, 13.0), h2d, [x + 1 for x in h2d])
    assert rc.h2d_total_GBps == round(h2d[2], 2) and rc.h2d_concurrent_GBps_per_gpu == round(h2d[2] / 3, 2)
    assert rc.d2h_total_GBps_by_streams == [round(x + 1, 2) for x in h2d]

    plans.clear()
    one = stream_sweep([7], 1e9, _shared_link(30.0, 32.0, plans))  # one GPU whose two copy engines share its link
    assert plans == [[(7, 0)], [(7, 0), (7, 1)]] and one == pytest.approx([30.0, 16.0 * 2 / 1.01])
    single = root_complex_figures([7], (29.5, 31.0), one, one)
    assert (single.h2d_total_GBps, single.d2h_concurrent_GBps_per_gpu) == (29.5, 31.0)  # totals: the GPU alone
    assert single.h2d_total_GBps_by_streams == [30.0, round(32.0 / 1.01, 2)]


def test_measure_without_gpu_on_a_modelled_box(monkeypatch: pytest.MonkeyPatch) -> None:
    """measure() end to end with the CUDA calls replaced by a model: root complex [0, 1] shares a 20 GB/s
    link (12 GB/s per stream at most), GPU 2 alone has 32 GB/s (30 per stream)."""
    from topology import bench

    link, per_stream, rc_of = {0: 20.0, 1: 32.0}, {0: 12.0, 1: 30.0}, {0: 0, 1: 0, 2: 1}
    allocated: list[int] = []

    def time_jobs(torch: object, jobs: list, repeats: int) -> list[float]:
        busy = [sum(1 for other in jobs if rc_of[other.device] == rc_of[j.device]) for j in jobs]
        return [repeats / min(per_stream[rc_of[j.device]], link[rc_of[j.device]] / k) for j, k in zip(jobs, busy)]

    cuda = SimpleNamespace(can_device_access_peer=lambda i, j: False, get_device_name=lambda d: "modelled GPU")
    monkeypatch.setattr(bench, "require_cuda", lambda: 3)
    monkeypatch.setattr(bench, "_torch", lambda: SimpleNamespace(cuda=cuda, __version__="model"))
    def buffers(torch: object, device: int, size: int) -> SimpleNamespace:
        allocated.append(device)
        return SimpleNamespace(device=device, up=None, down=None)

    monkeypatch.setattr(bench, "_buffers", buffers)
    monkeypatch.setattr(bench, "_time_jobs", time_jobs)
    bw = bench.measure(Topology.synthetic([[0, 1], [2]]), size_bytes=10**9, repeats=2, progress=False)
    pair, single = bw.root_complexes
    assert sorted(allocated) == [0, 1, 2, 2]  # one lane per GPU, a second on the lone GPU 2
    assert pair.h2d_total_GBps_by_streams == [12.0, 20.0] and pair.d2h_total_GBps_by_streams == [12.0, 20.0]
    assert (pair.h2d_total_GBps, pair.h2d_concurrent_GBps_per_gpu) == (20.0, 10.0)
    assert single.h2d_total_GBps_by_streams == [30.0, 32.0] and single.h2d_total_GBps == bw.gpus[2].h2d_GBps == 30.0
    assert bw.upload_GBps(2, concurrent=2) == 16.0 and bw.p2p_GBps == [[None] * 3 for _ in range(3)]


def test_render_stream_table() -> None:
    text = format_bandwidth(load_bandwidth(FIXTURES / "bench_3gpu_streams.json"))
    assert "GPUs       k=1   k=2" in text and "0,1   H2D  12.6  12.9" in text and "2     D2H  26.1  26.2" in text
    assert "k copy streams" not in format_bandwidth(load_bandwidth(FIXTURES / "bench_4gpu_2x2.json"))


def test_heatmap_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from topology.bench import heatmap_png

    out = heatmap_png(load_bandwidth(FIXTURES / "bench_4gpu_2x2.json"), tmp_path / "bw.png")
    assert out is not None and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.skipif(_cuda_available(), reason="checks the no-GPU message")
def test_bench_without_gpu() -> None:
    from topology import bench

    with pytest.raises(TopologyUnavailable, match="no CUDA GPU: nothing to measure"):
        bench.measure()


# ------------------------------------------------------------------------------------ the command
def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """Run ``mobius topo`` the way mobius.cli.main does: MobiusError -> one line, exit code 2."""
    parser = cli.build_parser("topo")
    args = parser.parse_args(["topo", *argv])
    try:
        code = args.func(args)
    except MobiusError as e:
        print(f"mobius: error: {e}", file=sys.stderr)
        code = 2
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_from_text(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(["--from", str(FIXTURES / "topo2x2_sys.txt"), "--map", "8"], capsys)
    assert code == 0
    assert "RC0 rc0  NUMA 0  GPUs 0, 1" in out and "RC1 rc1  NUMA 1  GPUs 2, 3" in out
    assert "GPU0  X     PIX   SYS   SYS" in out and "Peer access" in out
    assert "worker -> GPU: 0->0  1->2  2->1  3->3" in out and "sequential mapping: 10.133" in out


def test_cli_json_round_trip(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, _ = _run(["--from", str(FIXTURES / "dgx_a100_nv12.txt"), "--json", "--map", "12"], capsys)
    doc = json.loads(out)
    assert code == 0 and isinstance(doc["gpus"], list) and doc["root_complexes"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert doc["mapping"]["num_stages"] == 12 and len(doc["mapping"]["stage_gpus"]) == 12
    saved = tmp_path / "box.json"
    saved.write_text(out)
    assert load_topology(saved) == load_topology(FIXTURES / "dgx_a100_nv12.txt")
    code, again, _ = _run(["--from", str(saved), "--json"], capsys)
    assert code == 0 and json.loads(again)["nvlink"] == doc["nvlink"]


def test_cli_without_gpu(capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(topo_cmd, "detect", _broken_detect(tmp_path))
    code, out, err = _run([], capsys)
    assert code == 2 and out == ""
    assert err.startswith("mobius: error: no NVIDIA GPU found here") and err.count("\n") == 1 and "Traceback" not in err
    code, _, err = _run(["--bench", "--from", str(FIXTURES / "single_gpu.txt")], capsys)
    assert code == 2 and "cannot be combined with --from" in err
    code, _, err = _run(["--from", str(tmp_path / "nope.txt")], capsys)
    assert code == 2 and err.strip() == f"mobius: error: {tmp_path / 'nope.txt'}: no such file"


@pytest.mark.skipif(_cuda_available(), reason="checks the no-GPU message")
def test_cli_bench_without_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(["--bench"], capsys)
    assert code == 2 and out == "" and "no CUDA GPU: nothing to measure" in err


def test_cli_rejects_bad_stage_count(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _run(["--map", "0"], capsys)
    assert "expected a number >= 1" in capsys.readouterr().err


@pytest.mark.skipif(not all(importlib.util.find_spec(f"mobius.commands.{m}") for m in ("train", "plan")),
                    reason="mobius.cli imports the train and plan commands, not written yet")
def test_real_cli_entry_point() -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    done = subprocess.run([sys.executable, "-m", "mobius.cli", "topo", "--from", str(FIXTURES / "topo1x3_spaces.txt"), "--json"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["root_complexes"] == [[0], [1, 2, 3]]


# ------------------------------------------------------------------------------------ on a real GPU
@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_available(), reason="needs a CUDA GPU")
def test_gpu_detect_and_bench(tmp_path: Path) -> None:
    import torch

    from topology import bench

    topo = detect()
    assert topo.num_gpus == torch.cuda.device_count() and topo.source.startswith(("nvml", "sysfs", "nvidia-smi"))
    bw = bench.measure(topo, size_bytes=64 << 20, repeats=3, progress=False)
    saved = tmp_path / "bw.json"
    topology.save_bandwidth(bw, saved)
    again = load_bandwidth(saved)
    assert again.num_gpus == topo.num_gpus and all(g.h2d_GBps > 0.5 and g.bidir_GBps > 0.5 for g in again.gpus)
    for rc in again.root_complexes:
        k = bench.max_streams(rc.gpus)
        assert len(rc.h2d_total_GBps_by_streams) == len(rc.d2h_total_GBps_by_streams) == k
        if len(rc.gpus) > 1:
            assert rc.h2d_total_GBps == rc.h2d_total_GBps_by_streams[len(rc.gpus) - 1]
    print(json.dumps(again.to_json(), indent=1))
    print(format_bandwidth(again))


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_available(), reason="needs a CUDA GPU")
def test_gpu_concurrency_machinery() -> None:
    """GPU 0 as a one-GPU root complex: the sweep runs one stream, then two streams sharing its link."""
    import torch

    from topology import bench

    size, repeats = 64 << 20, 3
    pool = bench._BufferPool(torch, size)
    gb = size * repeats / 1e9
    alone = gb / bench._time_jobs(torch, [bench._upload(pool.get(0))], repeats)[0]
    down = gb / bench._time_jobs(torch, [bench._download(pool.get(0))], repeats)[0]
    steps: list[int] = []
    rc = bench._root_complex(torch, pool, [0], [(alone, down, alone)], repeats, SimpleNamespace(update=steps.append))
    assert len(steps) == 4 and set(pool.bufs) == {(0, 0)}  # 2 stream counts x 2 directions; the second lane let go
    one, two = rc.h2d_total_GBps_by_streams
    assert one == pytest.approx(alone, rel=0.35) and two == pytest.approx(alone, rel=0.35)  # one link, shared
    assert rc.h2d_total_GBps == round(alone, 2) and len(rc.d2h_total_GBps_by_streams) == 2
    assert bench._peer(torch, pool.get(0), pool.get(0, 1), size, repeats) > 1.0
    print(f"\nalone {alone:.1f} GB/s; H2D by streams {rc.h2d_total_GBps_by_streams}, D2H by streams {rc.d2h_total_GBps_by_streams}")
