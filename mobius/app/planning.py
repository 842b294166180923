"""Planning a run: the machine as partition/ sees it (``Hardware``), the units' profile, and the
plan. :func:`plan_pipeline` is the one planning function of the pipeline, :func:`plan_zero` the one of
zero mode: ``mobius plan`` prints their result and ``mobius train`` runs it, so the plan shown is the
plan run."""

from __future__ import annotations

import logging
import os

from mobius.app.settings import Machine
from mobius.config import Config
from mobius.errors import ConfigError
from mobius.models import ModelConfig, tied_param_count, unit_specs
from mobius.parallel import ParallelSettings
from partition import Hardware, ModelProfile, Plan, get_profile, lookup_gpu, plan_model
from partition.gpus import gpu_spec
from partition.profile import cpu_update_rate
from partition.zero import ZeroHardware, ZeroPlan
from partition.zero import plan as zero_plan
from partition.zero.search import ADAM_BYTES
from scheduler.zero.params import model_params

log = logging.getLogger(__name__)
CPU_COPY_Bps = 5e9  # memcpy between the "host" and "device" buffers of a CPU worker
SHARED_GPU_LINK_Bps = 25e9  # one GPU's host link, split among the workers sharing it


def hardware(cfg: Config, settings: ParallelSettings, machine: Machine, bandwidth_file: str | None = None) -> Hardware:
    """The devices of a run as the planner sees them: CPU workers, workers sharing GPUs, or GPUs;
    on this machine with its CPU update rate measured (once, then cached)."""
    n, mem = settings.workers, settings.memory_bytes
    if settings.device == "cpu":
        hw = Hardware.uniform(n, mem, CPU_COPY_Bps, groups=[[w] for w in range(n)], name="CPU workers")
    elif settings.shared_gpu:
        link = SHARED_GPU_LINK_Bps / max(len(g) for g in settings.groups)
        hw = Hardware.uniform(n, mem, link, groups=[list(g) for g in settings.groups], name="workers sharing GPUs")
    else:
        hw = _gpus(cfg, settings, machine, bandwidth_file)
    if machine.local:
        cache = os.path.join(cfg.partition.cache_dir, "partition")
        hw.cpu_adam_params_per_s = cpu_update_rate(settings.cpu_threads, cfg.train.precision, cache)
    return hw


def _gpus(cfg: Config, settings: ParallelSettings, machine: Machine, bandwidth_file: str | None) -> Hardware:
    import topology

    path = bandwidth_file or cfg.topology.bandwidth_file
    bandwidth = topology.load_bandwidth(path) if path else None
    spec = gpu_spec(cfg.partition.gpu) if cfg.partition.gpu else None
    hw = Hardware.from_topology(machine.topology, bandwidth, gpu_memory_bytes=settings.memory_bytes, p2p=settings.p2p,
                                gpu=spec)
    return hw.subset(list(range(settings.workers))) if settings.workers < hw.num_gpus else hw


def profile(cfg: Config, model_cfg: ModelConfig, settings: ParallelSettings, machine: Machine,
            hw: Hardware) -> ModelProfile:
    """Unit costs: measured here (the CPU for CPU workers, this GPU when it is the one planned for),
    or estimated for the planned GPU."""
    cache = os.path.join(cfg.partition.cache_dir, "partition")
    specs, t = unit_specs(model_cfg), cfg.train
    if settings.device == "cpu":
        prof = get_profile(specs, t.micro_batch_size, cfg.data.seq_len, t.precision, "measured", None,
                           device="cpu", cache_dir=cache, threads=settings.cpu_threads)
    else:
        names = hw.gpu_names
        gpu = cfg.partition.gpu or (lookup_gpu(names[0]).name if names and lookup_gpu(names[0]) else None)
        mode = cfg.partition.profile if machine.local else "estimated"
        prof = get_profile(specs, t.micro_batch_size, cfg.data.seq_len, t.precision, mode, gpu, cache_dir=cache)
    prof.tied_params = tied_param_count(model_cfg)
    return prof


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
    barrier = t.grad_clip > 0 or t.precision == "fp16"  # updates wait for the global norm
    plan = plan_model(prof, hw, micro_batches=t.micro_batches, mapping=cfg.parallel.mapping, solver=p.solver,
                      time_limit_s=p.time_limit_s, prefetch=cfg.parallel.prefetch, min_stages=settings.workers,
                      boundaries=forced, offload_inputs=cfg.parallel.offload_inputs, barrier=barrier)
    return plan, prof, hw


# ---------------------------------------------------------------------------------------------- zero mode
GLOO_Bps = 2e9  # collectives between CPU worker processes
DEVICE_EFFICIENCY = 0.8  # share of a GPU's memory bandwidth that casts, sums and AdamW reach


def zero_hardware(cfg: Config, settings: ParallelSettings, machine: Machine, hw: Hardware) -> ZeroHardware:
    """The per-rank rates of zero mode's cost model, from the planner's view of the machine: host links
    as shared when every rank uploads at once, NVLink (peer) rates for the collectives, the CPU
    update rate of one rank's thread share (measured here, or the machine's divided among ranks)."""
    n, mem = settings.workers, settings.memory_bytes
    cpu_adam = hw.cpu_adam_params_per_s if machine.local else hw.cpu_adam_params_per_s / n
    if settings.device == "cpu":
        return ZeroHardware(n, mem, CPU_COPY_Bps, CPU_COPY_Bps, GLOO_Bps, CPU_COPY_Bps, cpu_adam, cpu_adam,
                            name="CPU workers")
    c2g = min(hw.shared_h2d(g) for g in range(n))
    g2c = min(hw.shared_d2h(g) for g in range(n))
    peers = [hw.p2p_rate(a, b) for a in range(n) for b in range(n) if a != b]
    g2g = min(peers) if peers and all(peers) else min(c2g, g2c) / 2  # without P2P, NCCL goes through host memory
    spec = lookup_gpu(cfg.partition.gpu or (hw.gpu_names[0] if hw.gpu_names else "")) or gpu_spec("h100")
    device = DEVICE_EFFICIENCY * spec.mem_GBps * 1e9
    return ZeroHardware(n, mem, c2g, g2c, g2g, device, cpu_adam, device / ADAM_BYTES, name=hw.name)


def plan_zero(cfg: Config, model_cfg: ModelConfig, settings: ParallelSettings, machine: Machine,
              bandwidth_file: str | None = None) -> tuple[ZeroPlan, ModelProfile, ZeroHardware]:
    """The zero plan of a run: chunk size, rCache blocks and GPU chunks from the search, or ``zero.*``."""
    hw = hardware(cfg, settings, machine, bandwidth_file)
    prof = profile(cfg, model_cfg, settings, machine, hw)
    zhw = zero_hardware(cfg, settings, machine, hw)
    t, z = cfg.train, cfg.zero
    plan = zero_plan(model_params(model_cfg), prof.num_units, prof, zhw, micro_batches=t.micro_batches,
                     checkpointing=cfg.model.activation_checkpointing,
                     barrier=t.grad_clip > 0 or t.precision == "fp16", prefetch=cfg.parallel.prefetch,
                     chunk_size=z.chunk_size, cache_blocks=z.cache_blocks, gpu_chunks=z.gpu_chunks)
    if not plan.fits:
        log.warning("the zero plan needs %.2f GiB per rank for chunks and rCache, more than the %.2f GiB usable",
                    (plan.peak_bytes - plan.memory["activations"]) / 2**30, plan.memory["usable"] / 2**30)
    return plan, prof, zhw
