"""The machine a run is planned for, and the one place that resolves the parallel settings.

:func:`resolve` turns ``parallel.*`` (and ``partition.gpu_memory_gib``) plus a :class:`Machine`
into a :class:`~mobius.parallel.ParallelSettings`; every path (single, pipeline, zero, planning, the
workers) takes that value instead of reading the config keys itself. What needs no plan is decided
here: an explicit ``parallel.mode``, and ``auto`` on one CPU device; which modes ``auto`` may
choose from (:func:`mode_options`). The choice between them compares the planners' predictions
(:func:`mobius.app.planning.choose_mode`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Iterable

from mobius.config import Config
from mobius.errors import ConfigError, MobiusError, NotAvailableError
from mobius.parallel import Mode, ParallelSettings

log = logging.getLogger(__name__)

GiB = 2**30
CPU_WORKER_MEMORY_GIB = 4.0  # what a CPU worker standing in for a GPU may hold (tests, the demo)
DEVICE_RESERVE_BYTES = int(1.5 * GiB)  # CUDA context, cuBLAS workspace, allocator slack on a whole device
DISPATCH_THREADS = 2  # a GPU worker's kernel-dispatch and copy threads, left out of its AdamW threads
MODES: tuple[Mode, ...] = ("single", "pipeline", "zero")
TORCHRUN_ENV = ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                "GROUP_WORLD_SIZE")


@dataclass(frozen=True)
class Torchrun:
    """This process's place in a run that ``torchrun`` started (its environment variables)."""

    rank: int
    world: int
    local_rank: int
    local_world: int
    node: int  # GROUP_RANK: the rendezvous's number for this machine
    run_id: str

    nodes: int  # GROUP_WORLD_SIZE

    @classmethod
    def from_env(cls) -> "Torchrun | None":
        """The torchrun environment of this process, or None when torchrun did not start it."""
        if not all(k in os.environ for k in TORCHRUN_ENV):
            return None
        e = os.environ
        run = cls(int(e["RANK"]), int(e["WORLD_SIZE"]), int(e["LOCAL_RANK"]), int(e["LOCAL_WORLD_SIZE"]),
                  int(e["GROUP_RANK"]), e["TORCHELASTIC_RUN_ID"], int(e["GROUP_WORLD_SIZE"]))
        if run.world != run.nodes * run.local_world:
            raise NotAvailableError(f"torchrun started {run.world} processes on {run.nodes} nodes, {run.local_world} "
                                    f"on this one: mobius needs the same --nproc-per-node on every node")
        return run


@dataclass
class Machine:
    """GPUs (a topology, or none), peer access, cores; ``local`` when it is this machine; ``nodes``:
    how many machines like it the run spans (torchrun's nodes, each planned from its own topology)."""

    topology: Any | None  # topology.Topology, None without GPUs
    cpu_count: int
    local: bool
    peer: list[list[bool]] | None = None  # peer access [i][j]; None: the topology's
    nodes: int = 1
    torchrun: bool = False  # torchrun started the processes: their number is fixed

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

    def nvlink(self, gpus: int) -> bool:
        """Whether GPUs ``0..gpus-1`` (at least two) are all linked pairwise by NVLink or an NVSwitch."""
        if self.topology is None or gpus < 2:
            return False
        links = self.topology.nvlink
        return all(links[a][b] > 0 for a in range(gpus) for b in range(gpus) if a != b)

    def root_complexes(self) -> list[list[int]]:
        return [list(rc) for rc in self.topology.root_complexes] if self.topology is not None else []

    @classmethod
    def cpu_only(cls, nodes: int = 1) -> "Machine":
        return cls(None, os.cpu_count() or 1, local=True, nodes=nodes)

    @classmethod
    def saved(cls, topo: Any, cpu_count: int | None = None, nodes: int = 1) -> "Machine":
        """Another machine, known from a saved topology (``mobius plan --topology``)."""
        return cls(topo, cpu_count or os.cpu_count() or 1, local=False, nodes=nodes)

    @classmethod
    def detect(cls, cfg: Config, nodes: int = 1, torchrun: bool = False) -> "Machine":
        """This machine: its CUDA GPUs (topology from ``topology.file`` or detected) and cores."""
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        topo = _local_topology(cfg, count) if count else None
        peer = [[a == b or torch.cuda.can_device_access_peer(a, b) for b in range(count)] for a in range(count)]
        return cls(topo, os.cpu_count() or 1, local=True, peer=peer if count else None, nodes=nodes,
                   torchrun=torchrun)


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


def resolve(cfg: Config, machine: Machine, mode: Mode | None = None, reason: str = "") -> ParallelSettings:
    """The parallel settings of a run of ``cfg`` on ``machine`` (every check in one place). ``mode``:
    the mode ``auto`` chose (by default ``parallel.mode``, which must then need no plan: see
    :func:`static_mode`); ``reason``: why, for the settings' description."""
    p = cfg.parallel
    if mode is None:
        static = static_mode(cfg, machine)
        assert static is not None, "parallel.mode=auto compares plans: resolve with the mode choose_mode picked"
        mode, reason = static
    device = _device(p.device, machine)
    workers = 1 if mode == "single" else p.devices
    _check_mode(cfg, machine, mode, device, workers)
    local = workers // machine.nodes
    gpus = min(local, machine.gpu_count) if device == "cuda" else 0
    memory, capped = _memory(cfg, machine, device, local, gpus)
    return ParallelSettings(mode=mode, device=device, workers=workers, gpus=gpus,
                            p2p=_p2p(p.p2p, machine, device, local, gpus), memory_bytes=memory, memory_capped=capped,
                            cpu_threads=p.cpu_threads or _threads(machine, device, local),
                            groups=_groups(machine, device, workers, gpus),
                            reason=reason, nodes=machine.nodes, cpu_pinning=p.cpu_pinning and device == "cuda")


def static_mode(cfg: Config, machine: Machine) -> tuple[Mode, str] | None:
    """The mode when no plan is needed to decide it, with the reason: ``parallel.mode`` when it names
    one, ``single`` for ``auto`` on one device without a GPU; None when ``auto`` must compare plans."""
    if cfg.parallel.mode != "auto":
        return cfg.parallel.mode, ""
    if cfg.parallel.devices == 1 and machine.nodes == 1 and _device(cfg.parallel.device, machine) == "cpu":
        return "single", "auto: one device and no GPU, plain training on the CPU"
    return None


def local_cpu_workers(cfg: Config, machine: Machine) -> int:
    """How many CPU worker processes a run of ``cfg`` starts on each of ``machine``'s nodes, known before any plan:
    ``parallel.devices`` over the nodes on the CPU in every mode but single (``auto`` on the CPU with several
    devices compares only modes that run them); 0 on GPUs and in single mode."""
    static = static_mode(cfg, machine)
    if (static is not None and static[0] == "single") or _device(cfg.parallel.device, machine) != "cpu":
        return 0
    return cfg.parallel.devices // machine.nodes


def mode_options(cfg: Config, machine: Machine) -> dict[Mode, str]:
    """For ``parallel.mode: auto``: each mode, and why it cannot run here ("" when it can)."""
    device = _device(cfg.parallel.device, machine)
    out: dict[Mode, str] = {}
    for mode in MODES:
        try:
            _check_mode(cfg, machine, mode, device, 1 if mode == "single" else cfg.parallel.devices)
            out[mode] = ""
        except MobiusError as e:
            out[mode] = str(e)
    if device == "cpu" and cfg.parallel.devices > 1:  # CPU worker processes stand in for GPUs: compare those
        out["single"] = out["single"] or (f"without a GPU, parallel.devices={cfg.parallel.devices} CPU worker "
                                          f"processes stand in for GPUs")
    return out


def _check_mode(cfg: Config, machine: Machine, mode: Mode, device: str, workers: int) -> None:
    """Why ``mode`` cannot run ``workers`` workers on ``machine`` (a ConfigError or NotAvailableError)."""
    devices, nodes = cfg.parallel.devices, machine.nodes
    if devices % nodes:
        raise ConfigError(f"parallel.devices={devices} cannot be split evenly over {nodes} nodes")
    if mode == "single" and devices != 1 and (cfg.parallel.mode == "single" or machine.torchrun):
        raise ConfigError(f"parallel.mode=single runs on one device, but parallel.devices={devices}"
                          + (" (the processes torchrun started)" if machine.torchrun else ""))
    if cfg.parallel.schedule == "round_robin" and mode != "pipeline":
        raise NotAvailableError(f"parallel.schedule=round_robin is a schedule of parallel.mode=pipeline, not of "
                                f"parallel.mode={mode}")
    if mode == "pipeline" and nodes > 1:
        raise NotAvailableError(f"parallel.mode=pipeline runs on one machine (its upload arbiter and CPU-worker "
                                f"links assume one host), but the run spans {nodes} nodes: use parallel.mode=zero")
    if mode != "zero":
        return
    if cfg.train.micro_batches % workers:
        raise ConfigError(f"parallel.mode=zero splits each step's train.micro_batches={cfg.train.micro_batches} "
                          f"evenly among parallel.devices={workers} ranks: make train.micro_batches a multiple of "
                          f"{workers}")
    if device == "cuda" and 1 < workers and machine.gpu_count < workers // nodes:
        raise ConfigError(f"parallel.mode=zero needs one GPU per rank (NCCL), but parallel.devices={workers} and "
                          f"this machine has {machine.gpu_count} GPU(s)"
                          + (f" for its {workers // nodes} ranks" if nodes > 1 else ""))


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


def _threads(machine: Machine, device: str, local: int) -> int:
    """Each worker's share of this machine's cores; a GPU worker leaves some to its dispatch and copy threads."""
    share = max(1, machine.cpu_count // max(1, local))
    if device == "cuda" and share > 2 * DISPATCH_THREADS:
        share -= DISPATCH_THREADS
    return share


def update_cores(available: Iterable[int], local_rank: int, local_workers: int) -> tuple[int, ...] | None:
    """The cores a GPU worker's CPU updates keep to under ``parallel.cpu_pinning``: its contiguous share of
    ``available`` (split among the node's workers) less its first :data:`DISPATCH_THREADS`, which stay to its
    dispatch and copy threads; None when the share has no more."""
    cores = sorted(available)
    n = len(cores)
    share = cores[local_rank * n // local_workers:(local_rank + 1) * n // local_workers]
    return tuple(share[DISPATCH_THREADS:]) or None


def _groups(machine: Machine, device: str, workers: int, gpus: int) -> tuple[tuple[int, ...], ...]:
    """Workers whose host transfers share a link: nothing on the CPU or across nodes; one GPU's workers;
    a root complex."""
    if device == "cpu" or machine.nodes > 1:
        return tuple((w,) for w in range(workers))
    if workers > gpus:
        return tuple(tuple(w for w in range(workers) if w % gpus == g) for g in range(gpus))
    rcs = [tuple(g for g in rc if g < workers) for rc in machine.root_complexes()]
    rcs = [rc for rc in rcs if rc]
    covered = sorted(g for rc in rcs for g in rc)
    return tuple(rcs) if covered == list(range(workers)) else tuple((w,) for w in range(workers))
