"""A whole training run as the config says: resolve the parallel settings once, plan, then run the
single-device engine here or the pipeline's workers."""

from __future__ import annotations

import logging
from pathlib import Path

from mobius.app.launch import open_device, spawn
from mobius.app.planning import plan_pipeline
from mobius.app.settings import Machine, resolve
from mobius.assemble import initial_model, prepare_data, resume_dir, run_model_config
from mobius.checkpoint import ResumeState
from mobius.config import Config
from mobius.engine import SingleEngine
from mobius.models import param_count
from mobius.trainer import Trainer, TrainResult, save_dtype_for

log = logging.getLogger(__name__)


def train(cfg: Config, resume: str | None = None, machine: Machine | None = None) -> TrainResult:
    """Run a whole training job; returns losses and the final checkpoint path."""
    cfg.check_ready()
    machine = machine or Machine.detect(cfg)
    settings = resolve(cfg, machine)
    resume_from = resume_dir(cfg, resume)
    tokenizer, data = prepare_data(cfg, resume_from)  # workers then only map the token cache
    model_cfg, ck_dtype = run_model_config(cfg, tokenizer, resume_from)
    log.info("data: %d training blocks of %d tokens, %d held out; model: %s, %.1fM parameters", len(data.train),
             cfg.data.seq_len, len(data.val), model_cfg.family, param_count(model_cfg) / 1e6)
    log.info("%s", settings.describe())
    if settings.mode == "pipeline":
        plan, _, _ = plan_pipeline(cfg, model_cfg, settings, machine)
        log.info("%s", plan.summary())
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
