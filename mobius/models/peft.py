"""LoRA adapters in PEFT's format: ``adapter_config.json`` and ``adapter_model.safetensors``.

``peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), directory)`` loads what
:func:`write_adapter` writes. Keys: an adapter of the module a Hugging Face checkpoint names
``model.layers.0.self_attn.q_proj`` is ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``
(``lora_A`` is ``rank x in``, ``lora_B`` ``out x rank``, whatever the base layer's storage: GPT-2's
Conv1D is PEFT's ``fan_in_fan_out``); a module trained whole (``lora.train``: PEFT's
``modules_to_save``) is saved under its Hugging Face name behind the same ``base_model.model.``
prefix. The module names come from each family's key map (:mod:`mobius.models.hf`), so nothing here
is per family.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mobius.errors import CheckpointError
from mobius.models import ModelConfig
from mobius.models.hf import KEY_MAPS, to_hf
from mobius.models.lora import ADAPTER, trains

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."


def _module_names(cfg: ModelConfig) -> dict[str, str]:
    """Our module path -> its Hugging Face path, for every layer whose weight the key map names."""
    return {r.ours[:-len(".weight")]: r.hf[:-len(".weight")] for r in KEY_MAPS[cfg.family](cfg).rules
            if r.ours.endswith(".weight") and isinstance(r.hf, str)}


def to_peft(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """What trains of a mobius state dict, under PEFT's keys (a tied head left to the embedding)."""
    modules = _module_names(cfg)
    out: dict[str, torch.Tensor] = {}
    whole = {}
    for name, t in state.items():
        if not trains(cfg, name):
            continue
        if ADAPTER in name:
            module, _, rest = name.partition(ADAPTER)  # "blocks.0.attn.qkv", "A.weight"
            out[f"{PREFIX}{modules[module]}.lora_{rest}"] = t
        else:
            whole[name] = t
    hf = to_hf(whole, cfg, partial=True)
    km = KEY_MAPS[cfg.family](cfg)
    if km.tied is not None and len(hf) > 1:
        hf.pop(km.tied[0], None)
    out.update({PREFIX + k: v for k, v in hf.items()})
    return out


def from_peft(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The inverse of :func:`to_peft`: mobius names (a tied head under its own name too)."""
    from mobius.models.hf import TRANSFORMS

    ours_of = {hf: ours for ours, hf in _module_names(cfg).items()}
    km = KEY_MAPS[cfg.family](cfg)
    rules = {r.hf: r for r in km.rules if isinstance(r.hf, str)}
    out: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        if not key.startswith(PREFIX):
            raise CheckpointError(f"adapter key {key!r} does not start with {PREFIX!r}")
        key = key[len(PREFIX):]
        module, lora, rest = key.partition(".lora_")
        if lora and module in ours_of:
            out[f"{ours_of[module]}{ADAPTER}{rest}"] = t
        elif not lora and key in rules:
            out[rules[key].ours] = TRANSFORMS[rules[key].transform][0](t)
        else:
            raise CheckpointError(f"adapter key {key!r} names no layer of this {cfg.family} model")
    if km.tied is not None and km.tied[1] in out:
        out["head.lm_head.weight"] = out[km.tied[1]]
    return out


def adapter_config(cfg: ModelConfig, base: str | None) -> dict:
    """PEFT's ``adapter_config.json`` for the run's adapters."""
    spec = cfg.lora
    names = cfg.LORA_TARGETS
    targets = sorted(names) if spec.targets == ("all-linear",) else sorted(spec.targets)
    saved = sorted({hf.rsplit(".", 1)[-1] for ours, hf in _module_names(cfg).items() if trains(cfg, ours + ".weight")})
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec.rank, "lora_alpha": spec.alpha,
            "lora_dropout": spec.dropout, "target_modules": targets, "bias": "none",
            "fan_in_fan_out": cfg.family == "gpt2", "modules_to_save": saved or None, "init_lora_weights": True,
            "use_rslora": False, "use_dora": False, "base_model_name_or_path": base, "inference_mode": True,
            "revision": None, "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {},
            "alpha_pattern": {}}


def write_adapter(directory: Path, cfg: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype,
                  base: str | None) -> None:
    """``adapter_config.json`` and ``adapter_model.safetensors`` (in ``dtype``) into ``directory``."""
    from safetensors.torch import save_file

    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in to_peft(state, cfg).items()}
    save_file(tensors, str(directory / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (directory / ADAPTER_CONFIG).write_text(json.dumps(adapter_config(cfg, base), indent=2) + "\n")


def read_adapter(directory: str | Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """What a LoRA checkpoint holds, by mobius name, in fp32."""
    from safetensors.torch import load_file

    file = Path(directory) / ADAPTER_WEIGHTS
    if not file.is_file():
        raise CheckpointError(f"{directory}: no {ADAPTER_WEIGHTS} (a LoRA run resumes from its own checkpoints)")
    try:
        tensors = load_file(str(file))
    except Exception as e:  # safetensors raises its own error types
        raise CheckpointError(f"{file}: cannot be read, the file is truncated or corrupt ({e})") from None
    return {k: v.float() for k, v in from_peft(tensors, cfg).items()}
