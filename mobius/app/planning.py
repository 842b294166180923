"""Planning a run: the machine as partition/ sees it (``Hardware``), the units' profile, and the
plan. :func:`plan_pipeline` is the one planning function: ``mobius plan`` prints its result and
``mobius train`` runs it, so the plan shown is the plan run."""

from __future__ import annotations

import logging
import os

from mobius.app.settings import Machine
from mobius.config import Config
from mobius.errors import ConfigError
from mobius.models import ModelConfig, unit_specs
from mobius.parallel import ParallelSettings
from partition import Hardware, ModelProfile, Plan, get_profile, lookup_gpu, plan_model
from partition.gpus import gpu_spec

log = logging.getLogger(__name__)
CPU_COPY_Bps = 5e9  # memcpy between the "host" and "device" buffers of a CPU worker
SHARED_GPU_LINK_Bps = 25e9  # one GPU's host link, split among the workers sharing it


def hardware(cfg: Config, settings: ParallelSettings, machine: Machine, bandwidth_file: str | None = None) -> Hardware:
    """The devices of a run as the planner sees them: CPU workers, workers sharing GPUs, or GPUs."""
    n, mem = settings.workers, settings.memory_bytes
    if settings.device == "cpu":
        return Hardware.uniform(n, mem, CPU_COPY_Bps, groups=[[w] for w in range(n)], name="CPU workers")
    if settings.shared_gpu:
        link = SHARED_GPU_LINK_Bps / max(len(g) for g in settings.groups)
        return Hardware.uniform(n, mem, link, groups=[list(g) for g in settings.groups], name="workers sharing GPUs")
    import topology

    path = bandwidth_file or cfg.topology.bandwidth_file
    bandwidth = topology.load_bandwidth(path) if path else None
    spec = gpu_spec(cfg.partition.gpu) if cfg.partition.gpu else None
    hw = Hardware.from_topology(machine.topology, bandwidth, gpu_memory_bytes=mem, p2p=settings.p2p, gpu=spec)
    return hw.subset(list(range(n))) if n < hw.num_gpus else hw


def profile(cfg: Config, model_cfg: ModelConfig, settings: ParallelSettings, machine: Machine,
            hw: Hardware) -> ModelProfile:
    """Unit costs: measured here (the CPU for CPU workers, this GPU when it is the one planned for),
    or estimated for the planned GPU."""
    cache = os.path.join(cfg.partition.cache_dir, "partition")
    specs, t = unit_specs(model_cfg), cfg.train
    if settings.device == "cpu":
        return get_profile(specs, t.micro_batch_size, cfg.data.seq_len, t.precision, "measured", None,
                           device="cpu", cache_dir=cache)
    names = hw.gpu_names
    gpu = cfg.partition.gpu or (lookup_gpu(names[0]).name if names and lookup_gpu(names[0]) else None)
    mode = cfg.partition.profile if machine.local else "estimated"
    return get_profile(specs, t.micro_batch_size, cfg.data.seq_len, t.precision, mode, gpu, cache_dir=cache)


def even_boundaries(num_units: int, num_stages: int) -> list[int]:
    """Cut ``num_units`` units into ``num_stages`` contiguous stages of (nearly) equal unit counts."""
    if not 1 <= num_stages <= num_units:
        raise ConfigError(f"parallel.stages={num_stages} must be between 1 and the model's {num_units} units")
    return [round(j * num_units / num_stages) for j in range(num_stages + 1)]


def plan_pipeline(cfg: Config, model_cfg: ModelConfig, settings: ParallelSettings, machine: Machine,
                  bandwidth_file: str | None = None) -> tuple[Plan, ModelProfile, Hardware]:
    """The pipeline plan of a run: the MIP's partition, or ``parallel.stages`` split evenly."""
    hw = hardware(cfg, settings, machine, bandwidth_file)
    prof = profile(cfg, model_cfg, settings, machine, hw)
    forced = even_boundaries(prof.num_units, cfg.parallel.stages) if cfg.parallel.stages else None
    if forced is not None and len(forced) - 1 < settings.workers:
        raise ConfigError(f"parallel.stages={cfg.parallel.stages} cannot keep {settings.workers} workers busy; "
                          f"set parallel.stages >= {settings.workers}")
    t, p = cfg.train, cfg.partition
    plan = plan_model(prof, hw, micro_batches=t.micro_batches, mapping=cfg.parallel.mapping, solver=p.solver,
                      time_limit_s=p.time_limit_s, prefetch=cfg.parallel.prefetch, min_stages=settings.workers,
                      boundaries=forced, offload_inputs=cfg.parallel.offload_inputs)
    return plan, prof, hw
