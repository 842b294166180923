"""The parts of a training run from a :class:`~mobius.config.Config`: the checkpoint to resume
from, the tokenizer and data, the architecture, and the initial weights; and the checks that come
before any work (the inputs, the weights' shapes against their config, what a resume continues).
Used by every mode (the single-process run and each worker process)."""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from mobius.checkpoint import ResumeState
from mobius.config import PLACEHOLDER, Config
from mobius.engine import DTYPES
from mobius.data import BUILTINS, TextTokenizer, TrainData, data_format, load_data, load_tokenizer, source_files
from mobius.errors import CheckpointError, ConfigError
from mobius.models import CausalLM, ModelConfig, build_model, get_preset, initial_weights
from mobius.models.hf import KEY_MAPS, TRANSFORMS, LazyCheckpoint, _normalise_key, from_hf, read_config
from mobius.models.params import model_params
from mobius.models.lora import ADAPTER, LoraSpec, check_targets, expert_targets
from mobius.models.peft import read_adapter
from mobius.trainer import step_checkpoints

log = logging.getLogger(__name__)


def check_inputs(cfg: Config) -> None:
    """Every file the config names exists and is what it should be, before any work starts: the
    checkpoint's config.json, and its weights' shapes against it (from the files' headers)."""
    ck = cfg.model.checkpoint
    if ck:
        path = Path(ck)
        if not path.is_dir():
            raise CheckpointError(f"model.checkpoint {ck}: no such directory")
        check_weight_shapes(path, read_config(path))  # config.json of a supported family; weights readable
    if cfg.data.path not in BUILTINS:
        source_files(cfg.data.path)
    tok = cfg.data.tokenizer
    if tok and not Path(tok).exists():
        raise ConfigError(f"data.tokenizer {tok}: no such file or directory")
    out = Path(cfg.output.dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output.dir {out} is a file, not a directory")


def check_weight_shapes(path: Path, mc: ModelConfig) -> None:
    """Every weight of the Hugging Face checkpoint at ``path`` has the shape its config ``mc`` gives it
    (read from the files' headers: nothing is loaded)."""
    base = dataclasses.replace(mc, lora=None) if getattr(mc, "lora", None) is not None else mc
    expected = {name: p.shape for p in model_params(base) for name in p.names}
    km = KEY_MAPS[base.family](base)
    lazy = LazyCheckpoint(path)
    present = {_normalise_key(k, km): k for k in lazy}
    for rule in km.rules:
        if any(key not in present for key in rule.keys) or rule.ours not in expected:
            continue  # a missing key is named when the weights load
        pieces = TRANSFORMS[rule.transform][1](torch.empty(expected[rule.ours], device="meta"))  # the hf shapes
        for key, piece in zip(rule.keys, [pieces] if isinstance(rule.hf, str) else pieces, strict=True):
            want, got = tuple(piece.shape), tuple(lazy.shape(present[key]))
            if got != want:
                vocab = f" (config.json's vocab_size is {base.vocab_size})" if base.vocab_size in want else ""
                raise CheckpointError(f"{path}: weight {present[key]} has shape {got}, but config.json describes "
                                      f"{want}{vocab}; the checkpoint's weights and config disagree")


def resume_dir(cfg: Config, resume: str | None) -> Path | None:
    """The checkpoint ``--resume`` names (``auto``: the latest step checkpoint in ``output.dir``)."""
    out = Path(cfg.output.dir)
    if resume is None:
        return None
    if resume == "auto":
        found = step_checkpoints(out)
        if not found:
            raise ConfigError(f"--resume: no step checkpoint under {out / 'checkpoints'} (output.save_every=N writes "
                              f"them; a run stopped before its first one starts again with --overwrite)")
        return found[-1]
    path = Path(resume)
    if not (path / "config.json").is_file():
        raise ConfigError(f"--resume {path}: not a checkpoint directory")
    return path


def run_tokenizer(cfg: Config) -> TextTokenizer:
    """The tokenizer the config gives: ``data.tokenizer``, else the checkpoint's own, else byte-level
    (a resumed run checks it against the one its checkpoint trained with: :func:`check_resume`)."""
    return load_tokenizer(cfg.data.tokenizer, cfg.model.checkpoint or None)


@dataclass
class Prepared:
    """A run checked and ready to start: its data, architecture and (resuming) trainer state."""

    tokenizer: TextTokenizer
    data: TrainData
    model_cfg: ModelConfig
    ck_dtype: torch.dtype | None  # the dtype of the checkpoint fine-tuned (None: from scratch)
    resume_from: Path | None
    resume: ResumeState | None  # what resuming continues (read from ``resume_from``)


def prepare_data(cfg: Config) -> tuple[TextTokenizer, TrainData]:
    """The run's tokenizer (with the chat template conversations are rendered with) and its packed, split,
    cached data (with its fingerprint)."""
    tokenizer, data = load_data(cfg.data, run_tokenizer(cfg), cfg.train.seed)
    log.debug("data: %s tokens, %d training blocks of %d, %d held out", f"{data.stats.tokens:,}", len(data.train),
              cfg.data.seq_len, len(data.val))
    return tokenizer, data


def document_tokens(data: TrainData) -> int | None:
    """Positions per document in the data's rows when they are packed conversations (a conversation of L tokens
    takes L - 1), on average; None for text and for one conversation per row."""
    s = data.stats
    if s is None or s.format != "chat" or not s.packing or not s.conversations:
        return None
    return max(1, round(s.tokens / s.conversations) - 1)


def with_document_tokens(cfg: Config, data: TrainData) -> Config:
    """``cfg`` with ``partition.document_tokens`` taken from ``data`` when the config leaves it null: the plan
    then profiles attention within documents of that length (:mod:`mobius.models.packing`)."""
    if cfg.partition.document_tokens is not None:
        return cfg
    doc = document_tokens(data)
    if doc is None:
        return cfg
    return dataclasses.replace(cfg, partition=dataclasses.replace(cfg.partition, document_tokens=doc))


def planned_document_tokens(cfg: Config) -> Config:
    """For ``mobius plan``: ``cfg`` with the documents' length of data that is packed conversations and at hand
    (prepared as ``mobius train`` prepares it: from its cache, or tokenized now), so that the plan shown is the
    plan run; data not at hand (a path still to fill in, or missing) leaves one sequence per row."""
    path = cfg.data.path
    if cfg.partition.document_tokens is not None or not cfg.data.packing or PLACEHOLDER in path:
        return cfg
    if path not in BUILTINS and not Path(path).exists():
        return cfg
    if data_format(path, cfg.data.format, cfg.data.text_field) != "chat":
        return cfg
    return with_document_tokens(cfg, prepare_data(cfg)[1])


def check_resume(cfg: Config, resume_from: Path, tokenizer: TextTokenizer, data: TrainData,
                 lora: LoraSpec | None) -> ResumeState:
    """What ``--resume`` continues is what the config trains: the architecture (every field that shapes
    the weights), the tokenizer and the data's content (unless ``data.accept_new_data``); the trainer
    state readable and well-formed. Checked before any work; a mismatch names what changed."""
    state = ResumeState(resume_from)
    saved = read_config(resume_from)
    if lora is None:  # a LoRA checkpoint holds adapters, read (and checked) by name
        check_weight_shapes(resume_from, saved)
    _check_same_architecture(saved, _fresh_model_config(cfg, tokenizer), resume_from, cfg)
    _check_same_adapters(lora, state.trainer.get("config"), resume_from)
    trained_with = state.trainer.get("tokenizer")
    if trained_with is not None and trained_with != tokenizer.name:
        raise CheckpointError(f"--resume {resume_from}: the checkpoint trained with another tokenizer than "
                              f"{_tokenizer_source(cfg)} gives ({trained_with} then, {tokenizer.name} now); resume "
                              f"with the tokenizer it trained with")
    _check_same_data(cfg, state.trainer["data"], data, resume_from)
    saved_states, states = state.states, cfg.train.optimizer_states
    if saved_states is not None and saved_states != states:
        log.info("train.optimizer_states=%s: the checkpoint's AdamW moments are %s; converted as they load (%s)",
                 states, saved_states, "exactly" if states == "fp32" else f"rounded once to {states}")
    return state


def _check_same_architecture(saved: ModelConfig, fresh: ModelConfig, where: Path, cfg: Config) -> None:
    """The checkpoint's architecture against the config's: the family, the named fields, then every
    parameter's shape."""
    source = f"model.checkpoint {cfg.model.checkpoint}" if cfg.model.checkpoint else f"model.preset {cfg.model.preset}"
    fields = ("family", "vocab_size", *saved.FIELDS.values(), *getattr(saved, "ARCH_FIELDS", ()))
    for key in dict.fromkeys(fields):
        a, b = getattr(saved, key, None), getattr(fresh, key, None)
        if a != b:
            raise CheckpointError(f"--resume {where}: the checkpoint's {key} is {a}, but the config ({source}) builds "
                                  f"{b}; resume with the model the checkpoint trained")
    mine = {n: p.shape for p in model_params(saved) for n in p.names}
    theirs = {n: p.shape for p in model_params(fresh) for n in p.names}
    for name in sorted(set(mine) | set(theirs)):
        if mine.get(name) != theirs.get(name):
            raise CheckpointError(f"--resume {where}: the checkpoint's weight {name} has shape {mine.get(name)}, but "
                                  f"the config ({source}) builds {theirs.get(name)}; resume with the model the "
                                  f"checkpoint trained")


def _check_same_adapters(lora: LoraSpec | None, trained: object, where: Path) -> None:
    """The LoRA settings that shape what trains, against the checkpoint's run config."""
    then = trained.get("lora") if isinstance(trained, dict) else None
    if not isinstance(then, dict):
        return
    now = {"rank": lora.rank, "targets": list(lora.targets), "train": list(lora.train)} if lora else {"rank": 0}
    for key, value in now.items():
        if key in then and then[key] != value:
            raise CheckpointError(f"--resume {where}: lora.{key} is {value!r}, but the checkpoint trained with "
                                  f"{then[key]!r}; resume with the adapters it trained")


def _check_same_data(cfg: Config, saved: dict, data: TrainData, where: Path) -> None:
    then = saved.get("fingerprint")
    if then is not None and then != data.fingerprint:
        change = (f"the content of data.path {cfg.data.path} differs from what it trained on (or, for conversations, "
                  f"the chat template, data.train_on, data.packing or data.truncation; fingerprint "
                  f"{data.fingerprint[:12]} now, {then[:12]} then)")
    elif saved["train_blocks"] != len(data.train):
        change = (f"data.path {cfg.data.path} gives {len(data.train)} training blocks of data.seq_len="
                  f"{cfg.data.seq_len} now, {saved['train_blocks']} then (data.seq_len or data.val_fraction changed)")
    else:
        return
    if not cfg.data.accept_new_data:
        raise CheckpointError(f"--resume {where}: the data changed since the checkpoint: {change}; set "
                              f"data.accept_new_data=true to continue on it from its start, or resume on the data "
                              f"it trained on")
    log.warning("data.accept_new_data: %s; the resumed run reads it from its start", change)


def _tokenizer_source(cfg: Config) -> str:
    if cfg.data.tokenizer:
        return f"data.tokenizer {cfg.data.tokenizer}"
    return f"model.checkpoint {cfg.model.checkpoint}" if cfg.model.checkpoint else "byte-level tokens (from scratch)"


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
    return run_model_config(cfg, run_tokenizer(cfg), None)[0]


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
    _set_aux_coef(mc, cfg)
    return mc


def _set_aux_coef(mc: ModelConfig, cfg: Config) -> None:
    """``model.router_aux_loss_coef`` into an MoE architecture (a dense one has no router to balance)."""
    coef = cfg.model.router_aux_loss_coef
    if coef is None:
        return
    if not getattr(mc, "moe_layers", ()):
        raise ConfigError(f"{cfg.source}: model.router_aux_loss_coef is set, but a {mc.family} model has no "
                          f"experts to balance; remove it")
    mc.router_aux_loss_coef = coef


def run_model_config(cfg: Config, tokenizer: TextTokenizer,
                     resume_from: Path | None) -> tuple[ModelConfig, torch.dtype | None]:
    """The architecture being trained, and the dtype of the checkpoint fine-tuned (if any)."""
    if resume_from is not None:
        mc = read_config(resume_from)
        if cfg.model.dropout is not None:
            mc.set_dropout(cfg.model.dropout)
        _set_aux_coef(mc, cfg)
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
        """The tensors of ``names`` (the parameters of ``units``), by mobius name: what the checkpoints
        hold (:meth:`read`), and only the rest drawn from the seed (:func:`initial_weights`)."""
        out = self.read(cfg, names)
        rest = names - set(out)
        if rest:
            out.update(initial_weights(cfg, units, self.seed, rest))
        return out

    def read(self, cfg: ModelConfig, names: set[str] | None = None) -> dict[str, torch.Tensor]:
        """The tensors of ``names`` (None: all) that the checkpoints hold, by mobius name: the resumed
        LoRA checkpoint's, then the base checkpoint's (never an adapter)."""
        def asked(name: str) -> bool:
            return names is None or name in names

        out: dict[str, torch.Tensor] = {}
        if self.adapters is not None:
            out.update({k: v for k, v in read_adapter(self.adapters, cfg).items() if asked(k)})
        if self.base is not None and (names is None or any(ADAPTER not in n for n in names - set(out))):
            out.update(from_hf(LazyCheckpoint(self.base), cfg,
                               only=lambda k: asked(k) and k not in out and ADAPTER not in k))
        return out


def weights_source(cfg: Config, model_cfg: ModelConfig, resume_from: Path | None) -> WeightSource:
    """Where the initial weights come from: the checkpoint resumed, the one fine-tuned, or the seed."""
    if model_cfg.lora is not None:
        return WeightSource(cfg.model.checkpoint, str(resume_from) if resume_from else None, cfg.train.seed)
    return WeightSource(str(resume_from) if resume_from is not None else cfg.model.checkpoint, None, cfg.train.seed)


def initial_model(cfg: Config, model_cfg: ModelConfig, resume_from: Path | None,
                  device: torch.device | str = "cpu") -> CausalLM:
    """The whole model on ``device``, its frozen weights (LoRA's base) in the training dtype: resumed,
    fine-tuned, or freshly initialised from the seed, each weight set once where it lives
    (:func:`~mobius.models.build_model`): copied from the checkpoints where they hold it, one unit at
    a time, drawn from the seed otherwise (from scratch; a LoRA run's adapters at its start)."""
    source = weights_source(cfg, model_cfg, resume_from)
    return build_model(model_cfg, cfg.train.seed, source=str(source.base),
                       read=lambda names: source.read(model_cfg, names), device=device,
                       frozen_dtype=DTYPES[cfg.train.precision])


def adapters(cfg: Config) -> LoraSpec | None:
    """The run's LoRA adapters (``lora.rank`` > 0), or None for full fine-tuning."""
    lo = cfg.lora
    return LoraSpec(lo.rank, lo.alpha, lo.dropout, tuple(lo.targets), tuple(lo.train)) if lo.rank > 0 else None


def with_adapters(mc: ModelConfig, cfg: Config) -> ModelConfig:
    """The architecture with the run's adapters attached (checked against its layers)."""
    mc.lora = adapters(cfg)
    if mc.lora is not None:
        check_targets(mc, mc.lora)
        if getattr(mc, "moe_layers", ()) and not expert_targets(mc, mc.lora):
            log.warning("lora.targets %s reach no expert of this %s model: its experts stay frozen and only the "
                        "other layers train; name the experts' projections (mobius train --help, lora.targets) to "
                        "adapt them", ", ".join(mc.lora.targets), mc.family)
    return mc
