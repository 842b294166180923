"""Worker processes of a multi-process run, and the device each process opens.

``mobius train`` in pipeline and zero mode calls :func:`spawn`: one supervised process per worker
(:mod:`mobius.app.supervise`, torch.distributed.elastic's agent) with a torchrun-compatible
environment. Under ``torchrun`` the same :func:`run_worker` runs in every process torchrun started
(:mod:`mobius.app.torchrun`). If a worker fails, every other one is stopped and the error names the
rank and the cause.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import statistics
import time
from datetime import timedelta
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

from mobius.app.supervise import run_workers
from mobius.assemble import Prepared, WeightSource, prepare_data, weights_source
from mobius.checkpoint import ResumeState
from mobius.config import Config
from mobius.engine import Engine
from mobius.models import ModelConfig
from mobius.parallel import ParallelSettings
from mobius.trainer import Startup, Trainer, TrainResult, save_dtype_for
from mobius.app.planning import Planned, RunPlan
from mobius.app.settings import update_cores
from partition.calibrate import ComputeScale, fit_scale, record_scale
from partition.cpu_rate import record_in_step_rate
from partition import RoundRobinPlan, SwappedPlan
from partition.zero import ZeroPlan
from scheduler.pipeline_engine import PipelineEngine
from scheduler.roundrobin_engine import RoundRobinEngine
from scheduler.updater import set_update_cores
from scheduler.zero import ZeroEngine

log = logging.getLogger(__name__)
TIMEOUT = timedelta(minutes=30)  # a collective that waits this long has lost its peer (supervision acts first)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def expandable_segments() -> None:
    """Let CUDA's caching allocator grow its segments in place, unless the user configured it.

    Without this a capped GPU loses about 1 GiB to fragmentation: Llama-3.1-8B LoRA planned to a 23.9
    GiB peak ran out of a 24 GiB cap asking for 1002 MiB with 1.06 GiB reserved but unused, and ran
    at 1.905 s per step with it. Takes effect only before the process first touches CUDA."""
    if "PYTORCH_CUDA_ALLOC_CONF" in os.environ or "PYTORCH_ALLOC_CONF" in os.environ:
        return
    if torch.cuda.is_initialized():
        log.debug("CUDA is already initialised: the allocator keeps its settings")
        return
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"


def _pinned(settings: ParallelSettings, local_rank: int) -> tuple[int, ...] | None:
    """Where this worker's CPU updates run under ``parallel.cpu_pinning`` (:func:`update_cores`); None, and a
    warning, when its share of the cores leaves none to them."""
    local = settings.local_workers
    cores = update_cores(os.sched_getaffinity(0), local_rank % local, local)
    if cores is None:
        log.warning("parallel.cpu_pinning: %d cores for %d worker(s) on this machine leave none apart from the "
                    "dispatch and copy threads; the updates are not pinned", len(os.sched_getaffinity(0)), local)
    return cores


def open_device(settings: ParallelSettings, local_rank: int) -> torch.device:
    """This process's device: ``cuda:<local rank mod GPUs>`` (capped when the settings say so, with
    :func:`expandable_segments`), or the CPU."""
    torch.set_num_threads(settings.cpu_threads)
    set_update_cores(_pinned(settings, local_rank) if settings.cpu_pinning else None)
    if settings.device == "cpu":
        return torch.device("cpu")
    expandable_segments()
    dev = torch.device("cuda", local_rank % settings.gpus)
    torch.cuda.set_device(dev)
    if settings.memory_capped:
        total = torch.cuda.get_device_properties(dev).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, settings.memory_bytes / total), dev)
    return dev


ENGINES: dict[type, type] = {SwappedPlan: PipelineEngine, RoundRobinPlan: RoundRobinEngine, ZeroPlan: ZeroEngine}


def make_engine(cfg: Config, model_cfg: ModelConfig, plan: RunPlan, settings: ParallelSettings,
                device: torch.device, weights_from: WeightSource) -> Engine:
    """This worker's engine: the one that runs ``plan``'s type (:data:`ENGINES`)."""
    return ENGINES[type(plan)](cfg, model_cfg, plan, settings, device, weights_from)


def worker(cfg: Config, settings: ParallelSettings, plan: RunPlan, model_cfg: ModelConfig,
           ck_dtype: torch.dtype | None, resume_from: Path | None, startup: Startup) -> TrainResult:
    """One supervised worker: join the group, then :func:`run_worker` with what the parent resolved
    (the architecture, the checkpoint's dtype, the checkpoint resumed); each worker maps the token
    cache the parent wrote and reads the trainer state it resumes."""
    dist.init_process_group("gloo", timeout=TIMEOUT)
    startup.add("workers", time.time() - startup.launched)
    with startup.phase("data"):
        tokenizer, data = prepare_data(cfg)
    resume = ResumeState(resume_from) if resume_from is not None else None
    return run_worker(cfg, settings, plan, Prepared(tokenizer, data, model_cfg, ck_dtype, resume_from, resume), startup)


def run_worker(cfg: Config, settings: ParallelSettings, plan: RunPlan, ready: Prepared,
               startup: Startup) -> TrainResult:
    """This process's part of a pipeline or zero run, in the default (gloo) process group: build the
    engine of ``plan`` and run the shared training loop.

    On failure it neither closes the engine nor leaves the group: the supervisor (or torchrun) ends
    the process and every other one (a graceful close could wait forever on a peer that is gone)."""
    device = open_device(settings, int(os.environ.get("LOCAL_RANK", dist.get_rank())))
    with startup.phase("weights"):
        source = weights_source(cfg, ready.model_cfg, ready.resume_from)
        engine = make_engine(cfg, ready.model_cfg, plan, settings, device, source)
        trainer = Trainer(cfg, engine, ready.data, ready.tokenizer, ready.model_cfg,
                          save_dtype_for(cfg, ready.ck_dtype), startup=startup)
        if ready.resume is not None:
            trainer.restore(ready.resume)
    trainer.run()
    result = trainer.finish()
    if isinstance(engine, PipelineEngine) and engine.is_main:
        keep_update_rate(cfg, settings, plan, engine.update_rate)
    if isinstance(engine, (PipelineEngine, RoundRobinEngine, ZeroEngine)) and engine.is_main:
        log_phases(plan, Path(cfg.output.dir) / "metrics.jsonl")
    engine.close()
    dist.destroy_process_group()
    return result


def keep_update_rate(cfg: Config, settings: ParallelSettings, plan: SwappedPlan, rate: float | None) -> None:
    """Keep the CPU AdamW rate the pipeline measured inside its steps (per worker) for the next plan on
    this machine (:mod:`partition.cpu_rate`); nothing when the run was too short to measure it."""
    if rate is None:
        return
    record_in_step_rate(settings.cpu_threads, cfg.train.precision, Path(cfg.partition.cache_dir) / "partition",
                        settings.device, plan.options.grad_dtype == "half", rate, cfg.train.optimizer_states)
    log.info("CPU AdamW inside training steps: %.2f G params/s per worker (planned with %.2f); kept for the "
             "next plan on this machine", rate / 1e9, plan.cpu_adam_params_per_s / 1e9)


PHASES = {"forward": "forward_s", "backward": "backward_s", "upload_wait": "upload_wait_s",  # plan -> metrics
          "dispatch": "dispatch_s",  # (predicted: the messages posted to other workers and, on CPU workers, the time
          # per compute action the earlier runs measured; measured: the dispatch thread's own time on every action
          # outside its compute and what held it, the tied ends' sum and the reduce apart)
          "tail": "reduce_s"}  # the step's end (predicted: after the last compute; measured: the dispatch thread's,
# from the tied ends' sum; the swapped pipeline's runtime measures it)
ZERO_PHASES = {"forward": "forward_s", "backward": "backward_s", "cpu_adam": "cpu_adam_s",  # zero plan -> metrics
               "gather_wait": "gather_wait_s", "reduce_scatter": "reduce_scatter_s"}  # (the dispatch thread's waits:
# predicted where it waits itself, on CPU workers)
STEADY_FROM = 2  # steps before the measured medians (warm-up, the first uploads)
MIN_STEADY_STEPS = 3  # steady steps a run needs before its compute is kept for the next plan


def metrics_lines(metrics: Path) -> int:
    """How many lines ``metrics`` holds (0: none yet): a resumed run appends its own after them."""
    try:
        return len(metrics.read_text().splitlines())
    except OSError:
        return 0


def run_rows(metrics: Path, skip: int | None = None) -> list[dict]:
    """The lines of ``metrics`` (a run's metrics.jsonl) this run wrote: those after the first ``skip``
    (the lines there before it started), or, unknown, from the last that records when a run was ready
    (``ready_s``: a resumed run appends after its predecessor's). A line cut short (the run was killed
    while writing it) is left out."""
    rows = []
    try:
        lines = metrics.read_text().splitlines()[skip or 0:]
    except OSError:
        return []
    for line in lines:
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    if skip is not None:
        return rows
    starts = [i for i, r in enumerate(rows) if "ready_s" in r]
    return rows[starts[-1]:] if starts else rows


def steady_rows(rows: list[dict], steady_from: int = STEADY_FROM) -> list[dict]:
    """The step lines of a run's metrics with its compute phases, after the first ``steady_from``, but for a
    step that wrote a trace (``parallel.trace_step``'s: it waited for the CPU updates first, and the writing costs
    time; its line says ``traced``)."""
    steps = [r for r in rows if "step_s" in r and "forward_s" in r and "backward_s" in r]
    return [r for r in steps[steady_from:] if not r.get("traced")]


def phases(predicted_step_s: float, split: dict[str, float], rows: list[dict],
           steady_from: int = STEADY_FROM) -> dict[str, tuple[float, float]] | None:
    """Predicted beside measured, per phase of a pipeline step (seconds per worker; the median of the
    metrics lines after ``steady_from``): the whole step, and where the plan's simulated step spends it
    (``split``: forward, backward with recompute, waiting for uploads; the dispatch thread's own time,
    predicted for the messages it posts to other workers, measured on every action but compute, the tied
    ends' sum and the reduce; the step's end, where the runtime measures it). None without steady steps."""
    steady = steady_rows(rows, steady_from)
    if not steady:
        return None
    out = {"step": (predicted_step_s, statistics.median(r["step_s"] for r in steady))}
    for phase, key in PHASES.items():
        if all(key in r for r in steady):
            out[phase] = (split.get(phase, 0.0), statistics.median(r[key] for r in steady))
    return out


def zero_phases(plan: ZeroPlan, rows: list[dict], steady_from: int = STEADY_FROM) -> dict[str, tuple[float, float]] | None:
    """Predicted beside measured, per phase of a zero step (seconds per rank, rank 0's; the median of the
    metrics lines after ``steady_from``): the whole step, the compute of the forwards and of the losses and
    backwards (from after their gathers), the CPU AdamW, and on CPU workers the dispatch thread's waits for the
    gathers and the reduce-scatters. None without steady steps."""
    steady = steady_rows(rows, steady_from)
    if not steady:
        return None
    predicted = {**plan.time_split, "cpu_adam": plan.cpu_adam_s}
    out = {"step": (plan.predicted_step_s, statistics.median(r["step_s"] for r in steady))}
    for phase, key in ZERO_PHASES.items():
        if phase in predicted and all(key in r for r in steady):
            out[phase] = (predicted[phase], statistics.median(r[key] for r in steady))
    return out


@contextlib.contextmanager
def keeping_compute(cfg: Config, planned: Planned | None) -> Iterator[None]:
    """Around a pipeline or zero run (``planned``: its plan; None or single mode: nothing): however the run
    ends (a Ctrl-C or a failure after its steady steps included), fit the compute its steady steps measured
    (the lines of metrics.jsonl it wrote) to the profile its plan was made with, and keep it for the next
    plan of the mode and setting on this machine (nothing for a run too short to measure, or planned from a
    datasheet or a profile file). What goes wrong there is only logged."""
    metrics = Path(cfg.output.dir) / "metrics.jsonl"
    before = metrics_lines(metrics)
    try:
        yield
    finally:
        if planned is not None and planned.replay is not None:
            try:
                _keep_compute_scale(cfg, planned, run_rows(metrics, before))
            except (OSError, ValueError, KeyError) as e:
                log.warning("the compute this run measured was not kept for the next plan: %s", e)


def _keep_compute_scale(cfg: Config, planned: Planned, rows: list[dict]) -> None:
    prof, replay = planned.profile, planned.replay
    info = prof.notes.get("in_run") if prof is not None else None
    steady = steady_rows(rows)
    if info is None or replay is None or len(steady) < MIN_STEADY_STEPS:
        return
    cpu = planned.settings.device == "cpu"  # (on CPU workers the dispatch thread is the compute's)
    measured = measured_compute(steady, dispatch=cpu and planned.mode == "pipeline",
                                waits=cpu and planned.mode == "zero")
    fitted = fit_scale(prof, replay, measured)
    if not fitted.runs:
        return
    scale = fitted.times(ComputeScale(info["forward"], info["backward"]))  # relative to the profile as measured
    record_scale(os.path.join(cfg.partition.cache_dir, "partition"), info["key"], scale,
                 {"device": prof.device_name, "mode": planned.settings.mode, "schedule": cfg.parallel.schedule,
                  "workers": planned.settings.workers, "threads": planned.settings.cpu_threads})
    given = replay(fitted.apply(prof)).step_s  # the schedule's own error, apart from compute
    log.info("compute inside the steps: forward x%.2f, backward x%.2f the plan's (x%.2f, x%.2f the profile's), "
             "%.2f ms dispatch per compute, workers ±%.0f%% and computes ±%.0f%%%s; with that compute the plan's step "
             "is %.3f s against %.3f s measured; kept for the next plan on this machine", fitted.forward, fitted.backward,
             scale.forward, scale.backward, scale.action_s * 1e3, 100 * scale.worker_spread,
             100 * scale.compute_spread, f", reduce-scatters x{scale.reduce_scatter_x:.2f} the model's"
             if "reduce_scatter" in measured else "", given,
             statistics.median(r["step_s"] for r in steady))


def measured_compute(steady: list[dict], dispatch: bool = False, waits: bool = False) -> dict:
    """What a run's steady steps measured of its compute, as :func:`partition.calibrate.fit_scale` takes it: the
    medians of the forward and backward seconds per worker; with ``dispatch`` the dispatch thread's own time
    (``dispatch_s``); with ``waits`` (zero mode) the dispatch thread's time in its reduce-scatters
    (``reduce_scatter_s``); where the lines give each worker's own (``forward_by_worker``, ``backward_by_worker``; two
    workers or more), ``worker_spread``: how far a worker's compute in a step is from its usual one, against how
    far the others' are (each worker's over its median, over the step's mean of those, less 1: root mean square
    over the steps and workers). Usual: over the steps that give the worker the same work (every step in the
    swapped pipeline; in the round-robin, whose rotation moves on from step to step, the steps a number of
    workers apart), so what the plan gives each worker does not count. Where they give it, ``compute_spread``:
    the median of the steps' spread of one compute's time."""
    out: dict = {k: statistics.median(r[f"{k}_s"] for r in steady) for k in ("forward", "backward")}
    if dispatch:
        out["dispatch"] = statistics.median(r["dispatch_s"] for r in steady)
    if waits and all("reduce_scatter_s" in r for r in steady):
        out["reduce_scatter"] = statistics.median(r["reduce_scatter_s"] for r in steady)
    if all("compute_spread" in r for r in steady):
        out["compute_spread"] = statistics.median(r["compute_spread"] for r in steady)
    each = [[f + b for f, b in zip(r.get("forward_by_worker", ()), r.get("backward_by_worker", ()))] for r in steady]
    n = len(each[0]) if each else 0
    if n > 1 and all(len(c) == n for c in each):
        period = n if steady[0].get("schedule") == "round_robin" else 1
        group = [r["step"] % period for r in steady]
        usual = {(g, w): statistics.median(c[w] for c, h in zip(each, group) if h == g)
                 for g in set(group) for w in range(n)}
        apart = []
        for c, g in zip(each, group):
            ratios = [x / usual[g, w] if usual[g, w] > 0 else 1.0 for w, x in enumerate(c)]
            mean = statistics.fmean(ratios)
            apart += [(x / mean - 1.0) ** 2 for x in ratios]
        out["worker_spread"] = statistics.fmean(apart) ** 0.5
    return out


def log_phases(plan: RunPlan, metrics: Path) -> None:
    """Log :func:`phases` (:func:`zero_phases`) of the run of ``plan`` whose metrics are in ``metrics`` in one
    line."""
    rows = run_rows(metrics)
    if isinstance(plan, ZeroPlan):
        table = zero_phases(plan, rows)
    else:
        table = phases(plan.predicted_step_s, plan.time_split, rows)
    if table is None:
        return
    log.info("predicted / measured per step: " + ", ".join(f"{p.replace('_', ' ')} {a:.3f} / {b:.3f} s"
                                                             for p, (a, b) in table.items()))


def spawn(cfg: Config, settings: ParallelSettings, plan: RunPlan, ready: Prepared,
          startup: Startup) -> TrainResult:
    """Run the workers (supervised) and return rank 0's result."""
    startup.launched = time.time()
    args = (cfg, settings, plan, ready.model_cfg, ready.ck_dtype, ready.resume_from, startup)
    results = run_workers(worker, args, settings.workers, logging.getLogger().getEffectiveLevel())
    return results[0]
