"""Planning a run: the machine as partition/ sees it (``Hardware``), the units' profile, the plan,
and which mode runs. :func:`plan_single`, :func:`plan_pipeline` and :func:`plan_zero` are the one
planning function of each mode; :func:`plan_run` gives the mode, its settings and its plan --
``parallel.mode: auto`` compares the three planners' predicted steps (:func:`choose_mode`). ``mobius
plan`` prints its result and ``mobius train`` runs it, so the plan shown is the plan run."""

from __future__ import annotations

import dataclasses
import logging
import os
import typing
from dataclasses import asdict, dataclass
from typing import Any, Callable

from mobius.app.plan_cache import reuse_or_plan
from mobius.app.settings import Machine, mode_options, resolve, static_mode
from mobius.config import Config, ScheduleName
from mobius.errors import ConfigError, MobiusError
from mobius.models import ModelConfig, tied_param_count, tied_weights, unit_specs
from mobius.models.lora import trains
from mobius.parallel import Mode, ParallelSettings, mailboxes_work_here
from partition import (Hardware, ModelProfile, PlanRequest, RoundRobinPlan, ScheduleComparison, SwappedPlan,
                       get_profile, lookup_gpu, plan_schedules)
from partition.estimate import estimate_units
from partition.calibrate import ComputeScale, learnt_scale, scale_key
from partition.profile import apply_profile_file, profile_key, read_profile_file
from partition.gpus import gpu_spec
from partition.cpu_rate import cpu_update_rate_in_step, host_memory_rate, host_update_rates_in_step
from partition.costs import ADAM_BYTES, UPDATE_BYTES, update_bytes
from partition.estimate import MEMORY_EFFICIENCY
from partition.hardware import (CPU_UPDATE_IN_STEP, GLOO_MESSAGE_S, HOST_COPY_Bps, HOST_DEFAULT_SOURCE,
                                MAILBOX_MESSAGE_S, PAPER_ADAM_PARAMS_PER_S)
from partition.single_plan import SinglePlan
from partition.single_plan import plan_single as single_plan
from partition.zero import ZeroHardware, ZeroPlan
from partition.zero import plan as zero_plan
from partition.zero import replay as zero_replay
from topology.host import HOST_USABLE_FRACTION, available_host_bytes
from mobius.models.params import model_params

log = logging.getLogger(__name__)
NVLINK_Bps = 20e9  # one NVLink's effective rate per direction (NVLink 3: 25 GB/s), for an unmeasured box
INTER_NODE_Bps = 12.5e9  # assumed network of one node to the others (100 Gb/s), shared by its ranks
AnyPlan = SinglePlan | ScheduleComparison | ZeroPlan  # what a mode plans (and mobius plan prints)
RunPlan = SwappedPlan | RoundRobinPlan | ZeroPlan  # what an engine runs (mobius.app.launch.make_engine)


def hardware(cfg: Config, settings: ParallelSettings, machine: Machine, bandwidth_file: str | None = None) -> Hardware:
    """The devices of a run as the planner sees them: CPU workers, workers sharing GPUs, or GPUs,
    and the host they share (:func:`_host`)."""
    n, mem = settings.workers, settings.memory_bytes
    if settings.device == "cpu":
        hw = Hardware.uniform(n, mem, HOST_COPY_Bps, groups=[[w] for w in range(n)], name="CPU workers")
        hw.message_s = MAILBOX_MESSAGE_S if mailboxes_work_here("cpu", settings.nodes) else GLOO_MESSAGE_S
        # their compute shares the cores with their copies, sums and updates (several nodes' cores as one pool)
        hw.host_cores, hw.worker_threads = machine.cpu_count * settings.nodes, settings.cpu_threads
    elif settings.shared_gpu:  # each worker alone gets its GPU's link; the workers of one GPU share it
        gpus = _gpus(cfg, settings, machine, bandwidth_file)
        link = min(min(gpus.h2d_Bps), min(gpus.d2h_Bps))
        hw = Hardware.uniform(n, mem, link, groups=[list(g) for g in settings.groups], name="workers sharing GPUs")
    else:
        hw = _gpus(cfg, settings, machine, bandwidth_file)
    _host(cfg, settings, machine, hw)
    if settings.device == "cpu":  # a resident stage's "device" AdamW runs on the worker's CPU threads
        hw.device_adam_params_per_s = hw.cpu_adam_params_per_s
    return hw


def _host(cfg: Config, settings: ParallelSettings, machine: Machine, hw: Hardware) -> None:
    """The host's CPU AdamW rates (one worker alone, all local workers at once, inside a step) and its
    memory, and where each comes from: ``partition.cpu_update_rate`` / ``host_memory_gib`` when given,
    else measured on this machine (once, then cached), else the stated defaults of a server planned
    from elsewhere (``HOST_DEFAULT_SOURCE``; host memory not known)."""
    p, sources, states = cfg.partition, {}, cfg.train.optimizer_states
    scaled = UPDATE_BYTES / update_bytes(states)  # an fp32 rate's factor for the run's moments, bandwidth-bound
    by_bytes = "" if states == "fp32" else (f"; x {scaled:.2f} for {states} moments ({update_bytes(states):g} bytes "
                                            f"per parameter against {UPDATE_BYTES}: the host's memory bandwidth bounds "
                                            f"the update)")
    if machine.local:
        cache, threads, precision = os.path.join(p.cache_dir, "partition"), settings.cpu_threads, cfg.train.precision
        hw.cpu_adam_params_per_s, hw.host_adam_params_per_s, sources["cpu"] = host_update_rates_in_step(
            settings.local_workers, threads, precision, cache, settings.device, states=states)
        if precision == "bf16":
            hw.cpu_adam_half_grads_params_per_s, _ = cpu_update_rate_in_step(threads, precision, cache,
                                                                             settings.device, True, states)
        hw.host_memory_bytes = available_host_bytes()
        sources["memory"] = f"{HOST_USABLE_FRACTION:.0%} of this machine's available memory"
    else:
        hw.cpu_adam_params_per_s = hw.host_adam_params_per_s = PAPER_ADAM_PARAMS_PER_S * CPU_UPDATE_IN_STEP * scaled
        hw.host_memory_bytes, sources["cpu"] = None, HOST_DEFAULT_SOURCE + by_bytes
        sources["memory"] = ("not known (planned from a saved topology): nothing checked, and no choice spends host "
                             "memory for speed; set partition.host_memory_gib")
    if p.cpu_update_rate is not None:
        hw.host_adam_params_per_s = p.cpu_update_rate * 1e9 * CPU_UPDATE_IN_STEP * scaled
        if not machine.local:
            hw.cpu_adam_params_per_s = hw.host_adam_params_per_s
        sources["cpu"] = (f"partition.cpu_update_rate={p.cpu_update_rate:g} G params/s x {CPU_UPDATE_IN_STEP} in a "
                          f"step{by_bytes}")
    if p.host_memory_gib is not None:
        hw.host_memory_bytes = int(p.host_memory_gib * 2**30)
        sources["memory"] = f"partition.host_memory_gib={p.host_memory_gib:g}"
    hw.host_sources = sources
    log.debug("CPU AdamW: %.2f G params/s per worker alone, %.2f in total (%s)", hw.cpu_adam_params_per_s / 1e9,
              hw.host_update_total(workers=settings.local_workers) / 1e9, sources["cpu"])


def _gpus(cfg: Config, settings: ParallelSettings, machine: Machine, bandwidth_file: str | None) -> Hardware:
    import topology

    path = bandwidth_file or cfg.topology.bandwidth_file
    bandwidth = topology.load_bandwidth(path) if path else None
    spec = gpu_spec(cfg.partition.gpu) if cfg.partition.gpu else None
    hw = Hardware.from_topology(machine.topology, bandwidth, gpu_memory_bytes=settings.memory_bytes, p2p=settings.p2p,
                                gpu=spec)
    if settings.p2p and not (bandwidth and any(r for row in bandwidth.p2p_GBps for r in row)):
        hw.p2p_pairs_Bps = _nvlink_rates(machine.topology.nvlink, hw)
    local = settings.local_workers  # one node's GPUs: every node is planned as this one
    return hw.subset(list(range(local))) if local < hw.num_gpus else hw


def _nvlink_rates(nvlink: list[list[int]], hw: Hardware) -> list[list[float | None]] | None:
    """Peer rates with NVLink pairs at their links' rate (the topology counts links; an unmeasured box)."""
    n = hw.num_gpus
    rates = [[hw.p2p_rate(a, b) for b in range(n)] for a in range(n)]
    for a in range(n):
        for b in range(n):
            if a != b and nvlink[a][b] > 0:
                rates[a][b] = max(rates[a][b] or 0.0, nvlink[a][b] * NVLINK_Bps)
    return rates if any(r for row in rates for r in row) else None


def profile(cfg: Config, model_cfg: ModelConfig, settings: ParallelSettings, machine: Machine,
            hw: Hardware) -> ModelProfile:
    """Unit costs: measured here -- on the CPU for CPU workers, on this machine's GPU when the run is
    planned on it, whatever ``partition.gpu`` names (a note says so when it names another GPU) -- or
    estimated from a datasheet: for a saved topology, without a GPU here, or because
    ``partition.profile`` says estimated; on rows packed with documents of ``partition.document_tokens``
    tokens when it is set (the run's data fills it in: :func:`mobius.assemble.with_document_tokens`)."""
    cache = os.path.join(cfg.partition.cache_dir, "partition")
    specs, t, doc = unit_specs(model_cfg), cfg.train, cfg.partition.document_tokens
    how = profile_mode(cfg, settings, machine)
    if cfg.partition.profile_file:
        prof = _from_profile_file(cfg, specs, hw)
    elif settings.device == "cpu" and how == "measured":
        prof = get_profile(specs, t.micro_batch_size, cfg.data.seq_len, t.precision, "measured", None,
                           device="cpu", cache_dir=cache, threads=settings.cpu_threads, doc_tokens=doc)
    else:
        names = hw.gpu_names
        here = lookup_gpu(names[0]).name if names and lookup_gpu(names[0]) else None
        datasheet = (cfg.partition.gpu or here) if how == "estimated" else None
        prof = get_profile(specs, t.micro_batch_size, cfg.data.seq_len, t.precision, how, datasheet, cache_dir=cache,
                           doc_tokens=doc)
    prof.notes["why"] = _profile_reason(cfg, settings, machine, prof)
    tied = tied_weights(model_cfg)
    prof.tied_params = tied_param_count(model_cfg) if tied and trains(model_cfg, tied[0][0]) else 0  # frozen: no exchange
    return prof


def as_runs_compute(prof: ModelProfile, cfg: Config, model_cfg: ModelConfig,
                    settings: ParallelSettings) -> ModelProfile:
    """A measured ``prof`` scaled to the compute the last runs of this mode and setting measured inside their
    steps on this machine (:mod:`partition.calibrate`; its source then ``learnt``; as measured when none has), with
    the key the next run keeps its own factors under (``notes["in_run"]``). A datasheet's or a profile file's as
    given. The pipeline's schedules (``parallel.schedule``) learn apart, their dispatch threads differ (on 2 CPU
    workers 0.4-1.0 ms per compute action in the swapped pipeline, 0.4-0.8 ms in the round-robin), and a schedule
    with no runs of its own yet is planned with another's (the same units computed)."""
    if prof.source != "measured":
        return prof
    t = cfg.train
    units = profile_key(unit_specs(model_cfg), t.micro_batch_size, cfg.data.seq_len, t.precision, prof.device_name,
                        prof.doc_tokens)

    def key(mode: str) -> str:
        return scale_key(units, settings.workers, settings.cpu_threads, mode)
    schedule = cfg.parallel.schedule
    own = key(f"pipeline/{schedule}" if settings.mode == "pipeline" else settings.mode)
    others = [(key(f"pipeline/{s}"), f"with parallel.schedule={s}") for s in typing.get_args(ScheduleName)
              if settings.mode == "pipeline" and s != schedule]
    learnt = learnt_scale(os.path.join(cfg.partition.cache_dir, "partition"), own, others)
    out = dataclasses.replace(learnt.apply(prof), source="learnt") if learnt.runs else prof
    out.notes["in_run"] = {"key": own, **dataclasses.asdict(learnt)}
    return out


def _from_profile_file(cfg: Config, specs: list, hw: Hardware) -> ModelProfile:
    """The units' times from ``partition.profile_file``; the kinds it does not name estimated for the
    file's GPU (or the GPU planned for)."""
    path, t = cfg.partition.profile_file, cfg.train
    data = read_profile_file(path)
    names = hw.gpu_names
    gpu = next((g for g in (data.get("gpu"), cfg.partition.gpu, names[0] if names else None)
                if g and lookup_gpu(g)), None)
    if gpu is None and {s.kind for s in specs} <= set(data["units"]):
        gpu = "h100"  # every time is the file's: the datasheet gives only what times do not depend on (bytes)
    if gpu is None:
        raise ConfigError(f"partition.profile_file {path}: the kinds it does not name are estimated from a GPU's "
                          f"datasheet, and neither the file's gpu nor partition.gpu names a known one")
    est = estimate_units(specs, t.micro_batch_size, cfg.data.seq_len, t.precision, gpu,
                         doc_tokens=cfg.partition.document_tokens)
    return apply_profile_file(est, data, path)


def profile_mode(cfg: Config, settings: ParallelSettings, machine: Machine) -> str:
    """``measured`` or ``estimated``: ``partition.profile`` when it names one (a saved machine can only
    be estimated); ``auto`` measures the devices the run is planned on when they are here (CPU
    workers, this machine's GPUs) and estimates a machine planned from elsewhere."""
    chosen = cfg.partition.profile
    if not machine.local:
        return "estimated"
    if chosen != "auto":
        return chosen
    return "measured" if settings.device == "cpu" or machine.gpu_count > 0 else "estimated"


def _profile_reason(cfg: Config, settings: ParallelSettings, machine: Machine, prof: ModelProfile) -> str:
    """Why the profile is what it is, for the plan's ``profile:`` line: the GPU measured when
    ``partition.gpu`` names another one, the datasheet and why it was used."""
    named = cfg.partition.gpu
    if prof.source == "file":
        kept = prof.notes.get("estimated_kinds", [])
        return (f"partition.profile_file {cfg.partition.profile_file}" +
                (f"; {', '.join(kept)} estimated from the datasheet" if kept else ""))
    if prof.source == "measured":
        here = lookup_gpu(prof.device_name)
        if named and settings.device != "cpu" and (here is None or here.name != gpu_spec(named).name):
            return (f"partition.gpu={named} names another GPU than this machine's {prof.device_name}, which is "
                    f"the one planned for; set partition.profile=estimated to plan for the {named}'s datasheet")
        return ""
    if cfg.partition.profile == "estimated" and machine.local:
        return "partition.profile=estimated"
    if not machine.local:
        return "planned for another machine, whose GPUs are not here to measure"
    return "no GPU here to measure"


def profile_line(prof: ModelProfile) -> str:
    """How the unit costs were had, in words, for ``mobius plan`` and ``mobius train``: "measured on
    NVIDIA H100 80GB HBM3 in 12.3 s", "estimated for RTX 3090 (60% of 71.0 TFLOP/s; no GPU here to
    measure)", with the note when ``partition.gpu`` names another GPU than the one measured, and the packed
    documents' length ("; attention within documents of 412 tokens") when the rows hold several."""
    why = prof.notes.get("why", "")
    docs = f"; attention within documents of {prof.doc_tokens} tokens" if prof.doc_tokens else ""
    if prof.source == "datasheet":
        rate = f"{100 * prof.notes.get('compute_efficiency', 0):.0f}% of {prof.notes.get('tflops', 0):.1f} TFLOP/s"
        return f"estimated for {prof.device_name} from its datasheet ({rate}{'; ' + why if why else ''}){docs}"
    if prof.source == "file":
        return f"measured on {prof.device_name}, from {why}" + (f"{docs} (the file's units as it gives them)"
                                                                 if docs else "")
    took = f"in {prof.profile_s:.1f} s" if prof.profile_s else "(cached)"
    learnt = prof.notes.get("in_run", {})
    runs = (f"; {ComputeScale(**{k: v for k, v in learnt.items() if k != 'key'}).line()}"
            if learnt.get("runs") else "")
    return f"measured on {prof.device_name} {took}" + (f" ({why})" if why else "") + runs + docs


def even_boundaries(num_units: int, num_stages: int) -> list[int]:
    """Cut ``num_units`` units into ``num_stages`` contiguous stages of (nearly) equal unit counts."""
    if not 1 <= num_stages <= num_units:
        raise ConfigError(f"parallel.stages={num_stages} must be between 1 and the model's {num_units} units")
    return [round(j * num_units / num_stages) for j in range(num_stages + 1)]


def plan_pipeline(cfg: Config, model_cfg: ModelConfig, settings: ParallelSettings, machine: Machine,
                  bandwidth_file: str | None = None) -> tuple[ScheduleComparison, ModelProfile, Hardware]:
    """The pipeline plan of a run: the swapped pipeline's (the MIP's partition, or ``parallel.stages`` split evenly)
    and, as ``parallel.schedule`` asks, the round-robin family's beside it."""
    hw = hardware(cfg, settings, machine, bandwidth_file)
    prof = as_runs_compute(profile(cfg, model_cfg, settings, machine, hw), cfg, model_cfg, settings)
    forced = even_boundaries(prof.num_units, cfg.parallel.stages) if cfg.parallel.stages else None
    if forced is not None and len(forced) - 1 < settings.workers:
        raise ConfigError(f"parallel.stages={cfg.parallel.stages} cannot keep {settings.workers} workers busy; "
                          f"set parallel.stages >= {settings.workers}")
    t, p, par = cfg.train, cfg.partition, cfg.parallel
    request = PlanRequest(micro_batches=t.micro_batches, mapping=par.mapping, solver=p.solver,
                          time_limit_s=p.time_limit_s, prefetch=par.prefetch, min_stages=settings.workers,
                          boundaries=forced, offload_inputs=par.offload_inputs, barrier=t.barrier,
                          resident=par.resident_stages, kept=par.kept_stages, grad_download=par.grad_download,
                          delayed=t.delayed, schedule=par.schedule, states=t.optimizer_states)
    plan = reuse_or_plan(os.path.join(p.cache_dir, "partition"), prof, hw, request,
                         lambda: plan_schedules(prof, hw, request), reuse=p.reuse_plan)
    return plan, prof, hw


# ---------------------------------------------------------------------------------------------- zero mode
GLOO_Bps = 0.45e9  # measured: zero's collectives between CPU worker processes, the bytes a rank receives per second
GLOO_COLLECTIVE_S = 1.0e-3  # measured: the fixed cost of one, fitted to the reduce-scatters (the dispatch thread waits
# for them). python bench/gloo_collectives.py, 2 workers on a 2-core VM, 2026-11-27, three runs: reduce-scatters of
# 100K, 1M and 10M-element shards 1.6-2.0, 8.5-11.7 and 92-124 ms (0.32-0.47 GB/s); all-gathers 0.7-1.2, 4.2-6.5 and
# 73-78 ms; of a 1K-element shard 0.5-2.3 and 0.24-0.33 ms


def zero_hardware(cfg: Config, settings: ParallelSettings, machine: Machine, hw: Hardware) -> ZeroHardware:
    """The per-rank rates of zero mode's cost model, from the planner's view of the machine: host links
    as shared when every rank uploads at once, NVLink (peer) rates for the collectives, the CPU
    update rate of one rank while every rank of its host updates (they update at the same time)."""
    n, mem = settings.workers, settings.memory_bytes
    cpu_adam = hw.cpu_update_rate(updating=settings.local_workers)
    if settings.device == "cpu":  # the "device" is host memory, at the rate a streaming add reaches on this machine
        memory = host_memory_rate(settings.cpu_threads, os.path.join(cfg.partition.cache_dir, "partition"))
        return ZeroHardware(n, mem, HOST_COPY_Bps, HOST_COPY_Bps, GLOO_Bps, memory, cpu_adam, cpu_adam,
                            collective_s=GLOO_COLLECTIVE_S, name="CPU workers", blocking=True)
    local = range(hw.num_gpus)
    c2g = min(hw.shared_h2d(g) for g in local)
    g2c = min(hw.shared_d2h(g) for g in local)
    peers = [hw.p2p_rate(a, b) for a in local for b in local if a != b]
    staged = not (peers and all(peers))  # without P2P, NCCL goes through host memory: two hops over the links
    g2g = min(c2g, g2c) / 2 if staged else min(peers)
    name = hw.name
    if settings.nodes > 1:  # a ring crosses the network: each node's link carries its ranks' share
        g2g = min(g2g, INTER_NODE_Bps / len(local))
        name = f"{settings.nodes} nodes of {hw.name}, {INTER_NODE_Bps / 1e9:.1f} GB/s between nodes (assumed)"
    device = device_Bps(cfg, hw)
    return ZeroHardware(n, mem, c2g, g2c, g2g, device, cpu_adam, device / ADAM_BYTES, name=name, host_staged=staged)


def device_Bps(cfg: Config, hw: Hardware) -> float:
    """The memory bandwidth that casts, sums and AdamW reach on the GPU planned for."""
    spec = (lookup_gpu(hw.gpu_names[0] if hw.gpu_names else "") or (gpu_spec(cfg.partition.gpu) if cfg.partition.gpu
                                                                     else None) or gpu_spec("h100"))
    return MEMORY_EFFICIENCY * spec.mem_GBps * 1e9  # the share that casts, sums and AdamW reach


def plan_zero(cfg: Config, model_cfg: ModelConfig, settings: ParallelSettings, machine: Machine,
              bandwidth_file: str | None = None) -> tuple[ZeroPlan, ModelProfile, ZeroHardware]:
    """The zero plan of a run: chunk size, rCache blocks and GPU chunks from the search, or ``zero.*``
    (the memory of train.update=delayed's compute copies counted)."""
    hw = hardware(cfg, settings, machine, bandwidth_file)
    prof = as_runs_compute(profile(cfg, model_cfg, settings, machine, hw), cfg, model_cfg, settings)
    zhw = zero_hardware(cfg, settings, machine, hw)
    t, z = cfg.train, cfg.zero
    plan = zero_plan(model_params(model_cfg), prof.num_units, prof, zhw, micro_batches=t.micro_batches,
                     checkpointing=cfg.model.activation_checkpointing,
                     barrier=t.barrier, prefetch=cfg.parallel.prefetch,
                     chunk_size=z.chunk_size, cache_blocks=z.cache_blocks, gpu_chunks=z.gpu_chunks,
                     delayed=t.delayed, states=t.optimizer_states)
    return plan, prof, zhw  # one that does not fit: auto reports it in its comparison, train refuses it


# ---------------------------------------------------------------------------------------------- single
def plan_single(cfg: Config, model_cfg: ModelConfig, settings: ParallelSettings, machine: Machine,
                bandwidth_file: str | None = None) -> tuple[SinglePlan, ModelProfile, Hardware]:
    """Plain training on one device, predicted from the same unit profile (AdamW on the device: the
    GPU's memory bandwidth, or the CPU update rate measured here)."""
    hw = hardware(cfg, settings, machine, bandwidth_file)
    prof = profile(cfg, model_cfg, settings, machine, hw)
    # (a GPU's update with bf16 or int8 moments is a chain of torch ops, not faster than the fused fp32 one: planned
    # at its rate until the GPU suite's states part measures it)
    adam = hw.cpu_adam_params_per_s if settings.device == "cpu" else device_Bps(cfg, hw) / ADAM_BYTES
    plan = single_plan(prof, settings.memory_bytes, micro_batches=cfg.train.micro_batches,
                       checkpointing=cfg.model.activation_checkpointing, adam_params_per_s=adam,
                       states=cfg.train.optimizer_states)
    return plan, prof, hw


# ---------------------------------------------------------------------------------------------- the mode
PLANNERS: dict[Mode, Callable[..., tuple[Any, ModelProfile, Any]]] = {
    "single": plan_single, "pipeline": plan_pipeline, "zero": plan_zero}


@dataclass
class Planned:
    """One mode planned for a run: its settings, its plan (a pipeline's: its schedules compared; None: single mode,
    which needs none to run), the unit profile and the planner's view of the machine."""

    settings: ParallelSettings
    plan: AnyPlan | None = None
    profile: ModelProfile | None = None
    hardware: Any = None
    host: Hardware | None = None  # the machine with its host figures (zero's ``hardware`` is per-rank rates)
    replay: Callable[[ModelProfile], Any] | None = None  # the plan's step simulated again with other unit times
    # (its time_split() has the forward and backward phases a run's measured compute is fitted to)

    @property
    def mode(self) -> Mode:
        return self.settings.mode

    @property
    def runs(self) -> RunPlan | SinglePlan | None:
        """The plan the mode runs: of a pipeline's schedules the one chosen (:attr:`ScheduleComparison.runs`), zero's
        plan; single mode's, where it was made, is only its prediction (its engine needs none)."""
        return self.plan.runs if isinstance(self.plan, ScheduleComparison) else self.plan

    def host_resources(self) -> dict[str, Any]:
        """The host figures the plan assumed and where each came from: CPU AdamW per worker (alone and
        while every local worker updates) and in total, host memory available and needed ({} when
        nothing was planned)."""
        hw, n = self.host, self.settings.local_workers
        if hw is None:
            return {}
        half = isinstance(self.plan, ScheduleComparison) and self.plan.swapped.options.grad_dtype == "half"
        return {"workers": n, "cpu_alone_params_per_s": hw.cpu_update_rate(half),
                "cpu_shared_params_per_s": hw.cpu_update_rate(half, n),
                "cpu_total_params_per_s": hw.host_update_total(half, n), "cpu_source": hw.host_sources.get("cpu", ""),
                "memory_bytes": hw.host_memory_bytes, "memory_source": hw.host_sources.get("memory", ""),
                "memory_needed_bytes": _host_need(self.plan, n)}

    def host_line(self) -> str:
        """One line of :meth:`host_resources` for ``mobius plan`` ("" when nothing was planned)."""
        if self.host is None:
            return ""
        r = self.host_resources()
        n, total, alone = r["workers"], r["cpu_total_params_per_s"] / 1e9, r["cpu_alone_params_per_s"] / 1e9
        cpu = (f"CPU AdamW {total:.2f} G params/s (one worker)" if n == 1 else
               f"CPU AdamW {total:.2f} G params/s in total, {r['cpu_shared_params_per_s'] / 1e9:.2f} per worker while "
               f"{'both' if n == 2 else f'all {n}'} update ({alone:.2f} alone)") + f" [{r['cpu_source']}]"
        have = (f"{r['memory_bytes'] / 2**30:.1f} GiB available [{r['memory_source']}]" if r["memory_bytes"] is not None
                else r["memory_source"])
        return f"host: {cpu}; host memory: {r['memory_needed_bytes'] / 2**30:.1f} GiB needed, {have}"

    def candidate(self) -> "Candidate":
        """This plan as a row of auto's comparison."""
        p = self.plan
        if p is None:
            return Candidate(self.mode, None, True, "not planned")
        fits = getattr(p, "fits", True)  # a pipeline plan is only made when it fits
        return Candidate(self.mode, self.runs.predicted_step_s, fits, _note(p, self.settings))


def _host_need(plan: AnyPlan | None, workers: int) -> int:
    """Host memory the plan's stores take on this host: the pipeline's swapped stages, zero's offloaded
    chunk shards of every local rank (plain training keeps its states on the device)."""
    if isinstance(plan, ScheduleComparison):
        return plan.swapped.host_bytes
    if isinstance(plan, ZeroPlan):
        return plan.memory["host"] * workers
    return 0


@dataclass(frozen=True)
class Candidate:
    """A mode in auto's comparison: its predicted step (of the schedule that runs), whether it fits, and what it
    plans (or why not)."""

    mode: Mode
    predicted_step_s: float | None
    fits: bool
    note: str


def _note(plan: AnyPlan, settings: ParallelSettings) -> str:
    where = f"{settings.workers} {'CPU worker(s)' if settings.device == 'cpu' else 'GPU(s)'}"
    if isinstance(plan, SinglePlan):
        m = plan.memory
        return (f"1 {'CPU' if settings.device == 'cpu' else 'GPU'}: {m['states'] / 2**30:.1f} GiB of model states "
                f"+ {m['activations'] / 2**30:.1f} GiB of activations" + ("" if plan.fits else
                f"; the states may use {m['usable'] / 2**30:.1f} GiB"))
    if isinstance(plan, ZeroPlan):
        return (f"{where}: {plan.num_chunks} chunks, {plan.cache_blocks} rCache blocks, "
                f"{plan.num_chunks - plan.gpu_chunks} offloaded" + ("" if plan.fits else
                f"; needs {plan.peak_bytes / 2**30:.1f} GiB of {plan.memory['capacity'] / 2**30:.1f} GiB"))
    runs = plan.runs
    if isinstance(runs, RoundRobinPlan):
        return (f"{where}: round-robin, {runs.cuts.num_forward} forward + 1 fused + {runs.cuts.num_backward} "
                f"backward ops per round")
    return f"{where}: {runs.num_stages} stages, {runs.mapping_kind} mapping"


@dataclass
class ModeChoice:
    """The mode a run uses, why, and (for ``auto``) every mode's prediction side by side."""

    chosen: Planned
    reason: str
    candidates: list[Candidate]
    explicit: bool  # parallel.mode named the mode

    @property
    def mode(self) -> Mode:
        return self.chosen.mode

    def runner_up(self) -> Candidate | None:
        """The fastest other mode that fits."""
        others = [c for c in self.candidates if c.mode != self.mode and c.fits and c.predicted_step_s is not None]
        return min(others, key=lambda c: c.predicted_step_s, default=None)

    def line(self) -> str:
        """One line: the mode, its prediction, the runner-up's, and the reason."""
        if self.explicit:
            return f"parallel.mode={self.mode}"
        best = next(c for c in self.candidates if c.mode == self.mode)
        if best.predicted_step_s is None:
            return f"parallel.mode=auto chose {self.mode}: {self.reason}"
        r = self.runner_up()
        other = f"runner-up {r.mode} {r.predicted_step_s:.3f} s" if r else "no other mode fits"
        return (f"parallel.mode=auto chose {self.mode} ({best.predicted_step_s:.3f} s/step predicted; {other}): "
                f"{self.reason}")

    def table(self) -> str:
        """The comparison ``mobius plan`` prints: mode, predicted step, fits, what it plans or why not."""
        rows = [f"  {'mode':<9} {'predicted step':>14}  {'fits':<4}  plan"]
        for c in self.candidates:
            step = f"{c.predicted_step_s:.3f} s" if c.predicted_step_s is not None else "-"
            mark = "  <- chosen" if c.mode == self.mode else ""
            rows.append(f"  {c.mode:<9} {step:>14}  {'yes' if c.fits else 'no':<4}  {c.note}{mark}")
        return "\n".join([self.line()] + rows)

    def to_json(self) -> dict:
        return {"chosen": self.mode, "explicit": self.explicit, "reason": self.reason, "line": self.line(),
                "candidates": [asdict(c) for c in self.candidates]}


def plan_mode(cfg: Config, model_cfg: ModelConfig, machine: Machine, mode: Mode, bandwidth_file: str | None = None,
              reason: str = "") -> Planned:
    """Resolve the settings of ``mode`` and plan it."""
    settings = resolve(cfg, machine, mode, reason)
    plan, prof, hw = PLANNERS[mode](cfg, model_cfg, settings, machine, bandwidth_file)
    host = hw if isinstance(hw, Hardware) else hardware(cfg, settings, machine, bandwidth_file)
    return Planned(settings, plan, prof, hw, host, _replayer(plan, hw, model_cfg, prof))


def _replayer(plan: AnyPlan, hw: Any, model_cfg: ModelConfig,
              prof: ModelProfile) -> Callable[[ModelProfile], Any] | None:
    """How the step of what ``plan`` runs is simulated again with other unit times (None: single mode's, not
    simulated)."""
    if isinstance(plan, ZeroPlan):
        params = model_params(model_cfg)
        return lambda p: zero_replay(plan, params, prof.num_units, p, hw)
    if isinstance(plan, ScheduleComparison):
        runs = plan.runs
        return lambda p: runs.replay(p, hw)
    return None


def plan_run(cfg: Config, model_cfg: ModelConfig, machine: Machine, bandwidth_file: str | None = None,
             plan_single: bool = False) -> ModeChoice:
    """The mode, settings and plan of a run: ``auto``'s comparison, or the mode that needs no plan to be
    chosen (planned; single mode only with ``plan_single``, since it runs without a plan)."""
    static = static_mode(cfg, machine)
    if static is None:
        return choose_mode(cfg, model_cfg, machine, bandwidth_file)
    mode, reason = static
    if mode == "single" and not plan_single:
        chosen = Planned(resolve(cfg, machine, mode, reason))
    else:
        chosen = plan_mode(cfg, model_cfg, machine, mode, bandwidth_file, reason)
    return ModeChoice(chosen, reason, [chosen.candidate()], explicit=cfg.parallel.mode != "auto")


def choose_mode(cfg: Config, model_cfg: ModelConfig, machine: Machine,
                bandwidth_file: str | None = None) -> ModeChoice:
    """``parallel.mode: auto``: plan every mode that can run here and pick by :func:`decide`."""
    planned: dict[Mode, Planned] = {}
    candidates = []
    for mode, why_not in mode_options(cfg, machine).items():
        try:
            if why_not:
                raise MobiusError(why_not)
            planned[mode] = plan_mode(cfg, model_cfg, machine, mode, bandwidth_file, "parallel.mode=auto")
            candidates.append(planned[mode].candidate())
        except MobiusError as e:
            candidates.append(Candidate(mode, None, False, str(e).splitlines()[0]))
    gpus = min(cfg.parallel.devices // machine.nodes, machine.gpu_count) if cfg.parallel.device != "cpu" else 0
    mode, reason = decide(candidates, gpus, machine.nvlink(gpus))
    return ModeChoice(planned[mode], reason, candidates, explicit=False)


def decide(candidates: list[Candidate], gpus: int = 0, nvlink: bool = False) -> tuple[Mode, str]:
    """auto's rule: the mode that fits with the fastest predicted step -- except that ``gpus`` GPUs
    sharing NVLink/NVSwitch (``nvlink``) run zero rather than the pipeline, which is built for PCIe
    boxes. Returns the mode and the reason."""
    fitting = sorted((c for c in candidates if c.fits and c.predicted_step_s is not None),
                     key=lambda c: c.predicted_step_s)
    if not fitting:
        raise MobiusError("parallel.mode=auto: no mode fits: " + "; ".join(f"{c.mode}: {c.note}" for c in candidates))
    best = fitting[0]
    zero = next((c for c in fitting if c.mode == "zero"), None)
    if nvlink and zero is not None and best.mode == "pipeline":
        return "zero", (f"the {gpus} GPUs share NVLink/NVSwitch, where zero's all-gathers and reduce-scatters are "
                        f"fast; the pipeline is built for PCIe boxes (its plan predicts {best.predicted_step_s:.3f} s)")
    if best.mode == "single":
        return "single", ("the model, its AdamW states and one micro-batch's activations fit one device, and plain "
                          "training predicts the fastest step")
    if best.mode == "zero":
        return "zero", (f"the {gpus} GPUs share NVLink/NVSwitch and " if nvlink else "") + \
            "zero's plan predicts the fastest step"
    pcie = " on GPUs without NVLink" if gpus > 1 and not nvlink else ""
    return "pipeline", f"the pipeline's plan predicts the fastest step{pcie}"
