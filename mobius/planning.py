"""Planning a pipeline run from a config: the machine (topology and bandwidth -> partition's
``Hardware``), the units' profile, and partition's plan. Shared by ``mobius plan`` and by
``mobius train`` in pipeline mode, so the plan shown is the plan run."""

from __future__ import annotations

import logging
import os
from typing import Any

from mobius.config import Config
from mobius.errors import ConfigError, MobiusError
from mobius.models import ModelConfig, unit_specs

log = logging.getLogger(__name__)
CPU_WORKER_MEMORY_GIB = 4.0  # what a CPU worker standing in for a GPU may hold (tests, the demo)
CPU_COPY_Bps = 5e9  # memcpy between "host" and "device" buffers of a CPU worker


def hardware_for(cfg: Config, topology_file: str | None = None, bandwidth_file: str | None = None,
                 gpus: int | None = None) -> Any:
    """The machine to plan for: a saved topology, a synthetic box of ``gpus``, or this machine."""
    import topology

    from partition import Hardware
    from partition.gpus import GiB, gpu_spec

    path = topology_file or cfg.topology.file
    bw_path = bandwidth_file or cfg.topology.bandwidth_file
    spec = gpu_spec(cfg.partition.gpu) if cfg.partition.gpu else None
    if path:
        topo = topology.load_topology(path)
    elif gpus:
        if gpus < 1:
            raise ConfigError(f"--gpus must be at least 1, got {gpus}")
        sizes = [gpus - gpus // 2, gpus // 2] if gpus > 1 else [1]
        name = spec.name if spec else "NVIDIA GeForce RTX 3090"
        topo = topology.Topology.synthetic(sizes, memory_bytes=spec.memory_bytes if spec else 24 * GiB, name=name)
    else:
        try:
            topo = topology.detect()
        except MobiusError as e:
            raise MobiusError(f"cannot see this machine's GPUs ({e}); plan for a server with --topology FILE "
                              f"(mobius topo --json, or saved nvidia-smi topo -m) or --gpus N") from None
    bandwidth = topology.load_bandwidth(bw_path) if bw_path else None
    memory = int(cfg.partition.gpu_memory_gib * GiB) if cfg.partition.gpu_memory_gib else None
    p2p = {"on": True, "off": False}.get(cfg.parallel.p2p)
    hw = Hardware.from_topology(topo, bandwidth, gpu_memory_bytes=memory, p2p=p2p, gpu=spec)
    devices = gpus or cfg.parallel.devices
    if devices > hw.num_gpus:
        raise ConfigError(f"parallel.devices is {devices} but the topology has {hw.num_gpus} GPU(s)")
    return hw.subset(list(range(devices))) if devices < hw.num_gpus else hw


def cpu_workers_hardware(cfg: Config) -> Any:
    """CPU worker processes standing in for GPUs: each alone on its 'link', memory capped."""
    from partition import Hardware
    from partition.gpus import GiB

    n = cfg.parallel.devices
    mem = int((cfg.partition.gpu_memory_gib or CPU_WORKER_MEMORY_GIB) * GiB)
    return Hardware.uniform(n, mem, CPU_COPY_Bps, groups=[[g] for g in range(n)], name="CPU workers")


def catalogue_name(names: list[str]) -> str | None:
    from partition.gpus import lookup_gpu

    spec = lookup_gpu(names[0]) if names else None
    return spec.name if spec else None


def profile_for(cfg: Config, model_cfg: ModelConfig, hw: Any, on_cpu: bool = False) -> Any:
    """Unit costs: measured here (the CPU for CPU workers), or estimated for the planned GPU."""
    from partition.profile import get_profile

    cache = os.path.join(cfg.partition.cache_dir, "partition")
    specs = unit_specs(model_cfg)
    t = cfg.train
    if on_cpu:
        return get_profile(specs, t.micro_batch_size, cfg.data.seq_len, t.precision, "measured", None,
                           device="cpu", cache_dir=cache)
    gpu = cfg.partition.gpu or catalogue_name(hw.gpu_names)
    return get_profile(specs, t.micro_batch_size, cfg.data.seq_len, t.precision, cfg.partition.profile, gpu,
                       cache_dir=cache)


def plan_for(cfg: Config, profile: Any, hw: Any) -> Any:
    """Partition's plan for this config on ``hw``: at least one stage per device."""
    from partition import plan_model

    return plan_model(profile, hw, micro_batches=cfg.train.micro_batches, mapping=cfg.parallel.mapping,
                      solver=cfg.partition.solver, time_limit_s=cfg.partition.time_limit_s,
                      prefetch=cfg.parallel.prefetch, min_stages=hw.num_gpus)
