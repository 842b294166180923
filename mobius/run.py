"""Assemble a training run from a :class:`~mobius.config.Config`: tokenizer, data, model, engine."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from mobius.config import PLACEHOLDER, Config
from mobius.data import TextTokenizer, TrainData, build_data, load_tokenizer, tokenize_to_cache
from mobius.engine import DTYPES, SingleEngine
from mobius.errors import ConfigError, NotAvailableError
from mobius.models import CausalLM, ModelConfig, build_model, get_preset, param_count
from mobius.models.hf import load_checkpoint, read_config
from mobius.trainer import Trainer, TrainResult, read_trainer_state, save_dtype_for, step_checkpoints

log = logging.getLogger(__name__)


@dataclass
class RunParts:
    model_cfg: ModelConfig
    model: CausalLM
    tokenizer: TextTokenizer
    data: TrainData
    checkpoint_dtype: torch.dtype | None
    resume_state: dict | None
    resume_dir: Path | None


def resolve_device(cfg: Config) -> torch.device:
    want = cfg.parallel.device
    if want == "cuda" and not torch.cuda.is_available():
        raise NotAvailableError("parallel.device=cuda but no CUDA GPU is visible")
    return torch.device("cuda" if want != "cpu" and torch.cuda.is_available() else "cpu")


def resolve_mode(cfg: Config) -> str:
    mode = cfg.parallel.mode
    if mode == "auto":
        mode = "single" if cfg.parallel.devices == 1 else "pipeline"
    if mode == "zero":
        raise NotAvailableError("parallel.mode=zero is not available yet in this version; use single or pipeline")
    if mode == "single" and cfg.parallel.devices != 1:
        raise ConfigError(f"parallel.mode=single runs on one device, but parallel.devices={cfg.parallel.devices}")
    return mode


def _checkpoint_dtype(path: Path) -> torch.dtype | None:
    hf = json.loads((path / "config.json").read_text())
    name = hf.get("torch_dtype") or hf.get("dtype")
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}.get(name)


def architecture(cfg: Config) -> ModelConfig:
    """The model architecture a config names: the checkpoint's config.json when the checkpoint is at
    hand (checked against ``model.preset`` when both are given), else the preset."""
    ck = cfg.model.checkpoint
    if ck and not ck.startswith(PLACEHOLDER) and Path(ck).exists():
        mc = read_config(ck)
        if cfg.model.preset:
            _check_matches_preset(mc, cfg.model.preset, ck)
        return mc
    if cfg.model.preset:
        return get_preset(cfg.model.preset)
    raise ConfigError(f"{cfg.source}: model.checkpoint {ck} is not at hand and no model.preset names the architecture")


def _check_matches_preset(mc: ModelConfig, preset: str, where: str) -> None:
    expected = get_preset(preset)
    keys = ("family", "n_embd", "n_layer", "n_head", "hidden_size", "num_hidden_layers", "num_attention_heads")
    for key in keys:
        a, b = getattr(mc, key, None), getattr(expected, key, None)
        if a != b:
            raise ConfigError(f"{where}: the checkpoint's {key} is {a}, but model.preset {preset} has {b}")


def _model_config(cfg: Config, tokenizer: TextTokenizer) -> ModelConfig:
    if cfg.model.checkpoint:
        mc = architecture(cfg)
        if tokenizer.vocab_size > mc.vocab_size:
            raise ConfigError(f"the tokenizer has {tokenizer.vocab_size} tokens, more than the checkpoint's "
                              f"vocab_size {mc.vocab_size}")
    else:
        mc = get_preset(cfg.model.preset)
        if tokenizer.vocab_size != mc.vocab_size:
            vocab = -(-tokenizer.vocab_size // 64) * 64  # rounded up to a multiple of 64
            log.info("from scratch: vocab_size %d -> %d to match the tokenizer", mc.vocab_size, vocab)
            mc.vocab_size = vocab
            mc.bos_token_id = mc.eos_token_id = tokenizer.eos_id
    if cfg.model.dropout is not None:
        mc.set_dropout(cfg.model.dropout)
    return mc


def prepare_data(cfg: Config, resume_dir: Path | None) -> tuple[TextTokenizer, TrainData]:
    """The run's tokenizer and its packed, split, cached data."""
    tokenizer = load_tokenizer(cfg.data.tokenizer, str(resume_dir or cfg.model.checkpoint or "") or None)
    tokens = tokenize_to_cache(cfg.data.path, cfg.data.text_field, tokenizer, cfg.data.cache_dir)
    data = build_data(tokens, cfg.data.seq_len, cfg.data.val_fraction, cfg.train.seed)
    log.debug("data: %s tokens, %d training blocks of %d, %d held out", f"{len(tokens):,}", len(data.train),
              cfg.data.seq_len, len(data.val))
    return tokenizer, data


def run_model_config(cfg: Config, tokenizer: TextTokenizer,
                     resume_dir: Path | None) -> tuple[ModelConfig, torch.dtype | None]:
    """The architecture being trained, and the dtype of the checkpoint fine-tuned (if any)."""
    if resume_dir is not None:
        mc = read_config(resume_dir)
        if cfg.model.dropout is not None:
            mc.set_dropout(cfg.model.dropout)
    else:
        mc = _model_config(cfg, tokenizer)
    ck_dtype = _checkpoint_dtype(Path(cfg.model.checkpoint)) if cfg.model.checkpoint else None
    return mc, ck_dtype


def prepare(cfg: Config, resume: str | None = None) -> RunParts:
    """Tokenizer, data, model config and initial weights (fresh, fine-tune or resumed)."""
    cfg.check_ready()
    resume_dir = _resume_dir(cfg, resume)
    tokenizer, data = prepare_data(cfg, resume_dir)
    log.info("data: %d training blocks of %d tokens, %d held out", len(data.train), cfg.data.seq_len, len(data.val))
    mc, ck_dtype = run_model_config(cfg, tokenizer, resume_dir)
    state = read_trainer_state(resume_dir) if resume_dir is not None else None
    if resume_dir is not None:
        model = load_checkpoint(resume_dir, mc)
    elif cfg.model.checkpoint:
        model = load_checkpoint(cfg.model.checkpoint, mc)
    else:
        model = build_model(mc, cfg.train.seed)
    log.info("model: %s, %.1fM parameters", mc.family, param_count(mc) / 1e6)
    return RunParts(mc, model, tokenizer, data, ck_dtype, state, resume_dir)


def _resume_dir(cfg: Config, resume: str | None) -> Path | None:
    out = Path(cfg.output.dir)
    if resume is None:
        if step_checkpoints(out):
            raise ConfigError(f"output.dir {out} already holds step checkpoints of an earlier run; pass --resume to "
                              f"continue it or choose another output.dir")
        return None
    if resume == "auto":
        found = step_checkpoints(out)
        if not found:
            raise ConfigError(f"--resume: no step checkpoint under {out / 'checkpoints'}")
        return found[-1]
    path = Path(resume)
    if not (path / "config.json").is_file():
        raise ConfigError(f"--resume {path}: not a checkpoint directory")
    return path


def train(cfg: Config, resume: str | None = None) -> TrainResult:
    """Run a whole training job as the config says; returns losses and the final checkpoint path."""
    cfg.check_ready()
    mode = resolve_mode(cfg)
    if mode == "pipeline":
        return train_pipeline(cfg, resume)
    parts = prepare(cfg, resume)
    device = resolve_device(cfg)
    log.info("mode: %s on %s, precision %s", mode, device, cfg.train.precision)
    engine = SingleEngine(parts.model, cfg, device)
    trainer = Trainer(cfg, engine, parts.data, parts.tokenizer, parts.model_cfg,
                      save_dtype_for(cfg, parts.checkpoint_dtype))
    if parts.resume_state is not None:
        trainer.restore(parts.resume_state, parts.resume_dir)
    try:
        trainer.run()
        return trainer.finish()
    finally:
        engine.close()


def train_pipeline(cfg: Config, resume: str | None) -> TrainResult:
    """Plan the stages here, then run the swapped pipeline in one worker process per device."""
    from scheduler.launch import spawn
    from scheduler.plan import pipeline_spec

    resume_dir = _resume_dir(cfg, resume)
    tokenizer, data = prepare_data(cfg, resume_dir)  # the workers then only map the token cache
    mc, _ = run_model_config(cfg, tokenizer, resume_dir)
    spec = pipeline_spec(cfg, mc)
    log.info("data: %d training blocks of %d tokens; model: %s, %.1fM parameters", len(data.train),
             cfg.data.seq_len, mc.family, param_count(mc) / 1e6)
    return spawn(cfg, spec, str(resume_dir) if resume_dir else None)


__all__ = ["train", "prepare", "resolve_device", "resolve_mode", "DTYPES"]
