"""LoRA adapters in PEFT's format: ``adapter_config.json`` and ``adapter_model.safetensors``.

``peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), directory)`` loads what
:func:`write_adapter` writes. Keys: an adapter of the module a Hugging Face checkpoint names
``model.layers.0.self_attn.q_proj`` is ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``
(``lora_A`` is ``rank x in``, ``lora_B`` ``out x rank``, whatever the base layer's storage: GPT-2's
Conv1D is PEFT's ``fan_in_fan_out``); a module trained whole (``lora.train``: PEFT's
``modules_to_save``) is saved under its Hugging Face name behind the same ``base_model.model.``
prefix. The module names come from each family's key map (:mod:`mobius.models.hf`), so nothing here
is per family.

A mixture of experts' adapters are what PEFT (0.17 on, with transformers 5) writes for the fused experts of
transformers' model in memory (``target_parameters``, its ``ParamWrapper``): per adapted parameter of
``model.layers.{i}.mlp.experts``, ``lora_A.weight`` [E * r, in] (expert-major rows) and ``lora_B.weight``
[out, r * E] (rank-major columns); two adapted parameters of one module nest, the first defined
(``gate_up_proj``) inside: its keys have ``experts.base_layer.lora_A``, the outer one's ``experts.lora_A``.
``gate_proj`` and ``up_proj`` (Mixtral's ``w1`` and ``w3``) fused into ``gate_up_proj`` are said with a
``rank_pattern`` and ``alpha_pattern`` of twice the rank and alpha (PEFT's conversion of such targets).
:func:`read_adapter` also reads what PEFT wrote with transformers 4, an adapter per expert module
(``mlp.experts.{e}.gate_proj.lora_A.weight``, Mixtral's ``block_sparse_moe.experts.{e}.w1``), as PEFT converts it
on loading: the gate's and up's A stacked (rank 2r) and their B block-diagonal.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from mobius.errors import CheckpointError
from mobius.models import ModelConfig
from mobius.models.experts import PROJECTIONS
from mobius.models.hf import KEY_MAPS, to_hf
from mobius.models.lora import ADAPTER, rank_factor, block_targets, trains

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."
EXPERT_ADAPTER = f".adapters{ADAPTER}"  # "blocks.0.mlp.experts" + ".adapters.lora_" + "A.gate_up_proj"


PER_EXPERT = re.compile(r"^(model\.layers\.(\d+))\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)"
                        r"\.lora_([AB])\.weight$")


def _per_expert(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> tuple[dict[str, torch.Tensor],
                                                                               dict[str, torch.Tensor]]:
    """(mobius's fused expert adapters, the other tensors) of an adapter whose experts PEFT wrapped one module
    each (transformers 4): per layer, gate and up joined as PEFT joins them (A stacked, B block-diagonal)."""
    fused = getattr(cfg, "LORA_FUSED", {}).get("mlp.experts.gate_up_proj")
    if not fused:
        return {}, tensors
    down = next(t for t in cfg.LORA_TARGETS if cfg.LORA_TARGETS[t] == ("mlp.experts.down_proj",))
    found: dict[tuple[int, str, str], dict[int, torch.Tensor]] = {}
    rest = {}
    for key, t in tensors.items():
        m = PER_EXPERT.match(key.removeprefix(PREFIX))
        if m is None or m.group(4) not in (*fused, down):
            rest[key] = t
            continue
        found.setdefault((int(m.group(2)), m.group(4), m.group(5)), {})[int(m.group(3))] = t
    out: dict[str, torch.Tensor] = {}
    for layer in sorted({k[0] for k in found}):
        def each(proj: str, which: str, layer: int = layer) -> torch.Tensor:  # [E, ...]
            return torch.stack([found[(layer, proj, which)][e] for e in range(cfg.num_experts)])

        base = f"blocks.{layer}.mlp.experts{EXPERT_ADAPTER}"
        if (layer, fused[0], "A") in found:
            out[f"{base}A.gate_up_proj"] = torch.cat([each(p, "A") for p in fused], dim=1)  # [E, 2r, H]
            out[f"{base}B.gate_up_proj"] = torch.stack([torch.block_diag(*[found[(layer, p, "B")][e] for p in fused])
                                                        for e in range(cfg.num_experts)])  # [E, 2I, 2r]
        if (layer, down, "A") in found:
            out[f"{base}A.down_proj"], out[f"{base}B.down_proj"] = each(down, "A"), each(down, "B")
    return out, rest


def _module_names(cfg: ModelConfig) -> dict[str, str]:
    """Our module path -> its Hugging Face path (in transformers' model in memory, where that differs from the
    checkpoint's keys), for every layer whose weight the key map names, and an MoE's experts."""
    km = KEY_MAPS[cfg.family](cfg)
    names = {r.ours[:-len(".weight")]: r.hf[:-len(".weight")] for r in km.rules
             if r.ours.endswith(".weight") and isinstance(r.hf, str)}
    return {**names, **(km.modules or {})}


def _adapted_projections(cfg: ModelConfig) -> tuple[str, ...]:
    """The experts' parameters that carry adapters, in the order PEFT nests their wrappers (definition order)."""
    leaves = {p.rsplit(".", 1)[1] for p in block_targets(cfg, cfg.lora) if ".experts." in f".{p}"}
    return tuple(p for p in PROJECTIONS if p in leaves)


def _nesting(cfg: ModelConfig, proj: str) -> str:
    """``base_layer.`` once per adapted parameter wrapped after ``proj`` (PEFT's outer wrappers)."""
    adapted = _adapted_projections(cfg)
    return "base_layer." * (len(adapted) - 1 - adapted.index(proj))


def _expert_to_peft(t: torch.Tensor, which: str) -> torch.Tensor:
    """Ours [E, r, in] / [E, out, r] -> PEFT's lora_A [E * r, in] / lora_B [out, r * E]."""
    if which == "A":
        return t.reshape(-1, t.shape[-1])
    E, out, r = t.shape
    return t.permute(1, 2, 0).reshape(out, r * E)


def _expert_from_peft(t: torch.Tensor, which: str, experts: int) -> torch.Tensor:
    if which == "A":
        return t.reshape(experts, -1, t.shape[-1])
    out = t.shape[0]
    return t.reshape(out, -1, experts).permute(2, 0, 1).contiguous()


def to_peft(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """What trains of a mobius state dict, under PEFT's keys (a tied head left to the embedding)."""
    modules = _module_names(cfg)
    out: dict[str, torch.Tensor] = {}
    whole = {}
    for name, t in state.items():
        if not trains(cfg, name):
            continue
        if EXPERT_ADAPTER in name:
            module, rest = name.split(EXPERT_ADAPTER)  # "blocks.0.mlp.experts", "A.gate_up_proj"
            which, proj = rest.split(".")
            key = f"{PREFIX}{modules[module]}.{_nesting(cfg, proj)}lora_{which}.weight"
            out[key] = _expert_to_peft(t, which)
        elif ADAPTER in name:
            module, _, rest = name.partition(ADAPTER)  # "blocks.0.attn.qkv", "A.weight"
            out[f"{PREFIX}{modules[module]}.lora_{rest}"] = t
        elif name.rsplit(".", 1)[0] in (KEY_MAPS[cfg.family](cfg).modules or {}):  # a router trained whole
            module, leaf = name.rsplit(".", 1)
            out[f"{PREFIX}{modules[module]}.{leaf}"] = t
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

    km = KEY_MAPS[cfg.family](cfg)
    rules = {r.hf: r for r in km.rules if isinstance(r.hf, str)}
    ours_of = {r.hf[:-len(".weight")]: r.ours[:-len(".weight")] for r in rules.values() if r.ours.endswith(".weight")}
    ours_of.update({hf: ours for ours, hf in _module_names(cfg).items()})  # (an MoE's: transformers' own names too)
    adapted = _adapted_projections(cfg) if getattr(cfg, "moe_layers", ()) else ()
    out, tensors = _per_expert(tensors, cfg)
    for key, t in tensors.items():
        if not key.startswith(PREFIX):
            raise CheckpointError(f"adapter key {key!r} does not start with {PREFIX!r}")
        key = key[len(PREFIX):]
        module, lora, rest = key.partition(".lora_")
        depth = module.count(".base_layer")
        module = module.replace(".base_layer", "")
        if lora and module in ours_of and module.endswith(".experts") and depth < len(adapted):
            which, proj = rest.split(".")[0], adapted[len(adapted) - 1 - depth]
            out[f"{ours_of[module]}{EXPERT_ADAPTER}{which}.{proj}"] = _expert_from_peft(t, which, cfg.num_experts)
        elif lora and module in ours_of and not depth:
            out[f"{ours_of[module]}{ADAPTER}{rest}"] = t
        elif not lora and key in rules:
            out[rules[key].ours] = TRANSFORMS[rules[key].transform][0](t)
        elif not lora and key.rsplit(".", 1)[0] in ours_of:  # a module whose PEFT name is not its checkpoint's
            module, leaf = key.rsplit(".", 1)
            out[f"{ours_of[module]}.{leaf}"] = t
        else:
            raise CheckpointError(f"adapter key {key!r} names no layer of this {cfg.family} model (with these "
                                  f"lora.targets)")
    if km.tied is not None and km.tied[1] in out:
        out["head.lm_head.weight"] = out[km.tied[1]]
    return out


def _targets(cfg: ModelConfig) -> tuple[list[str], list[str], dict, dict]:
    """(target_modules, target_parameters, rank_pattern, alpha_pattern) of PEFT's config for the run's adapters."""
    spec, names = cfg.lora, cfg.LORA_TARGETS
    skips = getattr(cfg, "LORA_ALL_LINEAR_SKIPS", ())
    named = [t for t in names if t not in skips] if spec.targets == ("all-linear",) else list(spec.targets)
    routers = getattr(cfg, "ROUTERS", ())
    modules, params, ranks, alphas = set(), set(), {}, {}
    for t in named:
        for path in names[t]:
            leaf = path.rsplit(".", 1)[-1]
            if ".experts." in f".{path}":
                params.add(leaf)
                factor = rank_factor(cfg, spec, path)
                if factor > 1:
                    ranks[rf".*\.{leaf}"] = spec.rank * factor
                    alphas[rf".*\.{leaf}"] = spec.alpha * factor
            elif path in routers:
                params.add(f"{leaf}.weight")
            else:
                modules.add(t)
    return sorted(modules), sorted(params), ranks, alphas


def adapter_config(cfg: ModelConfig, base: str | None) -> dict:
    """PEFT's ``adapter_config.json`` for the run's adapters."""
    spec = cfg.lora
    targets, parameters, ranks, alphas = _targets(cfg)
    saved = sorted({hf.rsplit(".", 1)[-1] for ours, hf in _module_names(cfg).items() if trains(cfg, ours + ".weight")})
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec.rank, "lora_alpha": spec.alpha,
            "lora_dropout": spec.dropout, "target_modules": targets, "target_parameters": parameters or None,
            "bias": "none", "fan_in_fan_out": cfg.family == "gpt2", "modules_to_save": saved or None,
            "init_lora_weights": True, "use_rslora": False, "use_dora": False, "base_model_name_or_path": base,
            "inference_mode": True, "revision": None, "layers_to_transform": None, "layers_pattern": None,
            "rank_pattern": ranks, "alpha_pattern": alphas}


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
