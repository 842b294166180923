"""A whole training run as the config says: check the parallel settings early, plan (``parallel.mode:
auto`` compares the modes' plans), then run the single-device engine here or the workers of the
pipeline or zero mode -- started by mobius, or, under ``torchrun``, this process being one of them."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import torch
import torch.distributed as dist

from mobius.app import torchrun
from mobius.app.launch import open_device, run_worker, spawn
from mobius.app.planning import AnyPlan, ModeChoice, plan_run
from mobius.app.settings import Machine, Torchrun, mode_options, resolve, static_mode
from mobius.assemble import check_inputs, claim_run_dir, initial_model, prepare_data, resume_dir, run_model_config
from mobius.checkpoint import ResumeState
from mobius.config import Config
from mobius.data import TextTokenizer, TrainData
from mobius.engine import SingleEngine
from mobius.files import write_text_atomic
from mobius.models import ModelConfig, param_count
from mobius.parallel import Mode, ParallelSettings
from mobius.trainer import Trainer, TrainResult, save_dtype_for

log = logging.getLogger(__name__)
PLAN_FILE = "plan.json"  # the plan a pipeline or zero run runs, as `mobius plan --json` prints it


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
    machine = machine or Machine.detect(cfg)
    check_parallel(cfg, machine)
    resume_from = resume_dir(cfg, resume)
    claim_run_dir(cfg, resume, overwrite)
    tokenizer, data = prepare_data(cfg, resume_from)  # workers then only map the token cache
    model_cfg, ck_dtype = run_model_config(cfg, tokenizer, resume_from)
    _log_data(cfg, data, model_cfg)
    choice = plan_run(cfg, model_cfg, machine)
    _announce(cfg, choice)
    settings, plan = choice.chosen.settings, choice.chosen.plan
    if settings.mode == "single":
        return _run_single(cfg, settings, resume_from, tokenizer, data, model_cfg, ck_dtype)
    return spawn(cfg, settings, plan, str(resume_from) if resume_from else None)


def check_parallel(cfg: Config, machine: Machine) -> None:
    """The parallel settings' errors, before any work (auto: the errors that rule out every mode)."""
    if static_mode(cfg, machine) is not None:
        resolve(cfg, machine)
    else:
        mode_options(cfg, machine)


def _log_data(cfg: Config, data: TrainData, model_cfg: ModelConfig) -> None:
    log.info("data: %d training blocks of %d tokens, %d held out; model: %s, %.1fM parameters", len(data.train),
             cfg.data.seq_len, len(data.val), model_cfg.family, param_count(model_cfg) / 1e6)


def _announce(cfg: Config, choice: ModeChoice) -> None:
    """Log the mode (auto: the choice, its reason and the runner-up in one line), the settings and the
    plan; keep the plan a pipeline or zero run runs in ``output.dir``."""
    log.info("%s", choice.line())
    log.info("%s", choice.chosen.settings.describe())
    if choice.mode != "single":
        log.info("%s", choice.chosen.plan.summary())
        write_json_atomic(Path(cfg.output.dir) / PLAN_FILE, choice.chosen.plan.to_json())


def _run_single(cfg: Config, settings: ParallelSettings, resume_from: Path | None, tokenizer: TextTokenizer,
                data: TrainData, model_cfg: ModelConfig, ck_dtype: torch.dtype | None) -> TrainResult:
    """The reference engine: the whole model on this process's device."""
    engine = SingleEngine(initial_model(cfg, model_cfg, resume_from), cfg, open_device(settings, 0))
    trainer = Trainer(cfg, engine, data, tokenizer, model_cfg, save_dtype_for(cfg, ck_dtype))
    if resume_from is not None:
        trainer.restore(ResumeState(Path(resume_from)))
    try:
        trainer.run()
        return trainer.finish()
    finally:
        engine.close()


def _train_under_torchrun(cfg: Config, run: Torchrun, resume: str | None, overwrite: bool) -> TrainResult:
    """This process is rank ``run.rank`` of ``run.world`` that torchrun started (module
    :mod:`mobius.app.torchrun`): the world size replaces ``parallel.devices``; rank 0 claims the run
    directory and plans; every node tokenizes once and uses its own topology."""
    torchrun.init()
    if cfg.parallel.devices != run.world and run.rank == 0:
        log.info("torchrun started %d processes on %d node(s): parallel.devices=%d -> %d", run.world, run.nodes,
                 cfg.parallel.devices, run.world)
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, devices=run.world))
    machine = Machine.detect(cfg, nodes=run.nodes, torchrun=True)
    resume_from = resume_dir(cfg, resume)
    torchrun.on_ranks(lambda: check_parallel(cfg, machine), True)
    torchrun.on_ranks(lambda: claim_run_dir(cfg, resume, overwrite), run.rank == 0)
    torchrun.check_shared_dir(Path(cfg.output.dir), run)
    tokenizer, data = torchrun.prepare_data_per_node(cfg, resume_from, run)
    model_cfg, ck_dtype = run_model_config(cfg, tokenizer, resume_from)
    if run.rank == 0:
        _log_data(cfg, data, model_cfg)
    mode, reason, plan = torchrun.from_rank0(lambda: _plan_and_announce(cfg, model_cfg, machine))
    settings = torchrun.on_ranks(lambda: resolve(cfg, machine, mode, reason), True)  # this node's devices
    if mode != "single":
        return run_worker(cfg, settings, plan, resume_from)
    try:
        return _run_single(cfg, settings, resume_from, tokenizer, data, model_cfg, ck_dtype)
    finally:
        dist.destroy_process_group()


def _plan_and_announce(cfg: Config, model_cfg: ModelConfig, machine: Machine) -> tuple[Mode, str, AnyPlan | None]:
    choice = plan_run(cfg, model_cfg, machine)
    _announce(cfg, choice)
    return choice.mode, choice.reason, choice.chosen.plan
