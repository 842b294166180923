"""The parts of a training run from a :class:`~mobius.config.Config`: the run directory to resume
from, the tokenizer and data, the architecture, and the initial weights. Used by every mode (the
single-process run and each worker process)."""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from mobius.checkpoint import stale_temporaries
from mobius.config import PLACEHOLDER, Config
from mobius.data import (BUILTIN_STDLIB, TextTokenizer, TrainData, build_data, load_tokenizer, source_files,
                         tokenize_to_cache)
from mobius.errors import CheckpointError, ConfigError
from mobius.models import CausalLM, ModelConfig, build_model, get_preset, initial_weights
from mobius.models.hf import LazyCheckpoint, from_hf, load_into, read_config
from mobius.models.lora import ADAPTER, LoraSpec, block_targets
from mobius.models.peft import read_adapter
from mobius.trainer import step_checkpoints

log = logging.getLogger(__name__)


RUN_FILES = ("metrics.jsonl", "plan.json", "final", "merged", "checkpoints", "loss.png")  # what a run writes in output.dir


def check_inputs(cfg: Config) -> None:
    """Every file the config names exists and is what it should be, before any work starts."""
    ck = cfg.model.checkpoint
    if ck:
        path = Path(ck)
        if not path.is_dir():
            raise CheckpointError(f"model.checkpoint {ck}: no such directory")
        read_config(path)  # config.json of a supported family
        LazyCheckpoint(path)  # weights present and readable (headers only)
    if cfg.data.path != BUILTIN_STDLIB:
        source_files(cfg.data.path)
    tok = cfg.data.tokenizer
    if tok and not Path(tok).exists():
        raise ConfigError(f"data.tokenizer {tok}: no such file or directory")


def claim_run_dir(cfg: Config, resume: str | None, overwrite: bool) -> None:
    """Refuse an ``output.dir`` that holds a run unless resuming it or told to overwrite it; remove
    what an interrupted checkpoint write left behind (only mobius's own temporary names)."""
    out = Path(cfg.output.dir)
    held = [name for name in RUN_FILES if (out / name).exists()] + [p.name for p in out.glob("trace-step*.json")]
    if resume is None and held:
        if not overwrite:
            raise ConfigError(f"output.dir {out} already holds a run ({', '.join(held)}); pass --resume to continue "
                              f"it, --overwrite to replace it, or choose another output.dir")
        for name in held:
            target = out / name
            shutil.rmtree(target) if target.is_dir() else target.unlink()
        log.info("--overwrite: removed %s from %s", ", ".join(held), out)
    for stale in stale_temporaries(out) + stale_temporaries(out / "checkpoints"):
        shutil.rmtree(stale, ignore_errors=True)
        log.info("removed %s, left by an interrupted checkpoint write", stale)


def resume_dir(cfg: Config, resume: str | None) -> Path | None:
    """The checkpoint ``--resume`` names (``auto``: the latest step checkpoint in ``output.dir``)."""
    out = Path(cfg.output.dir)
    if resume is None:
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


def prepare_data(cfg: Config, resume_from: Path | None) -> tuple[TextTokenizer, TrainData]:
    """The run's tokenizer and its packed, split, cached data."""
    tokenizer = load_tokenizer(cfg.data.tokenizer, str(resume_from or cfg.model.checkpoint or "") or None)
    tokens = tokenize_to_cache(cfg.data.path, cfg.data.text_field, tokenizer, cfg.data.cache_dir)
    data = build_data(tokens, cfg.data.seq_len, cfg.data.val_fraction, cfg.train.seed)
    log.debug("data: %s tokens, %d training blocks of %d, %d held out", f"{len(tokens):,}", len(data.train),
              cfg.data.seq_len, len(data.val))
    return tokenizer, data


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
        mc = get_preset(cfg.model.preset)
        mc.check_sequence(cfg.data.seq_len)
        return mc
    raise ConfigError(f"{cfg.source}: model.checkpoint {ck} is not at hand and no model.preset names the architecture")


def planned_architecture(cfg: Config) -> ModelConfig:
    """The architecture ``mobius plan`` plans for: exactly what ``mobius train`` would build (the
    tokenizer decides a from-scratch vocabulary), or the preset when the checkpoint is not at hand."""
    ck, tok = cfg.model.checkpoint, cfg.data.tokenizer
    if ck and (ck.startswith(PLACEHOLDER) or not Path(ck).exists()) or (tok and tok.startswith(PLACEHOLDER)):
        return with_adapters(architecture(cfg), cfg)
    tokenizer = load_tokenizer(tok, ck or None)
    return run_model_config(cfg, tokenizer, None)[0]


def _check_matches_preset(mc: ModelConfig, preset: str, where: str) -> None:
    expected = get_preset(preset)
    for key in ("family", *expected.ARCH_FIELDS):
        a, b = getattr(mc, key, None), getattr(expected, key, None)
        if a != b:
            raise ConfigError(f"{where}: the checkpoint's {key} is {a}, but model.preset {preset} has {b}")


def _fresh_model_config(cfg: Config, tokenizer: TextTokenizer) -> ModelConfig:
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
            mc.eos_token_id = tokenizer.eos_id
            mc.bos_token_id = tokenizer.eos_id if tokenizer.bos_id is None else tokenizer.bos_id
    if cfg.model.dropout is not None:
        mc.set_dropout(cfg.model.dropout)
    return mc


def run_model_config(cfg: Config, tokenizer: TextTokenizer,
                     resume_from: Path | None) -> tuple[ModelConfig, torch.dtype | None]:
    """The architecture being trained, and the dtype of the checkpoint fine-tuned (if any)."""
    if resume_from is not None:
        mc = read_config(resume_from)
        if cfg.model.dropout is not None:
            mc.set_dropout(cfg.model.dropout)
    else:
        mc = _fresh_model_config(cfg, tokenizer)
    mc.check_sequence(cfg.data.seq_len)
    ck_dtype = _checkpoint_dtype(Path(cfg.model.checkpoint)) if cfg.model.checkpoint else None
    return with_adapters(mc, cfg), ck_dtype


def _checkpoint_dtype(path: Path) -> torch.dtype | None:
    hf = json.loads((path / "config.json").read_text())
    name = hf.get("torch_dtype") or hf.get("dtype")
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}.get(name)


@dataclass(frozen=True)
class WeightSource:
    """Where a run's initial weights come from (every engine reads its parameters through :meth:`load`):
    a Hugging Face checkpoint (the one fine-tuned, or the full fine-tuning resumed) or the seed; under
    LoRA the frozen weights always from the fine-tuned checkpoint, and what trains from the LoRA
    checkpoint resumed (its ``adapter_model.safetensors``) or, at the start, the checkpoint and the
    seed (adapters)."""

    base: str | None
    adapters: str | None
    seed: int

    def load(self, cfg: ModelConfig, names: set[str], units: set[int]) -> dict[str, torch.Tensor]:
        """The tensors of ``names`` (the parameters of ``units``), by mobius name."""
        out: dict[str, torch.Tensor] = {}
        if self.adapters is not None:
            out.update({k: v for k, v in read_adapter(self.adapters, cfg).items() if k in names})
        base = {n for n in names - set(out) if ADAPTER not in n}
        if self.base is not None and base:
            out.update(from_hf(LazyCheckpoint(self.base), cfg, only=lambda k: k in base))
        rest = names - set(out)
        if rest:
            out.update({k: v for k, v in initial_weights(cfg, units, self.seed).items() if k in rest})
        return out


def weights_source(cfg: Config, resume_from: Path | None) -> WeightSource:
    """Where the initial weights come from: the checkpoint resumed, the one fine-tuned, or the seed."""
    if cfg.lora.rank > 0:
        return WeightSource(cfg.model.checkpoint, str(resume_from) if resume_from else None, cfg.train.seed)
    return WeightSource(str(resume_from) if resume_from is not None else cfg.model.checkpoint, None, cfg.train.seed)


def initial_model(cfg: Config, model_cfg: ModelConfig, resume_from: Path | None) -> CausalLM:
    """The whole model on the CPU: resumed, fine-tuned, or freshly initialised from the seed."""
    model = build_model(model_cfg, cfg.train.seed)
    source = weights_source(cfg, resume_from)
    if source.base is None and source.adapters is None:
        return model
    names = set(model.state_dict())
    load_into(model, source.load(model_cfg, names, set(range(len(model.units())))), source=str(source.base))
    return model


def adapters(cfg: Config) -> LoraSpec | None:
    """The run's LoRA adapters (``lora.rank`` > 0), or None for full fine-tuning."""
    lo = cfg.lora
    return LoraSpec(lo.rank, lo.alpha, lo.dropout, tuple(lo.targets), tuple(lo.train)) if lo.rank > 0 else None


def with_adapters(mc: ModelConfig, cfg: Config) -> ModelConfig:
    """The architecture with the run's adapters attached (checked against its layers)."""
    mc.lora = adapters(cfg)
    if mc.lora is not None:
        block_targets(mc, mc.lora)
    return mc
