"""LoRA: low-rank adapters beside a model's linear layers, the rest of the weights frozen.

An adapted layer computes ``W x + b + B(A(dropout(x))) x alpha / rank`` (PEFT's LoRA): ``A`` is
``rank x in`` (initialised uniform in +-1/sqrt(in), as torch's Linear and PEFT do), ``B`` is
``out x rank`` (zero, so training starts from the checkpoint's function). :class:`LoRALinear` keeps
the base layer's own parameter names (``q_proj.weight``) so checkpoints load as they are, and adds
``q_proj.lora_A.weight`` / ``q_proj.lora_B.weight``. Targets are named as Hugging Face names the
layers (``q_proj``, ``c_attn``, ...; each family's config maps them to its modules) or
``all-linear`` (every linear layer of the blocks, as PEFT's). What trains besides the adapters:
``embeddings``, ``norms``, ``head``, an MoE's ``router`` (PEFT's ``modules_to_save``).

Mixture-of-experts models (:mod:`mobius.models.experts`): a target naming an expert projection adapts every
expert's (PEFT's ``target_parameters`` on the fused parameter: a rank-r adapter per expert,
:class:`~mobius.models.experts.ExpertAdapters`); the Hugging Face names that one fused parameter joins (Qwen3-MoE's
``gate_proj`` and ``up_proj``, Mixtral's ``w1`` and ``w3``) are named together and give it rank and alpha times
their count, as PEFT converts them for transformers 5; the router (``gate``) takes an adapter like a linear layer.
PEFT's wrapper of parameters has no dropout: adapters there take ``lora.dropout`` 0.

A model config carries its :class:`LoraSpec` (``cfg.lora``); :func:`mobius.models.unit_specs` and
:func:`mobius.models.build_model` then give adapted units, and :func:`trains` says which parameter
names train -- the one rule the engines, the layouts and the planner read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mobius.errors import ConfigError

ADAPTER = ".lora_"  # in the name of every adapter parameter
TRAINABLE_KINDS = ("embeddings", "norms", "head", "router")


@dataclass(frozen=True)
class LoraSpec:
    """The adapters of a run (``lora.*`` of the config)."""

    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] = ("all-linear",)
    train: tuple[str, ...] = ()  # any of TRAINABLE_KINDS

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


class LoRALinear(nn.Linear):
    """A frozen linear layer and its trainable rank-``r`` adapter. x [..., in] -> [..., out]."""

    def __init__(self, in_features: int, out_features: int, bias: bool, spec: LoraSpec):
        super().__init__(in_features, out_features, bias=bias)
        self.lora_A = nn.Linear(in_features, spec.rank, bias=False)
        self.lora_B = nn.Linear(spec.rank, out_features, bias=False)
        self.scaling = spec.scaling
        self.lora_dropout = nn.Dropout(spec.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling


def block_targets(cfg: object, spec: LoraSpec) -> tuple[str, ...]:
    """Module (or, for an MoE's experts, parameter) paths inside a block that get adapters (``all-linear``:
    every linear layer, as PEFT resolves it)."""
    names: dict[str, tuple[str, ...]] = cfg.LORA_TARGETS
    if spec.targets == ("all-linear",):
        skips = getattr(cfg, "LORA_ALL_LINEAR_SKIPS", ())
        return tuple(dict.fromkeys(m for t, mods in names.items() if t not in skips for m in mods))
    out: list[str] = []
    for t in spec.targets:
        if t not in names:
            raise ConfigError(f"lora.targets: {t!r} matches no layer of a {cfg.family} model (its layers: "
                              f"{', '.join(names)}, or all-linear)")
        out += names[t]
    for path, joined in _fused(cfg).items():
        named = [t for t in joined if t in spec.targets]
        if named and len(named) < len(joined):
            raise ConfigError(f"lora.targets: {', '.join(joined)} are one fused parameter of a {cfg.family} model's "
                              f"experts ({path}; PEFT adapts them together): name {' and '.join(joined)}, or neither")
    return tuple(dict.fromkeys(out))


def _fused(cfg: object) -> dict[str, tuple[str, ...]]:
    return getattr(cfg, "LORA_FUSED", {})


def rank_factor(cfg: object, spec: LoraSpec, path: str) -> int:
    """How many Hugging Face names a fused parameter's adapter stands for (its rank and alpha are times that):
    those it joins when they (or all-linear) target it, else 1."""
    joined = _fused(cfg).get(path, ())
    if joined and (spec.targets == ("all-linear",) or all(t in spec.targets for t in joined)):
        return len(joined)
    return 1


def expert_targets(cfg: object, spec: LoraSpec) -> tuple[str, ...]:
    """The targets' paths that are parameters of an MoE's experts (``mlp.experts.gate_up_proj``)."""
    return tuple(p for p in block_targets(cfg, spec) if ".experts." in f".{p}")


def check_targets(cfg: object, spec: LoraSpec) -> None:
    """Refuse adapters PEFT could not load: dropout on an MoE's experts or router (PEFT's ``ParamWrapper``
    adapts them, without dropout)."""
    wrapped = [p for p in block_targets(cfg, spec) if ".experts." in f".{p}" or p in getattr(cfg, "ROUTERS", ())]
    if wrapped and spec.dropout:
        raise ConfigError(f"lora.dropout is {spec.dropout:g}, but lora.targets reach {', '.join(wrapped)}, whose "
                          f"adapters (PEFT's target_parameters) have no dropout: set lora.dropout to 0, or target "
                          f"other layers")


def adapt(unit: nn.Module, kind: str, cfg: object) -> nn.Module:
    """Put adapters into a block's target layers (in place); embeddings and heads keep none. A path a block
    lacks (an MoE's dense layer has no experts) is skipped."""
    from mobius.models.experts import ExpertAdapters, Experts

    spec: LoraSpec = cfg.lora
    if kind != "block":
        return unit
    experts: dict[str, dict[str, int]] = {}
    for path in block_targets(cfg, spec):
        parent, _, leaf = path.rpartition(".")
        try:
            owner = unit.get_submodule(parent) if parent else unit
        except AttributeError:
            continue
        if isinstance(owner, Experts):
            experts.setdefault(parent, {})[leaf] = spec.rank * rank_factor(cfg, spec, path)
            continue
        if not hasattr(owner, leaf):
            continue
        old = getattr(owner, leaf)
        new = LoRALinear(old.in_features, old.out_features, old.bias is not None, spec).to(old.weight.device)
        setattr(owner, leaf, new)
    for parent, ranks in experts.items():
        owner = unit.get_submodule(parent)
        device = owner.gate_up_proj.device
        owner.adapters = ExpertAdapters(owner.shape, ranks, {p: spec.scaling for p in ranks}).to(device)
    return unit


def trains(cfg: object, name: str) -> bool:
    """Whether parameter ``name`` (``unit_prefix + local name``) trains under ``cfg.lora``: the adapters,
    and the embeddings, norms or head ``lora.train`` names; every parameter without LoRA. A weight
    tied between the embedding and the head trains when either end is named."""
    spec: LoraSpec | None = getattr(cfg, "lora", None)
    if spec is None or ADAPTER in name:
        return True
    if _is_norm(name.rsplit(".", 1)[0]):
        return "norms" in spec.train
    if _is_router(cfg, name):
        return "router" in spec.train
    tied = any(name in pair for pair in cfg.tied_weights())
    if name.startswith("embed."):
        return "embeddings" in spec.train or (tied and "head" in spec.train)
    if name.startswith("head."):
        return "head" in spec.train or (tied and "embeddings" in spec.train)
    return False


def _is_router(cfg: object, name: str) -> bool:
    """Whether ``name`` (``blocks.{i}.`` + local name) is a weight of an MoE's router."""
    routers = getattr(cfg, "ROUTERS", ())
    return name.startswith("blocks.") and name.split(".", 2)[2].rsplit(".", 1)[0] in routers


def _is_norm(module_path: str) -> bool:
    leaf = module_path.rsplit(".", 1)[-1]
    return "norm" in leaf or leaf.startswith("ln")


def merge(weights: dict[str, torch.Tensor], cfg: object, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``weights`` with every adapter folded into its layer (``W + B A alpha / rank`` in fp32, then ``dtype``) and
    the adapters gone, in place: a plain checkpoint of the fine-tuned model. ``weights`` holds whole layers with
    their adapters (each rank's share of a run does); a layer's input leaves it as its merged copy comes in, so
    the merge adds one layer to what the weights take, not a second model."""
    spec: LoraSpec = cfg.lora
    layers = [name[:-len(f"{ADAPTER}A.weight")] for name in weights if name.endswith(f"{ADAPTER}A.weight")]
    for layer in layers:
        a, b = weights.pop(f"{layer}{ADAPTER}A.weight"), weights.pop(f"{layer}{ADAPTER}B.weight")
        w = weights.pop(f"{layer}.weight")
        weights[f"{layer}.weight"] = (w.float() + spec.scaling * (b.float() @ a.float())).to(dtype)  # [out, in]
        del w
    _merge_experts(weights, cfg, dtype)
    assert not any(ADAPTER in k for k in weights), "an adapter without its pair"
    return weights


def _merge_experts(weights: dict[str, torch.Tensor], cfg: object, dtype: torch.dtype) -> None:
    """Each expert's adapter into its fused parameter: W_e + B_e A_e alpha / rank ([E, out, in], or [E, in, out]
    where the experts store their weights transposed)."""
    spec: LoraSpec = cfg.lora
    marker = f".adapters{ADAPTER}A."
    for name in [n for n in weights if marker in n]:
        experts, proj = name.split(marker)
        a, b = weights.pop(name), weights.pop(f"{experts}.adapters{ADAPTER}B.{proj}")
        w = weights.pop(f"{experts}.{proj}")
        delta = spec.scaling * torch.bmm(b.float(), a.float())  # [E, out, in]
        if cfg.expert_shape.transposed:  # stored [E, in, out]
            delta = delta.transpose(1, 2)
        weights[f"{experts}.{proj}"] = (w.float() + delta).to(dtype)


def init_adapters(unit: nn.Module, generator_seed: int) -> None:
    """Adapters of one unit from their own generator (the base weights' draws are unchanged): A uniform
    in +-1/sqrt(in) (PEFT's kaiming-uniform with a = sqrt(5)), B zero."""
    gen = torch.Generator().manual_seed(generator_seed)
    with torch.no_grad():
        for name, p in unit.named_parameters():
            if ".lora_A." in f".{name}":
                bound = 1.0 / math.sqrt(p.shape[-1])  # (an MoE's experts' A: [E, r, in])
                p.copy_(torch.rand(p.shape, generator=gen) * 2 * bound - bound)
            elif ".lora_B." in f".{name}":
                p.zero_()
