"""From a config to the runtime's :class:`~scheduler.engine.PipelineSpec`: stage boundaries (the
partitioner's plan, or an even split when ``parallel.stages`` forces a count), the stage -> worker
mapping, root-complex groups for upload ordering, the activation path, and the memory decisions
(prefetch slot, boundary inputs in host memory)."""

from __future__ import annotations

import logging

import torch

from mobius.config import Config
from mobius.engine import DTYPES
from mobius.errors import ConfigError
from mobius.models import ModelConfig, hidden_size, tied_weights, unit_specs
from scheduler.engine import PipelineSpec
from scheduler.stages import stage_layouts

log = logging.getLogger(__name__)
CHECKPOINT_SHARE = 0.1  # auto: boundary inputs go to host memory when they would take more of the GPU


def even_boundaries(num_units: int, num_stages: int) -> list[int]:
    """Cut ``num_units`` units into ``num_stages`` contiguous stages of (nearly) equal unit counts."""
    if not 1 <= num_stages <= num_units:
        raise ConfigError(f"parallel.stages={num_stages} must be between 1 and the model's {num_units} units")
    return [round(j * num_units / num_stages) for j in range(num_stages + 1)]


def on_cpu(cfg: Config) -> bool:
    return cfg.parallel.device == "cpu" or not torch.cuda.is_available()


def worker_groups(cfg: Config, workers: int) -> list[list[int]]:
    """Workers whose uploads share a root complex. CPU stand-ins share nothing; workers on one GPU
    share its link; GPUs are grouped by the detected (or saved) topology."""
    if on_cpu(cfg):
        return [[w] for w in range(workers)]
    gpus = torch.cuda.device_count()
    if workers > gpus:  # several workers per GPU: those on one GPU share its link
        return [[w for w in range(workers) if w % gpus == g] for g in range(min(gpus, workers))]
    from topology import detect, load_topology

    topo = load_topology(cfg.topology.file) if cfg.topology.file else detect()
    return [[g for g in rc if g < workers] for rc in topo.root_complexes if any(g < workers for g in rc)]


def use_p2p(cfg: Config, workers: int) -> bool:
    """NCCL between GPUs only when every worker has its own GPU and all pairs have peer access."""
    if on_cpu(cfg) or workers == 1 or cfg.parallel.p2p == "off":
        return False
    distinct = workers <= torch.cuda.device_count()
    if cfg.parallel.p2p == "on":
        if not distinct:
            raise ConfigError(f"parallel.p2p=on needs one GPU per worker ({workers} workers, "
                              f"{torch.cuda.device_count()} GPUs)")
        return True
    return distinct and all(torch.cuda.can_device_access_peer(a, b)
                            for a in range(workers) for b in range(workers) if a != b)


def even_mapping(cfg: Config, groups: list[list[int]], num_stages: int, workers: int) -> list[int]:
    """Stage -> worker for a forced stage count: cross mapping over the groups, or sequential."""
    if cfg.parallel.mapping == "sequential" or workers == 1:
        slots = list(range(workers))
    else:
        from topology import cross_mapping

        slots = list(cross_mapping([sorted(g) for g in groups], num_stages).slots)
    return [slots[j % workers] for j in range(num_stages)]


def _hardware(cfg: Config, workers: int, groups: list[list[int]]):
    from mobius.planning import cpu_workers_hardware, hardware_for
    from partition import Hardware
    from partition.gpus import GiB

    if on_cpu(cfg):
        return cpu_workers_hardware(cfg)
    if workers > torch.cuda.device_count():  # workers sharing GPUs: each gets its share of memory and link
        per = int((cfg.partition.gpu_memory_gib or device_memory_gib(cfg) / workers) * GiB)
        return Hardware.uniform(workers, per, 25e9 / max(len(g) for g in groups), groups=groups,
                                name="workers sharing GPUs")
    return hardware_for(cfg)


def device_memory_gib(cfg: Config) -> float:
    """What one worker may use: partition.gpu_memory_gib, or the whole device."""
    if cfg.partition.gpu_memory_gib:
        return cfg.partition.gpu_memory_gib
    if on_cpu(cfg):
        from mobius.planning import CPU_WORKER_MEMORY_GIB

        return CPU_WORKER_MEMORY_GIB
    return torch.cuda.get_device_properties(0).total_memory / 2**30


def planned(cfg: Config, model_cfg: ModelConfig, workers: int, groups: list[list[int]]):
    """The partitioner's plan for this run (its summary is logged before training starts)."""
    from mobius.planning import plan_for, profile_for

    hw = _hardware(cfg, workers, groups)
    prof = profile_for(cfg, model_cfg, hw, on_cpu=on_cpu(cfg))
    plan = plan_for(cfg, prof, hw)
    log.info("%s", plan.summary())
    return plan


def memory_decisions(cfg: Config, model_cfg: ModelConfig, boundaries: list[int], gpu_of: list[int],
                     workers: int) -> tuple[bool, bool]:
    """(prefetch, offload boundary inputs): two stage slots only if they fit beside a working
    reserve; inputs in host memory when keeping them would take more than a tenth of the device."""
    dtype = DTYPES[cfg.train.precision]
    per_elem = 8 if dtype == torch.float32 else 2 * dtype.itemsize + 4  # params + grads (+ fp32 sum)
    layouts = stage_layouts(model_cfg, boundaries, tied_weights(model_cfg))
    slot = max(lay.numel for lay in layouts) * per_elem
    mem = device_memory_gib(cfg) * 2**30
    act = cfg.train.micro_batch_size * cfg.data.seq_len * hidden_size(model_cfg) * dtype.itemsize
    stages_per_worker = max(gpu_of.count(w) for w in range(workers))
    inputs = (stages_per_worker - 1) * cfg.train.micro_batches * act
    offload = {"on": True, "off": False}.get(cfg.parallel.offload_inputs, inputs > CHECKPOINT_SHARE * mem)
    prefetch = cfg.parallel.prefetch and 2 * slot <= 0.6 * mem
    if cfg.parallel.prefetch and not prefetch:
        log.warning("two stages of %.2f GiB do not fit beside working memory in %.1f GiB: no prefetch",
                    slot / 2**30, mem / 2**30)
    return prefetch, offload


def pipeline_spec(cfg: Config, model_cfg: ModelConfig) -> PipelineSpec:
    """Everything the workers need to run the planned (or forced) pipeline."""
    workers = cfg.parallel.devices
    num_units = len(unit_specs(model_cfg))
    groups = worker_groups(cfg, workers)
    predicted = None
    if cfg.parallel.stages:
        boundaries = even_boundaries(num_units, cfg.parallel.stages)
        gpu_of = even_mapping(cfg, groups, len(boundaries) - 1, workers)
    else:
        plan = planned(cfg, model_cfg, workers, groups)
        boundaries, predicted = list(plan.boundaries), plan.predicted_step_s
        gpu_of = [plan.slots[j % len(plan.slots)] for j in range(plan.num_stages)]
    S = len(boundaries) - 1
    if S < workers or len(set(gpu_of)) < workers:
        raise ConfigError(f"{S} stages cannot keep {workers} workers busy; set parallel.stages >= {workers}")
    p2p = use_p2p(cfg, workers)
    prefetch, offload = memory_decisions(cfg, model_cfg, boundaries, gpu_of, workers)
    path = "GPU to GPU (NCCL)" if p2p else ("gloo between CPU workers" if on_cpu(cfg) else "through pinned host memory")
    log.info("pipeline: %d stages on %d workers, stage -> worker %s; activations %s; prefetch %s; boundary "
             "inputs in %s memory", S, workers, gpu_of, path, "on" if prefetch else "off",
             "host" if offload else "device")
    return PipelineSpec(tuple(boundaries), tuple(gpu_of), tuple(tuple(g) for g in groups), p2p, offload, prefetch,
                        predicted)
