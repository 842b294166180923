"""LoRA: low-rank adapters beside a model's linear layers, the rest of the weights frozen.

An adapted layer computes ``W x + b + B(A(dropout(x))) x alpha / rank`` (PEFT's LoRA): ``A`` is
``rank x in`` (initialised uniform in +-1/sqrt(in), as torch's Linear and PEFT do), ``B`` is
``out x rank`` (zero, so training starts from the checkpoint's function). :class:`LoRALinear` keeps
the base layer's own parameter names (``q_proj.weight``) so checkpoints load as they are, and adds
``q_proj.lora_A.weight`` / ``q_proj.lora_B.weight``. Targets are named as Hugging Face names the
layers (``q_proj``, ``c_attn``, ...; each family's config maps them to its modules) or
``all-linear`` (every linear layer of the blocks, as PEFT's). What trains besides the adapters:
``embeddings``, ``norms``, ``head`` (PEFT's ``modules_to_save``).

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
TRAINABLE_KINDS = ("embeddings", "norms", "head")


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
    """Module paths inside a block that get adapters (``all-linear``: every linear layer)."""
    names: dict[str, tuple[str, ...]] = cfg.LORA_TARGETS
    if spec.targets == ("all-linear",):
        return tuple(dict.fromkeys(m for mods in names.values() for m in mods))
    out: list[str] = []
    for t in spec.targets:
        if t not in names:
            raise ConfigError(f"lora.targets: {t!r} matches no layer of a {cfg.family} model (its layers: "
                              f"{', '.join(names)}, or all-linear)")
        out += names[t]
    return tuple(dict.fromkeys(out))


def adapt(unit: nn.Module, kind: str, cfg: object) -> nn.Module:
    """Put adapters into a block's target layers (in place); embeddings and heads keep none."""
    spec: LoraSpec = cfg.lora
    if kind != "block":
        return unit
    for path in block_targets(cfg, spec):
        parent, _, leaf = path.rpartition(".")
        owner = unit.get_submodule(parent) if parent else unit
        old = getattr(owner, leaf)
        new = LoRALinear(old.in_features, old.out_features, old.bias is not None, spec).to(old.weight.device)
        setattr(owner, leaf, new)
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
    tied = any(name in pair for pair in cfg.tied_weights())
    if name.startswith("embed."):
        return "embeddings" in spec.train or (tied and "head" in spec.train)
    if name.startswith("head."):
        return "head" in spec.train or (tied and "embeddings" in spec.train)
    return False


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
    assert not any(ADAPTER in k for k in weights), "an adapter without its pair"
    return weights


def init_adapters(unit: nn.Module, generator_seed: int) -> None:
    """Adapters of one unit from their own generator (the base weights' draws are unchanged): A uniform
    in +-1/sqrt(in) (PEFT's kaiming-uniform with a = sqrt(5)), B zero."""
    gen = torch.Generator().manual_seed(generator_seed)
    with torch.no_grad():
        for name, p in unit.named_parameters():
            if ".lora_A." in f".{name}":
                bound = 1.0 / math.sqrt(p.shape[1])
                p.copy_(torch.rand(p.shape, generator=gen) * 2 * bound - bound)
            elif ".lora_B." in f".{name}":
                p.zero_()
