"""The machine a run is planned for, and the one place that resolves the parallel settings.

:func:`resolve` turns ``parallel.*`` (and ``partition.gpu_memory_gib``) plus a :class:`Machine`
into a :class:`~mobius.parallel.ParallelSettings`; every path (single, pipeline, planning, the
workers) takes that value instead of reading the config keys itself.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from mobius.config import Config
from mobius.errors import ConfigError, MobiusError, NotAvailableError
from mobius.parallel import Mode, ParallelSettings

log = logging.getLogger(__name__)

GiB = 2**30
CPU_WORKER_MEMORY_GIB = 4.0  # what a CPU worker standing in for a GPU may hold (tests, the demo)
DEVICE_RESERVE_BYTES = int(1.5 * GiB)  # CUDA context, cuBLAS workspace, allocator slack on a whole device
DISPATCH_THREADS = 2  # a GPU worker's kernel-dispatch and copy threads, left out of its AdamW threads


@dataclass
class Machine:
    """GPUs (a topology, or none), peer access, cores; ``local`` when it is this machine."""

    topology: Any | None  # topology.Topology, None without GPUs
    cpu_count: int
    local: bool
    peer: list[list[bool]] | None = None  # peer access [i][j]; None: the topology's

    @property
    def gpu_count(self) -> int:
        return len(self.topology.gpus) if self.topology is not None else 0

    def gpu_memory_bytes(self) -> int:
        """The smallest GPU's memory (0 when unknown)."""
        if self.topology is None:
            return 0
        return min(int(g.memory_bytes) for g in self.topology.gpus)

    def peer_access(self, a: int, b: int) -> bool:
        matrix = self.peer if self.peer is not None else self.topology.p2p
        return bool(matrix[a][b])

    def root_complexes(self) -> list[list[int]]:
        return [list(rc) for rc in self.topology.root_complexes] if self.topology is not None else []

    @classmethod
    def cpu_only(cls) -> "Machine":
        return cls(None, os.cpu_count() or 1, local=True)

    @classmethod
    def saved(cls, topo: Any, cpu_count: int | None = None) -> "Machine":
        """Another machine, known from a saved topology (``mobius plan --topology``)."""
        return cls(topo, cpu_count or os.cpu_count() or 1, local=False)

    @classmethod
    def detect(cls, cfg: Config) -> "Machine":
        """This machine: its CUDA GPUs (topology from ``topology.file`` or detected) and cores."""
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            return cls.cpu_only()
        topo = _local_topology(cfg, count)
        peer = [[a == b or torch.cuda.can_device_access_peer(a, b) for b in range(count)] for a in range(count)]
        return cls(topo, os.cpu_count() or 1, local=True, peer=peer)


def _local_topology(cfg: Config, count: int) -> Any:
    import torch

    import topology

    if cfg.topology.file:
        topo = topology.load_topology(cfg.topology.file)
        if len(topo.gpus) != count:
            raise ConfigError(f"topology.file {cfg.topology.file} has {len(topo.gpus)} GPU(s), but this machine "
                              f"shows {count}")
        return topo
    try:
        return topology.detect()
    except MobiusError as e:
        if count > 1:
            raise MobiusError(f"cannot detect how this machine's {count} GPUs are connected ({e}); save "
                              f"`nvidia-smi topo -m` to a file and set topology.file") from None
        props = torch.cuda.get_device_properties(0)
        log.debug("topology detection failed (%s); one GPU: %s", e, props.name)
        return topology.Topology.synthetic([1], memory_bytes=props.total_memory, name=props.name)


def resolve(cfg: Config, machine: Machine) -> ParallelSettings:
    """The parallel settings of a run of ``cfg`` on ``machine`` (every check in one place)."""
    p = cfg.parallel
    mode, reason = _mode(cfg)
    device = _device(p.device, machine)
    workers = p.devices
    gpus = min(workers, machine.gpu_count) if device == "cuda" else 0
    if mode == "zero" and device == "cuda" and 1 < workers and gpus < workers:
        raise ConfigError(f"parallel.mode=zero needs one GPU per rank (NCCL), but parallel.devices={workers} and "
                          f"this machine has {gpus} GPU(s)")
    memory, capped = _memory(cfg, machine, device, workers, gpus)
    settings = ParallelSettings(mode=mode, device=device, workers=workers, gpus=gpus,
                                p2p=_p2p(p.p2p, machine, device, workers, gpus), memory_bytes=memory,
                                memory_capped=capped, cpu_threads=_threads(machine, device, workers),
                                groups=_groups(machine, device, workers, gpus), reason=reason)
    return settings


def _mode(cfg: Config) -> tuple[Mode, str]:
    mode, devices = cfg.parallel.mode, cfg.parallel.devices
    if mode == "zero" and cfg.train.micro_batches % devices:
        raise ConfigError(f"parallel.mode=zero splits each step's train.micro_batches={cfg.train.micro_batches} "
                          f"evenly among parallel.devices={devices} ranks: make train.micro_batches a multiple of "
                          f"{devices}")
    if mode == "single" and devices != 1:
        raise ConfigError(f"parallel.mode=single runs on one device, but parallel.devices={devices}")
    if mode == "auto":
        return ("single", "auto: one device") if devices == 1 else ("pipeline", f"auto: {devices} devices")
    return mode, ""


def _device(want: str, machine: Machine) -> str:
    if want == "cuda" and machine.gpu_count == 0:
        raise NotAvailableError("parallel.device=cuda but no CUDA GPU is visible (set parallel.device=cpu to run "
                                "on CPU worker processes)")
    return "cuda" if want != "cpu" and machine.gpu_count > 0 else "cpu"


def _memory(cfg: Config, machine: Machine, device: str, workers: int, gpus: int) -> tuple[int, bool]:
    """Usable device memory per worker, and whether it must be enforced with a cap."""
    cap = cfg.partition.gpu_memory_gib
    if device == "cpu":
        return int((cap or CPU_WORKER_MEMORY_GIB) * GiB), False
    per_gpu = -(-workers // gpus)  # workers sharing the busiest GPU
    total = machine.gpu_memory_bytes() or _catalogue_memory(cfg)
    if cap is not None:
        if total and cap * GiB * per_gpu > total:
            raise ConfigError(f"partition.gpu_memory_gib={cap:g} for {per_gpu} worker(s) per GPU exceeds the "
                              f"GPU's {total / GiB:.1f} GiB")
        return int(cap * GiB), True
    if not total:
        raise ConfigError("the topology does not say how much memory the GPUs have: set partition.gpu (a catalogue "
                          "GPU such as rtx3090) or partition.gpu_memory_gib")
    if per_gpu > 1:
        return total // per_gpu, True
    return total - DEVICE_RESERVE_BYTES, False


def _catalogue_memory(cfg: Config) -> int:
    """Memory of the ``partition.gpu`` catalogue entry (a saved topology may not say)."""
    from partition.gpus import gpu_spec

    return gpu_spec(cfg.partition.gpu).memory_bytes if cfg.partition.gpu else 0


def _p2p(want: str, machine: Machine, device: str, workers: int, gpus: int) -> bool:
    """NCCL between GPUs only when every worker has its own GPU and all pairs have peer access."""
    if device == "cpu" or workers == 1 or want == "off":
        return False
    distinct = workers <= gpus
    if want == "on":
        if not distinct:
            raise ConfigError(f"parallel.p2p=on needs one GPU per worker ({workers} workers, {gpus} GPUs)")
        return True
    return distinct and all(machine.peer_access(a, b) for a in range(workers) for b in range(workers) if a != b)


def _threads(machine: Machine, device: str, workers: int) -> int:
    """Each worker's share of the cores; a GPU worker leaves some to its dispatch and copy threads."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", workers))
    share = max(1, machine.cpu_count // max(1, local))
    if device == "cuda" and share > 2 * DISPATCH_THREADS:
        share -= DISPATCH_THREADS
    return share


def _groups(machine: Machine, device: str, workers: int, gpus: int) -> tuple[tuple[int, ...], ...]:
    """Workers whose host transfers share a link: nothing on the CPU; one GPU's workers; a root complex."""
    if device == "cpu":
        return tuple((w,) for w in range(workers))
    if workers > gpus:
        return tuple(tuple(w for w in range(workers) if w % gpus == g) for g in range(gpus))
    rcs = [tuple(g for g in rc if g < workers) for rc in machine.root_complexes()]
    rcs = [rc for rc in rcs if rc]
    covered = sorted(g for rc in rcs for g in rc)
    return tuple(rcs) if covered == list(range(workers)) else tuple((w,) for w in range(workers))
