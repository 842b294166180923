"""A whole training run as the config says: check the parallel settings early, plan (``parallel.mode:
auto`` compares the modes' plans), then run the single-device engine here or the workers of the
pipeline or zero mode -- started by mobius, or, under ``torchrun``, this process being one of them.

Every check comes before any work, and each before anything is measured that it does not need: the inputs
and the parallel settings (with a word when CPU workers would outnumber the cores), the run directory
(claimed for the run: :mod:`mobius.app.rundir`), the data, the model against its checkpoint and against what
``--resume`` continues (:func:`prepare`), the free disk for checkpoints, then the plan (zero mode's must fit).
Only then does ``--overwrite`` set the old run aside and the plan get written."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from mobius.app import torchrun
from mobius.app.launch import keeping_compute, open_device, run_worker, spawn
from mobius.app.planning import ModeChoice, Planned, RunPlan, plan_run, profile_line
from mobius.app.rundir import PLAN_FILE, RunDir
from mobius.app.settings import Machine, Torchrun, local_cpu_workers, mode_options, resolve, static_mode
from mobius.app.supervise import end_when_orphaned, helpers_settled, start_helpers_early
from mobius.assemble import (Prepared, check_inputs, check_resume, initial_model, prepare_data, resume_dir,
                             run_model_config, with_document_tokens)
from mobius.checkpoint import checkpoint_bytes
from mobius.config import Config
from mobius.data import TrainData
from mobius.errors import ConfigError, size_text
from mobius.files import write_failure, write_text_atomic
from mobius.models import ModelConfig, param_count
from mobius.parallel import Mode, ParallelSettings
from mobius.trainer import Startup, Trainer, TrainResult, save_dtype_for
from partition.single_plan import SinglePlan
from partition.zero import ZeroPlan
from scheduler.single_engine import SingleEngine

log = logging.getLogger(__name__)


def write_json_atomic(path: Path, data: dict) -> None:
    write_text_atomic(path, json.dumps(data, indent=1) + "\n")


def train(cfg: Config, resume: str | None = None, machine: Machine | None = None,
          overwrite: bool = False) -> TrainResult:
    """Run a whole training job; returns losses and the final checkpoint path. ``resume``: a
    checkpoint directory or "auto" (the latest in ``output.dir``); ``overwrite``: replace a run
    ``output.dir`` already holds."""
    cfg.check_ready()
    check_inputs(cfg)
    run = Torchrun.from_env()
    if run is not None:
        return _train_under_torchrun(cfg, run, resume, overwrite)
    startup = Startup()
    machine = machine or Machine.detect(cfg)
    check_parallel(cfg, machine)
    warn_oversubscribed(cfg, machine)
    rundir = RunDir.claim(Path(cfg.output.dir), resume, overwrite)
    known = static_mode(cfg, machine)  # (None: auto, which may pick single; then nothing would use the server)
    workers_ahead = known is not None and known[0] != "single"
    if workers_ahead:
        start_helpers_early()  # the workers' imports go on while the data is made
    try:
        with startup.phase("data"):
            ready = prepare(cfg, resume)
        cfg = with_document_tokens(cfg, ready.data)  # the plan profiles attention as the data is packed
        check_prepared(cfg, ready)
        if workers_ahead:
            with startup.phase("workers"):
                helpers_settled()  # the plan's measurements time a machine that does nothing else
        with startup.phase("plan"):
            choice = plan_run(cfg, ready.model_cfg, machine)
            check_plan(choice)
        rundir.set_aside()
        _announce(cfg, choice)
        settings = choice.chosen.settings
        if settings.mode == "single":
            return _run_single(cfg, settings, ready, startup)
        with keeping_compute(cfg, choice.chosen):
            return spawn(cfg, settings, choice.chosen.runs, ready, startup)
    finally:
        rundir.release()


def prepare(cfg: Config, resume: str | None) -> Prepared:
    """The checks and the parts that need no plan: the checkpoint ``--resume`` names, the data
    (tokenized once; workers then only map the token cache), the architecture, and what resuming
    continues checked against the config."""
    resume_from = resume_dir(cfg, resume)
    tokenizer, data = prepare_data(cfg)
    model_cfg, ck_dtype = run_model_config(cfg, tokenizer, resume_from)
    state = check_resume(cfg, resume_from, tokenizer, data, model_cfg.lora) if resume_from is not None else None
    return Prepared(tokenizer, data, model_cfg, ck_dtype, resume_from, state)


def check_parallel(cfg: Config, machine: Machine) -> None:
    """The parallel settings' errors, before any work (auto: the errors that rule out every mode; every
    mode runs either train.update)."""
    if static_mode(cfg, machine) is not None:
        resolve(cfg, machine)
    else:
        mode_options(cfg, machine)


def warn_oversubscribed(cfg: Config, machine: Machine) -> None:
    """A word when CPU worker processes would outnumber this machine's cores, given with the parallel settings'
    checks: before the run reads its data or measures anything for them."""
    local = local_cpu_workers(cfg, machine)
    if local > machine.cpu_count:
        log.warning("parallel.devices=%d: %d CPU worker processes on this machine's %d cores share them, each "
                    "running slower; fewer devices may train faster", cfg.parallel.devices, local, machine.cpu_count)


def check_prepared(cfg: Config, ready: Prepared) -> None:
    """The checks that need the prepared model and nothing measured (before the plan): the disk holds the
    largest checkpoint the run writes."""
    log.info("data: %d training blocks of %d tokens, %d held out%s; model: %s, %.1fM parameters", len(ready.data.train),
             cfg.data.seq_len, len(ready.data.val), _targets_per_step(cfg, ready.data), ready.model_cfg.family,
             param_count(ready.model_cfg) / 1e6)
    check_disk(Path(cfg.output.dir), cfg, ready.model_cfg, save_dtype_for(cfg, ready.ck_dtype))


def _targets_per_step(cfg: Config, data: TrainData) -> str:
    """", about 2,960 target tokens a step (40% of its positions)" for data whose targets are not every position
    (conversations), from the data's totals; "" for text."""
    s = data.stats
    if s is None or s.format == "text" or not s.train_blocks + s.val_blocks:
        return ""
    share = s.target_tokens / ((s.train_blocks + s.val_blocks) * s.seq_len)
    per_step = share * cfg.train.micro_batch_size * cfg.train.micro_batches * s.seq_len
    return f", about {per_step:,.0f} target tokens a step ({100 * share:.0f}% of its positions)"


def check_plan(choice: ModeChoice) -> None:
    """The last check before any work: zero mode's plan fits."""
    plan = choice.chosen.plan
    if isinstance(plan, ZeroPlan) and not plan.fits:
        raise ConfigError(_zero_too_big(plan))


def _zero_too_big(plan: ZeroPlan) -> str:
    m = plan.memory
    need = plan.peak_bytes - m["activations"]
    given = [f"zero.{k}" for k, how in plan.decided.items() if how == "config"]
    advice = (f"lower {' or '.join(given)}" if given else "set zero.chunk_size smaller") + \
        ", set zero.gpu_chunks=0 (offload every chunk), or raise partition.gpu_memory_gib"
    return (f"zero mode's plan needs {size_text(need)} per rank for its chunks and rCache ({plan.num_chunks} "
            f"chunk(s) of {plan.chunk_size:,} parameters, {plan.cache_blocks} rCache block(s), {plan.gpu_chunks} on "
            f"the GPU), more "
            f"than the {size_text(max(m['usable'], 0))} usable of {size_text(m['capacity'])}; {advice}")


def check_disk(out: Path, cfg: Config, model_cfg: ModelConfig, save_dtype: torch.dtype) -> None:
    """``output.dir``'s disk holds the largest checkpoint the run writes (estimated from the model)."""
    delayed, states = cfg.train.delayed, cfg.train.optimizer_states
    sizes = {"the final checkpoint": checkpoint_bytes(model_cfg, save_dtype, save_dtype == torch.float32, delayed,
                                                      states)}
    if cfg.output.save_every and cfg.output.save_every < cfg.train.max_steps:
        sizes["a step checkpoint (fp32 weights and AdamW moments)"] = checkpoint_bytes(model_cfg, torch.float32,
                                                                                       True, delayed, states)
    if model_cfg.lora is not None and cfg.output.save_merged:
        sizes["the merged model"] = checkpoint_bytes(dataclasses.replace(model_cfg, lora=None), save_dtype, False)
    what, need = max(sizes.items(), key=lambda kv: kv[1])
    free = shutil.disk_usage(out).free
    if free < need:
        raise ConfigError(f"output.dir {out} has {size_text(free)} free, but {what} of this model takes about "
                          f"{size_text(need)}; free some space or set output.dir to another disk")


def _announce(cfg: Config, choice: ModeChoice) -> None:
    """Log the mode (auto: the choice, its reason and the runner-up in one line), the settings and the
    plan; keep the plan a pipeline or zero run runs in ``output.dir``."""
    log.info("%s", choice.line())
    log.info("%s", choice.chosen.settings.describe())
    if cfg.train.delayed:
        log.info("train.update=delayed: each step computes with the weights one update older than the newest "
                 "(step t with w_{t-2}); evaluation and saved weights are the newest")
    if choice.chosen.profile is not None:
        log.info("profile: %s", profile_line(choice.chosen.profile))
    if choice.mode != "single":
        log.info("%s", choice.chosen.plan.summary())
        path = Path(cfg.output.dir) / PLAN_FILE
        try:
            write_json_atomic(path, choice.chosen.plan.to_json())
        except OSError as e:
            raise ConfigError(f"cannot write {path}: {write_failure(e)}") from None


def _run_single(cfg: Config, settings: ParallelSettings, ready: Prepared, startup: Startup) -> TrainResult:
    """The reference engine: the whole model on this process's device."""
    with startup.phase("weights"):
        device = open_device(settings, 0)
        engine = SingleEngine(initial_model(cfg, ready.model_cfg, ready.resume_from, device), cfg, device)
        trainer = Trainer(cfg, engine, ready.data, ready.tokenizer, ready.model_cfg,
                          save_dtype_for(cfg, ready.ck_dtype), startup=startup)
        if ready.resume is not None:
            trainer.restore(ready.resume)
    try:
        trainer.run()
        return trainer.finish()
    finally:
        engine.close()


def _train_under_torchrun(cfg: Config, run: Torchrun, resume: str | None, overwrite: bool) -> TrainResult:
    """This process is rank ``run.rank`` of ``run.world`` that torchrun started (module
    :mod:`mobius.app.torchrun`): the world size replaces ``parallel.devices``; rank 0 claims the run
    directory and plans; every node tokenizes once and uses its own topology."""
    startup = Startup()
    end_when_orphaned(run.rank)  # a stop signal ends this rank by itself (one line); so does the agent's death
    torchrun.init()
    watch = torchrun.watch_ranks(run) if run.nodes > 1 else None  # (on one node, torchrun's agent ends them)
    if cfg.parallel.devices != run.world and run.rank == 0:
        log.info("torchrun started %d processes on %d node(s): parallel.devices=%d -> %d", run.world, run.nodes,
                 cfg.parallel.devices, run.world)
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, devices=run.world))
    machine = Machine.detect(cfg, nodes=run.nodes, torchrun=True)
    torchrun.on_ranks(lambda: check_parallel(cfg, machine), True)
    if run.rank == 0:
        warn_oversubscribed(cfg, machine)
    rundir = torchrun.on_ranks(lambda: RunDir.claim(Path(cfg.output.dir), resume, overwrite), run.rank == 0)
    try:
        result = _torchrun_ranks(cfg, run, machine, resume, rundir, startup)
    finally:
        if rundir is not None:
            rundir.release()
    if watch is not None:
        watch.finish()
    return result


def _torchrun_ranks(cfg: Config, run: Torchrun, machine: Machine, resume: str | None,
                    rundir: RunDir | None, startup: Startup) -> TrainResult:
    torchrun.check_shared_dir(Path(cfg.output.dir), run)
    with startup.phase("data"):
        ready = torchrun.prepare_per_node(lambda: prepare(cfg, resume), run)
    cfg = with_document_tokens(cfg, ready.data)  # the plan profiles attention as the data is packed
    chosen: list[Planned] = []  # rank 0's plan, for what its run measured
    with startup.phase("plan"):
        mode, reason, plan = torchrun.from_rank0(lambda: _plan_and_announce(cfg, ready, machine, rundir, chosen))
        settings = torchrun.on_ranks(lambda: resolve(cfg, machine, mode, reason), True)  # this node's devices
    if mode != "single":
        with keeping_compute(cfg, chosen[0] if chosen else None):  # rank 0 planned it
            return run_worker(cfg, settings, plan, ready, startup)
    try:
        return _run_single(cfg, settings, ready, startup)
    finally:
        dist.destroy_process_group()


def _plan_and_announce(cfg: Config, ready: Prepared, machine: Machine, rundir: RunDir | None,
                       chosen: list[Planned]) -> tuple[Mode, str, RunPlan | SinglePlan | None]:
    check_prepared(cfg, ready)
    choice = plan_run(cfg, ready.model_cfg, machine)
    chosen.append(choice.chosen)
    check_plan(choice)
    if rundir is not None:
        rundir.set_aside()
    _announce(cfg, choice)
    return choice.mode, choice.reason, choice.chosen.runs
