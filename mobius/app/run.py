"""A whole training run as the config says: resolve the parallel settings once, plan, then run the
single-device engine here or the workers of the pipeline or zero mode."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from mobius.app.launch import open_device, spawn
from mobius.app.planning import plan_pipeline, plan_zero
from mobius.app.settings import Machine, resolve
from mobius.assemble import check_inputs, claim_run_dir, initial_model, prepare_data, resume_dir, run_model_config
from mobius.checkpoint import ResumeState
from mobius.config import Config
from mobius.engine import SingleEngine
from mobius.models import param_count
from mobius.trainer import Trainer, TrainResult, save_dtype_for

log = logging.getLogger(__name__)
PLAN_FILE = "plan.json"  # the plan a pipeline or zero run runs, as `mobius plan --json` prints it


def write_json_atomic(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def train(cfg: Config, resume: str | None = None, machine: Machine | None = None,
          overwrite: bool = False) -> TrainResult:
    """Run a whole training job; returns losses and the final checkpoint path. ``resume``: a
    checkpoint directory or "auto" (the latest in ``output.dir``); ``overwrite``: replace a run
    ``output.dir`` already holds."""
    cfg.check_ready()
    check_inputs(cfg)
    machine = machine or Machine.detect(cfg)
    settings = resolve(cfg, machine)
    resume_from = resume_dir(cfg, resume)
    claim_run_dir(cfg, resume, overwrite)
    tokenizer, data = prepare_data(cfg, resume_from)  # workers then only map the token cache
    model_cfg, ck_dtype = run_model_config(cfg, tokenizer, resume_from)
    log.info("data: %d training blocks of %d tokens, %d held out; model: %s, %.1fM parameters", len(data.train),
             cfg.data.seq_len, len(data.val), model_cfg.family, param_count(model_cfg) / 1e6)
    log.info("%s", settings.describe())
    if settings.mode in ("pipeline", "zero"):
        planner = plan_pipeline if settings.mode == "pipeline" else plan_zero
        plan, _, _ = planner(cfg, model_cfg, settings, machine)
        log.info("%s", plan.summary())
        write_json_atomic(Path(cfg.output.dir) / PLAN_FILE, plan.to_json())
        return spawn(cfg, settings, plan, str(resume_from) if resume_from else None)
    engine = SingleEngine(initial_model(cfg, model_cfg, resume_from), cfg, open_device(settings, 0))
    trainer = Trainer(cfg, engine, data, tokenizer, model_cfg, save_dtype_for(cfg, ck_dtype))
    if resume_from is not None:
        trainer.restore(ResumeState(Path(resume_from)))
    try:
        trainer.run()
        return trainer.finish()
    finally:
        engine.close()
