"""The machine as the planner sees it: GPUs, memory, PCIe links and what they share.

Each GPU has its own host link (``h2d_Bps``, ``d2h_Bps``, per direction). GPUs are grouped into
root complexes (``groups``); in a commodity server the GPUs of a group sit behind one PCIe switch
whose uplink to the CPU is the resource they share (``rc_h2d_Bps``/``rc_d2h_Bps`` per group, per
direction). Directions are independent (PCIe is full duplex) unless ``bidir_Bps`` caps a GPU's two
directions together. ``p2p_Bps`` is the GPU-to-GPU rate when peer-to-peer works; ``None`` means
activations travel through pinned host memory (two hops).

The host is shared too: its workers' CPU AdamW updates draw on one memory system and one set of
cores. ``cpu_adam_params_per_s`` is one worker's rate when it updates alone, ``host_adam_params_per_s``
the host's total when all of them update at once; while ``k`` workers update, each runs at
``min(alone, total / k)`` (:meth:`Hardware.cpu_update_rate`). Both are the rates *inside* a training
step (uploads, downloads and kernel dispatch share the memory bandwidth and cores); where they come
from (measured here, configured, or a default) is in ``host_sources``.

Everything here is plain numbers; :meth:`Hardware.from_topology` is the one adapter to
``topology``'s types and imports nothing from it.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

from mobius.errors import ConfigError
from partition.costs import UPDATE_BYTES
from partition.estimate import MEMORY_EFFICIENCY
from partition.gpus import GB, GPU_CATALOGUE, PCIE_LANE_Bps, GiB, gpu_spec, lookup_gpu

log = logging.getLogger(__name__)

DEFAULT_RESERVE_BYTES = int(1.5 * GiB)  # CUDA context, cuBLAS workspace, allocator slack
PAPER_LINK_Bps = 13.1e9  # the Mobius paper's maximum measured host<->GPU bandwidth (§4.2)
PAPER_ADAM_PARAMS_PER_S = 4.0e9  # assumption: DeepSpeed-style CPU Adam on 2 x Xeon Gold 6130 (32 cores): the
# whole two-socket host's rate, all its workers together (about 120 GB/s of DRAM traffic at 30 bytes per parameter:
# the fused step and the half copy it writes, as DEVICE_ADAM_BYTES counts them on a GPU)
CPU_UPDATE_IN_STEP = 0.68  # the CPU AdamW's rate inside a training step / its rate measured alone: with uploads,
# downloads and kernel dispatch sharing the host's memory bandwidth and cores, an H100 box (16 cores, one worker)
# ran 0.71 (1.42B) and 0.66 (3.94B) of the isolated rate in clipped steps (docs/perf-gpu.md)
HOST_DEFAULT_SOURCE = (f"a default for a server planned from elsewhere: the Mobius paper's host (2 x Xeon Gold 6130) "
                       f"at {PAPER_ADAM_PARAMS_PER_S / 1e9:.1f} G params/s alone x {CPU_UPDATE_IN_STEP} inside a step; "
                       f"set partition.cpu_update_rate to the server's")
HOST_COPY_Bps = 5e9  # assumed: memory copies within one host, the one figure for both a tensor sent between two
# worker processes (a gloo send through a socket: a tied weight's exchange) and CPU workers' "links" (memcpy between
# a worker's host and device buffers; mobius.app.planning's CPU workers)
MAILBOX_MESSAGE_S = 0.1e-3  # measured: a CPU worker's dispatch thread per activation or gradient message to another
# worker of its machine (scheduler.links.MailLink): a send, which copies it into the mailbox, 0.18-0.20 ms; a receive
# 0.02 ms (GPT-2 of python bench/cpu_pipeline_bench.py, 2 micro-batches with clipping, 2 workers, 2-core VM,
# 2026-11-27, the handlers timed per action kind); the copy out is the hop the links' rate times
GLOO_MESSAGE_S = 0.3e-3  # measured: the same through gloo (scheduler.links.DirectLink, CPU workers of several
# machines), 0.28-0.38 ms per message inside a run (a receive, posted when the step began by the link's thread, 0.02
# ms where the list has it; a send, which then writes its data at once, 0.51-0.93 ms; GPT-2 of python
# bench/cpu_pipeline_bench.py on 2 workers, swapped pipeline of 8 stages and round-robin, 2-core VM, 2026-11-27)
DEVICE_ADAM_BYTES = UPDATE_BYTES  # a resident stage's AdamW on its device, per parameter:
# the fused step's traffic (partition.costs.ADAM_BYTES) and writing the half copy the stage computes with (2 bytes)


def device_adam_rate(mem_GBps: float) -> float:
    """Parameters per second of a resident stage's AdamW on a GPU with this memory bandwidth (GB/s,
    datasheet): ``DEVICE_ADAM_BYTES`` per parameter at ``MEMORY_EFFICIENCY`` of it."""
    return mem_GBps * 1e9 * MEMORY_EFFICIENCY / DEVICE_ADAM_BYTES


DEVICE_ADAM_PARAMS_PER_S = device_adam_rate(GPU_CATALOGUE["rtx3090"].mem_GBps)  # an RTX 3090 (an unnamed GPU)


@dataclass
class Hardware:
    """GPUs, usable memory and the bandwidth model the planner and simulator use."""

    num_gpus: int
    gpu_memory_bytes: int  # usable per GPU for model data (context and slack already taken off)
    h2d_Bps: list[float]
    d2h_Bps: list[float]
    groups: list[list[int]]
    rc_h2d_Bps: list[float]
    rc_d2h_Bps: list[float]
    p2p_Bps: float | None = None
    bidir_Bps: list[float] | None = None
    p2p_pairs_Bps: list[list[float | None]] | None = None  # per pair (overrides p2p_Bps where given)
    rc_h2d_by_streams: list[list[float]] | None = None  # per group: aggregate rate of k = 1, 2, ... streams
    rc_d2h_by_streams: list[list[float]] | None = None
    cpu_adam_params_per_s: float = PAPER_ADAM_PARAMS_PER_S  # one worker's CPU AdamW (+ half refresh), alone
    cpu_adam_half_grads_params_per_s: float | None = None  # ... reading half-precision gradients (None: the same)
    host_adam_params_per_s: float | None = None  # the host's total while all its workers update (None: unshared)
    host_copy_Bps: float = HOST_COPY_Bps  # tensors between worker processes through host memory (gloo)
    message_s: float = 0.0  # a worker's dispatch thread per message it posts to another worker (a send or a
    # receive), which holds up its next compute: CPU workers' (MAILBOX_MESSAGE_S, GLOO_MESSAGE_S); a GPU's runs ahead
    device_adam_params_per_s: float = DEVICE_ADAM_PARAMS_PER_S  # a resident stage's AdamW on its device
    host_cores: int = 0  # CPU workers: the host's cores, which their compute shares with their copies, sums and CPU
    # updates (each runs torch kernels on ``worker_threads`` threads); 0: the compute runs on devices of its own
    worker_threads: int = 1
    host_memory_bytes: int | None = None  # host memory the stores may use (None: unknown, not checked)
    name: str = "custom"
    gpu_names: list[str] = field(default_factory=list)
    host_sources: dict[str, str] = field(default_factory=dict)  # "cpu", "memory": where the host figures come from

    def __post_init__(self) -> None:
        n = self.num_gpus
        if n < 1:
            raise ConfigError(f"hardware needs at least one GPU, got {n}")
        for key in ("h2d_Bps", "d2h_Bps"):
            if len(getattr(self, key)) != n or min(getattr(self, key)) <= 0:
                raise ConfigError(f"hardware.{key} needs {n} positive rates, got {getattr(self, key)}")
        members = sorted(g for grp in self.groups for g in grp)
        if members != list(range(n)):
            raise ConfigError(f"hardware groups {self.groups} must cover GPUs 0..{n - 1} exactly once")
        if len(self.rc_h2d_Bps) != len(self.groups) or len(self.rc_d2h_Bps) != len(self.groups):
            raise ConfigError("hardware needs one shared rate per group and direction")
        if self.gpu_memory_bytes <= 0:
            raise ConfigError(f"usable GPU memory must be positive, got {self.gpu_memory_bytes} bytes")
        self._group_index = {g: i for i, grp in enumerate(self.groups) for g in grp}

    def cpu_update_rate(self, half_grads: bool = False, updating: int = 1) -> float:
        """Parameters per second of one worker's CPU AdamW (fp32 or half-precision gradients) while
        ``updating`` workers of the host update at once: its rate alone, or its share of the host's
        total, whichever is lower (half-precision gradients scale the total as they scale one worker)."""
        alone = self.cpu_adam_params_per_s
        if half_grads and self.cpu_adam_half_grads_params_per_s:
            alone = self.cpu_adam_half_grads_params_per_s
        if self.host_adam_params_per_s is None:
            return alone
        total = self.host_adam_params_per_s * alone / self.cpu_adam_params_per_s
        return min(alone, total / max(updating, 1))

    def host_update_total(self, half_grads: bool = False, workers: int | None = None) -> float:
        """The CPU AdamW rate of the host, ``workers`` (default: every GPU's worker) updating at once."""
        n = self.num_gpus if workers is None else workers
        return n * self.cpu_update_rate(half_grads, n)

    def group_of(self, gpu: int) -> int:
        """Index of the root complex (group) holding ``gpu``."""
        return self._group_index[gpu]

    def p2p_rate(self, src: int, dst: int) -> float | None:
        """Peer-to-peer rate from ``src`` to ``dst``, or None when that pair goes through host memory."""
        if self.p2p_pairs_Bps is not None:
            return self.p2p_pairs_Bps[src][dst]
        return self.p2p_Bps

    def rc_rate(self, group: int, direction: str, streams: int) -> float:
        """A root complex's aggregate rate in one direction ("h2d" or "d2h") while ``streams``
        copies share it: measured per stream count when known (the last figure beyond), else its
        shared rate."""
        by = self.rc_h2d_by_streams if direction == "h2d" else self.rc_d2h_by_streams
        if by and by[group]:
            return by[group][min(max(streams, 1), len(by[group])) - 1]
        return (self.rc_h2d_Bps if direction == "h2d" else self.rc_d2h_Bps)[group]

    def uncontended_h2d(self, gpu: int) -> float:
        """Host->GPU rate when ``gpu`` transfers alone."""
        rate = min(self.h2d_Bps[gpu], self.rc_rate(self.group_of(gpu), "h2d", 1))
        return min(rate, self.bidir_Bps[gpu]) if self.bidir_Bps else rate

    def uncontended_d2h(self, gpu: int) -> float:
        """GPU->host rate when ``gpu`` transfers alone."""
        rate = min(self.d2h_Bps[gpu], self.rc_rate(self.group_of(gpu), "d2h", 1))
        return min(rate, self.bidir_Bps[gpu]) if self.bidir_Bps else rate

    def shared_h2d(self, gpu: int) -> float:
        """Host->GPU rate when every GPU of the group uploads at once (the pessimistic view)."""
        grp = self.group_of(gpu)
        n = len(self.groups[grp])
        return min(self.uncontended_h2d(gpu), self.rc_rate(grp, "h2d", n) / n)

    def shared_d2h(self, gpu: int) -> float:
        grp = self.group_of(gpu)
        n = len(self.groups[grp])
        return min(self.uncontended_d2h(gpu), self.rc_rate(grp, "d2h", n) / n)

    def subset(self, gpus: list[int]) -> "Hardware":
        """The same machine restricted to ``gpus`` (renumbered 0..len-1 in that order)."""
        pos = {g: i for i, g in enumerate(gpus)}
        groups, rc_h, rc_d, keep = [], [], [], []
        for k, (grp, h, d) in enumerate(zip(self.groups, self.rc_h2d_Bps, self.rc_d2h_Bps)):
            kept = [pos[g] for g in grp if g in pos]
            if kept:
                groups.append(kept)
                rc_h.append(h)
                rc_d.append(d)
                keep.append(k)
        by_h = [self.rc_h2d_by_streams[k] for k in keep] if self.rc_h2d_by_streams else None
        by_d = [self.rc_d2h_by_streams[k] for k in keep] if self.rc_d2h_by_streams else None
        return dataclasses.replace(
            self, num_gpus=len(gpus), h2d_Bps=[self.h2d_Bps[g] for g in gpus], d2h_Bps=[self.d2h_Bps[g] for g in gpus],
            groups=groups, rc_h2d_Bps=rc_h, rc_d2h_Bps=rc_d, rc_h2d_by_streams=by_h, rc_d2h_by_streams=by_d,
            bidir_Bps=[self.bidir_Bps[g] for g in gpus] if self.bidir_Bps else None,
            p2p_pairs_Bps=[[self.p2p_pairs_Bps[a][b] for b in gpus] for a in gpus] if self.p2p_pairs_Bps else None,
            gpu_names=[self.gpu_names[g] for g in gpus] if self.gpu_names else [])

    def describe(self) -> str:
        """One line: GPUs, memory, links, groups."""
        link = self.h2d_Bps[0] / GB
        rc = ", ".join(f"{grp}@{r / GB:.1f}" for grp, r in zip(self.groups, self.rc_h2d_Bps))
        pairs = sum(1 for a in range(self.num_gpus) for b in range(self.num_gpus) if a != b and self.p2p_rate(a, b))
        p2p = (f"P2P on {pairs} of {self.num_gpus * (self.num_gpus - 1)} GPU pairs" if pairs
               else "no P2P (activations via host memory)")
        messages = f", {self.message_s * 1e3:.2f} ms per message posted" if self.message_s else ""
        cores = (f", {self.host_cores} cores shared by the compute ({self.worker_threads} thread(s) a worker), "
                 f"copies, sums and updates" if self.host_cores else "")
        return (f"{self.name}: {self.num_gpus} GPU(s), {self.gpu_memory_bytes / GiB:.1f} GiB usable each, "
                f"link {link:.1f} GB/s, root complexes {rc} GB/s, {p2p}{messages}{cores}, "
                f"CPU AdamW {self.host_update_total() / 1e9:.2f} G params/s in total")

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "Hardware":
        return cls(**data)

    # ------------------------------------------------------------------------------ presets
    @classmethod
    def uniform(cls, num_gpus: int, gpu_memory_bytes: int, link_Bps: float, groups: list[list[int]] | None = None,
                uplink_Bps: float | None = None, p2p_Bps: float | None = None,
                cpu_adam_params_per_s: float = PAPER_ADAM_PARAMS_PER_S, name: str = "uniform",
                host_adam_params_per_s: float | None = None) -> "Hardware":
        """``num_gpus`` identical GPUs; each group shares one uplink of ``uplink_Bps`` (default: one link's
        worth); each worker updates at ``cpu_adam_params_per_s``, all of them together at most at
        ``host_adam_params_per_s`` (None: nothing shared)."""
        groups = groups or [[g] for g in range(num_gpus)]
        up = uplink_Bps if uplink_Bps is not None else link_Bps
        return cls(num_gpus=num_gpus, gpu_memory_bytes=gpu_memory_bytes, h2d_Bps=[link_Bps] * num_gpus,
                   d2h_Bps=[link_Bps] * num_gpus, groups=groups, rc_h2d_Bps=[up] * len(groups),
                   rc_d2h_Bps=[up] * len(groups), p2p_Bps=p2p_Bps, cpu_adam_params_per_s=cpu_adam_params_per_s,
                   host_adam_params_per_s=host_adam_params_per_s, name=name)

    @classmethod
    def paper_3090ti(cls, groups: list[list[int]] | None = None, link_Bps: float = PAPER_LINK_Bps,
                     uplink_Bps: float = PAPER_LINK_Bps, memory_gib: float = 24.0,
                     reserve_bytes: int = DEFAULT_RESERVE_BYTES,
                     cpu_adam_params_per_s: float = PAPER_ADAM_PARAMS_PER_S) -> "Hardware":
        """The Mobius paper's box (§4): 24 GB RTX 3090 Ti GPUs behind PCIe switches, no P2P.

        Default ``groups`` is Topo 2+2 (``[[0, 1], [2, 3]]``). One GPU alone reaches the paper's
        measured 13.1 GB/s; GPUs of one group share the switch's uplink (13.1 GB/s per direction),
        so two concurrent uploads under one root complex get half each. The host's CPU AdamW rate
        (``cpu_adam_params_per_s``, its two sockets' worth) is shared by all its workers.
        """
        groups = groups or [[0, 1], [2, 3]]
        n = sum(len(g) for g in groups)
        hw = cls.uniform(n, int(memory_gib * GiB) - reserve_bytes, link_Bps, groups, uplink_Bps, None,
                         cpu_adam_params_per_s, name=f"paper 3090 Ti box {'+'.join(str(len(g)) for g in groups)}",
                         host_adam_params_per_s=cpu_adam_params_per_s)
        hw.host_sources = {"cpu": "the Mobius paper's host (2 x Xeon Gold 6130), assumed"}
        hw.gpu_names = ["rtx3090ti"] * n
        return hw

    @classmethod
    def from_topology(cls, topo: Any, bandwidth: Any = None, gpu_memory_bytes: int | None = None,
                      reserve_bytes: int = DEFAULT_RESERVE_BYTES, p2p: bool | None = None,
                      gpu: Any = None) -> "Hardware":
        """Build from a ``topology.Topology`` and optionally the ``mobius topo --bench`` figures.

        Link rates: measured (bandwidth file), else the GPU's PCIe generation and width, else the
        catalogue entry of its name (or of ``gpu``, a catalogue name or GPUSpec, for files that do
        not name their GPUs). A root complex's shared rate: measured, else its switch's uplink when
        known, else one GPU link's worth (the GPUs sit behind one switch, as in the paper's box).
        ``gpu_memory_bytes`` (usable) overrides the devices' memory minus ``reserve_bytes``.
        ``p2p``: None follows the topology (and measured peer rates), False forces host staging.
        The host's CPU AdamW rate is a stated default (``HOST_DEFAULT_SOURCE``) until the planner
        measures this machine's or takes ``partition.cpu_update_rate``.
        """
        gpus = list(topo.gpus)
        pos = {g.index: i for i, g in enumerate(gpus)}
        groups = [[pos[i] for i in grp if i in pos] for grp in topo.root_complexes]
        groups = [g for g in groups if g] or [[i] for i in range(len(gpus))]
        specs = [lookup_gpu(g.name) or (gpu_spec(gpu) if gpu is not None else None) for g in gpus]
        memory = gpu_memory_bytes or _usable_memory(gpus, specs, reserve_bytes)
        bw = _bandwidth_dict(bandwidth) if bandwidth is not None else None
        h2d, d2h = _gpu_links(gpus, specs, bw)
        rc_h, rc_d = _shared_links(topo, gpus, groups, h2d, d2h, bw)
        by_h, by_d = _by_streams(gpus, groups, bw)
        pairs = _p2p_pairs(topo, gpus, bw, min(h2d), p2p)
        names = [g.name if g.name != "unknown" or s is None else s.name for g, s in zip(gpus, specs)]
        known = next((s for s in specs if s is not None), None)
        device_adam = device_adam_rate(known.mem_GBps) if known else DEVICE_ADAM_PARAMS_PER_S
        return cls(num_gpus=len(gpus), gpu_memory_bytes=memory, h2d_Bps=h2d, d2h_Bps=d2h, groups=groups,
                   rc_h2d_Bps=rc_h, rc_d2h_Bps=rc_d, p2p_pairs_Bps=pairs, rc_h2d_by_streams=by_h,
                   rc_d2h_by_streams=by_d,
                   cpu_adam_params_per_s=PAPER_ADAM_PARAMS_PER_S * CPU_UPDATE_IN_STEP,
                   host_adam_params_per_s=PAPER_ADAM_PARAMS_PER_S * CPU_UPDATE_IN_STEP,
                   host_sources={"cpu": HOST_DEFAULT_SOURCE},
                   device_adam_params_per_s=device_adam,
                   name=f"{len(gpus)} x {names[0] if names else '?'} ({getattr(topo, 'source', 'topology')})",
                   gpu_names=names)


def _usable_memory(gpus: list, specs: list, reserve_bytes: int) -> int:
    sizes = [int(g.memory_bytes) or (s.memory_bytes if s else 0) for g, s in zip(gpus, specs)]
    if not sizes or min(sizes) <= 0:
        raise ConfigError("the topology does not say how much memory the GPUs have: set partition.gpu (a catalogue "
                          "GPU such as rtx3090) or partition.gpu_memory_gib")
    return min(sizes) - reserve_bytes


def _bandwidth_dict(bandwidth: Any) -> dict:
    """The ``mobius.bandwidth/1`` figures as a dict, from a dict or a ``topology.Bandwidth``."""
    data = bandwidth.to_json() if hasattr(bandwidth, "to_json") else bandwidth
    if not isinstance(data, dict) or "gpus" not in data:
        raise ConfigError("bandwidth figures have no 'gpus' list (expected schema mobius.bandwidth/1)")
    return data


def _gpu_links(gpus: list, specs: list, bw: dict | None) -> tuple[list[float], list[float]]:
    """Per-GPU host link rates per direction."""
    rates = []
    for g, s in zip(gpus, specs):
        if getattr(g, "pcie_gen", None) in PCIE_LANE_Bps and getattr(g, "pcie_width", None):
            rates.append(PCIE_LANE_Bps[g.pcie_gen] * g.pcie_width)
        else:
            rates.append(s.pcie_Bps() if s else PCIE_LANE_Bps[3] * 16)
    h2d, d2h = list(rates), list(rates)
    if bw is not None:
        by_index = {int(e["index"]): e for e in bw["gpus"]}
        for i, g in enumerate(gpus):
            if int(g.index) in by_index:
                e = by_index[int(g.index)]
                h2d[i], d2h[i] = float(e["h2d_GBps"]) * GB, float(e["d2h_GBps"]) * GB
    return h2d, d2h


_SAID: set[str] = set()


def _say_once(message: str) -> None:
    """Log an assumption once per process (auto mode plans several modes on one machine)."""
    if message not in _SAID:
        _SAID.add(message)
        log.info("%s", message)


def _shared_links(topo: Any, gpus: list, groups: list[list[int]], h2d: list[float], d2h: list[float],
                  bw: dict | None) -> tuple[list[float], list[float]]:
    """Per root complex: the shared host->GPU and GPU->host rates."""
    index = [int(g.index) for g in gpus]
    rc_h, rc_d = [max(h2d[g] for g in grp) for grp in groups], [max(d2h[g] for g in grp) for grp in groups]
    for k, grp in enumerate(groups):
        members = {index[g] for g in grp}
        for sw in getattr(topo, "switches", []) or []:
            if members <= set(sw.gpus) and sw.pcie_gen in PCIE_LANE_Bps and sw.pcie_width:
                rc_h[k] = rc_d[k] = PCIE_LANE_Bps[sw.pcie_gen] * sw.pcie_width
        for rc in (bw or {}).get("root_complexes", []):
            if set(int(i) for i in rc["gpus"]) == members and rc.get("h2d_total_GBps"):
                rc_h[k] = float(rc["h2d_total_GBps"]) * GB
                rc_d[k] = float(rc.get("d2h_total_GBps") or rc["h2d_total_GBps"]) * GB
    if bw is None:
        _say_once(f"no bandwidth file: assuming {', '.join(f'{r / GB:.1f}' for r in h2d)} per-GPU links and "
                  f"{', '.join(f'{r / GB:.1f}' for r in rc_h)} shared per root complex (run 'mobius topo --bench' "
                  f"on the server for measured figures)")
    return rc_h, rc_d


def _by_streams(gpus: list, groups: list[list[int]], bw: dict | None
                ) -> tuple[list[list[float]] | None, list[list[float]] | None]:
    """Per root complex, the measured aggregate rate of k = 1, 2, ... concurrent copy streams."""
    if not bw:
        return None, None
    index = [int(g.index) for g in gpus]
    out: dict[str, list[list[float]]] = {"h2d": [[] for _ in groups], "d2h": [[] for _ in groups]}
    for k, grp in enumerate(groups):
        members = {index[g] for g in grp}
        for rc in bw.get("root_complexes", []):
            if set(int(i) for i in rc["gpus"]) == members:
                for d in out:
                    out[d][k] = [float(x) * GB for x in rc.get(f"{d}_total_GBps_by_streams") or []]
    return tuple(v if any(v) else None for v in (out["h2d"], out["d2h"]))  # type: ignore[return-value]


def _p2p_pairs(topo: Any, gpus: list, bw: dict | None, link: float, p2p: bool | None
               ) -> list[list[float | None]] | None:
    """Peer rates per GPU pair (None where copies go through host memory), or None for no P2P at all."""
    n = len(gpus)
    allowed = getattr(topo, "p2p", None) or [[False] * n for _ in range(n)]
    if p2p is False or n < 2:
        return None
    index = [int(g.index) for g in gpus]
    measured = (bw or {}).get("p2p_GBps")
    pairs: list[list[float | None]] = [[None] * n for _ in range(n)]
    for a in range(n):
        for b in range(n):
            if a == b or not (allowed[index[a]][index[b]] or p2p):
                continue
            rate = measured[index[a]][index[b]] if measured else None
            pairs[a][b] = float(rate) * GB if rate else (link if not measured else None)
    return pairs if any(r for row in pairs for r in row) else None
