"""Model families (GPT-2, OPT, and the Llama architecture: Llama, Mistral, Qwen2, Qwen3): configs,
presets, builders and unit descriptions."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from mobius.errors import ConfigError
from mobius.models import gpt2, llama, lora, opt
from mobius.models.base import CausalLM, UnitSpec, lm_loss

ModelConfig = gpt2.GPT2Config | opt.OPTConfig | llama.LlamaConfig


@dataclass(frozen=True)
class Family:
    name: str
    config_cls: type
    model_cls: type
    unit_specs: Callable[..., list[UnitSpec]]
    presets: dict


FAMILIES: dict[str, Family] = {  # by Hugging Face model_type; the Llama file serves four of them
    "gpt2": Family("gpt2", gpt2.GPT2Config, gpt2.GPT2, gpt2.unit_specs, gpt2.PRESETS),
    "opt": Family("opt", opt.OPTConfig, opt.OPT, opt.unit_specs, opt.PRESETS),
    **{t: Family(t, llama.LlamaConfig, llama.Llama, llama.unit_specs,
                 {k: v for k, v in llama.PRESETS.items() if v.model_type == t}) for t in llama.MODEL_TYPES},
}


def family_of(cfg: ModelConfig) -> Family:
    return FAMILIES[cfg.family]


class _NoMetaInit(TorchFunctionMode):
    """Random initialisation of meta tensors returns them untouched: there are no values to draw, and
    torch's meta ``normal_`` imports ``torch._dynamo`` (1.2-1.4 s of CPU in every worker process)."""

    INITS = (torch.Tensor.normal_, nn.init.normal_)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.INITS:
            tensor = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


@contextlib.contextmanager
def on_meta() -> Iterator[None]:
    """Build modules on the meta device (shapes only, no memory, no initialisation)."""
    with torch.device("meta"), _NoMetaInit():
        yield


def preset_names() -> list[str]:
    return [name for fam in FAMILIES.values() for name in fam.presets]


def get_preset(name: str) -> ModelConfig:
    """A fresh copy of a preset architecture, e.g. ``"gpt2-xl"`` or ``"opt-13b"``."""
    for fam in FAMILIES.values():
        if name in fam.presets:
            return copy.deepcopy(fam.presets[name])
    raise ConfigError(f"unknown model preset {name!r}; known presets: {', '.join(preset_names())}")


def build_model(cfg: ModelConfig, seed: int = 0) -> CausalLM:
    """Build a model for a config, initialised from ``seed`` (unit by unit, see ``init_weights``)."""
    return family_of(cfg).model_cls(cfg, seed)


def init_unit(cfg: ModelConfig, unit: nn.Module, index: int, seed: int) -> None:
    """Initialise one unit (built alone, e.g. from ``UnitSpec.build``) as ``build_model`` would."""
    family_of(cfg).model_cls.init_unit(cfg, unit, index, seed)


def unit_prefix(index: int, num_units: int) -> str:
    """State-dict prefix of unit ``index``: ``embed.``, ``blocks.{i}.`` or ``head.``."""
    if index == 0:
        return "embed."
    if index == num_units - 1:
        return "head."
    return f"blocks.{index - 1}."


def initial_weights(cfg: ModelConfig, units: set[int], seed: int) -> dict[str, torch.Tensor]:
    """Freshly initialised weights of ``units`` by name, each unit built alone and initialised as the
    whole model would (a pipeline stage or a zero rank never builds the model); a tied head weight
    is the embedding's, so the embedding is initialised for it too."""
    specs = unit_specs(cfg)
    last = len(specs) - 1
    tied = tied_weights(cfg)
    todo = set(units) | ({0} if tied and last in units else set())
    out: dict = {}
    for k in sorted(todo):
        unit = specs[k].build()
        init_unit(cfg, unit, k, seed)
        out.update({unit_prefix(k, len(specs)) + n: p.detach() for n, p in unit.named_parameters()})
    for embed, head in tied:
        if embed in out:
            out[head] = out[embed]
    return out


def tied_weights(cfg: ModelConfig) -> list[tuple[str, str]]:
    """Tied parameter pairs (embedding name, head name) of a config, without building the model."""
    return cfg.tied_weights()


def dropout_active(cfg: ModelConfig) -> bool:
    """True when any dropout probability of the config is non-zero, the adapters' included (the one
    place that says so)."""
    return cfg.dropout_active() or (cfg.lora is not None and cfg.lora.dropout > 0)


def hidden_size(cfg: ModelConfig) -> int:
    """Width of the activations that cross stage boundaries."""
    return cfg.width


def unit_specs(cfg: ModelConfig) -> list[UnitSpec]:
    """Describe the model's units (embed, blocks, head) without building them (adapted, with their
    frozen parameters counted, under ``cfg.lora``)."""
    specs = family_of(cfg).unit_specs(cfg)
    if cfg.lora is None:
        return specs
    counted: dict[str, tuple[int, int]] = {}
    out = []
    for k, s in enumerate(specs):
        build = _adapted_build(s, cfg, unit_prefix(k, len(specs)))
        if s.signature not in counted:  # every block alike: build one (on the meta device) to count
            with on_meta():
                params = list(build().parameters())
            frozen = sum(p.numel() for p in params if not p.requires_grad)  # (the build froze them)
            counted[s.signature] = (sum(p.numel() for p in params), frozen)
        total, frozen = counted[s.signature]
        out.append(dataclasses.replace(s, build=build, param_count=total, frozen_count=frozen,
                                       signature=f"{s.signature}:{_lora_tag(cfg.lora)}"))
    return out


def _adapted_build(spec: UnitSpec, cfg: ModelConfig, prefix: str) -> Callable[[], nn.Module]:
    """The unit with its adapters, its frozen parameters not requiring gradients (so a profile times
    the backward the run does: input gradients only through frozen weights)."""
    def build() -> nn.Module:
        unit = lora.adapt(spec.build(), spec.kind, cfg)
        for name, p in unit.named_parameters():
            p.requires_grad_(lora.trains(cfg, prefix + name))
        return unit
    return build


def _lora_tag(spec: "lora.LoraSpec") -> str:
    return f"lora{spec.rank}:{'+'.join(spec.targets)}:{'+'.join(spec.train)}"


def tied_param_count(cfg: ModelConfig) -> int:
    """Parameters of the weight the embedding and the head share (0 when untied)."""
    if not cfg.tie_word_embeddings:
        return 0
    return cfg.vocab_size * cfg.embedding_dim


def param_count(cfg: ModelConfig) -> int:
    """Parameters of the model, counting a tied embedding once."""
    return sum(s.param_count for s in unit_specs(cfg)) - tied_param_count(cfg)


__all__ = ["CausalLM", "UnitSpec", "lm_loss", "ModelConfig", "FAMILIES", "family_of", "get_preset",
           "preset_names", "build_model", "init_unit", "initial_weights", "unit_prefix", "tied_weights", "hidden_size",
           "dropout_active", "unit_specs", "param_count",
           "tied_param_count"]
