"""Learning-rate schedule, AdamW parameter groups and dynamic loss scaling, shared by every engine."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from mobius.config import TrainSection


def lr_at(step: int, cfg: TrainSection) -> float:
    """Linear warm-up to ``lr`` over ``warmup_steps``, then cosine decay to ``lr * min_lr_ratio``.
    ``step`` counts from 0 (the first optimizer step)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + 0.5 * (cfg.lr - floor) * (1.0 + math.cos(math.pi * progress))


def takes_decay(param: torch.Tensor) -> bool:
    """Weight decay applies to matrices (and embeddings), not to biases and norms."""
    return param.dim() >= 2


def adamw(decay: list[nn.Parameter], no_decay: list[nn.Parameter], cfg: TrainSection,
          fused: bool = False) -> torch.optim.AdamW:
    """AdamW with ``train.weight_decay`` on ``decay`` and none on ``no_decay`` (empty groups dropped)."""
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    kwargs = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    if fused:
        kwargs["fused"] = True
    return torch.optim.AdamW([g for g in groups if g["params"]], **kwargs)


def make_adamw(named: list[tuple[str, nn.Parameter]], cfg: TrainSection, fused: bool = False) -> torch.optim.AdamW:
    """AdamW over named parameters, grouped by :func:`takes_decay`."""
    return adamw([p for _, p in named if takes_decay(p)], [p for _, p in named if not takes_decay(p)], cfg, fused)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for g in optimizer.param_groups:
        g["lr"] = lr


@dataclass
class LossScaler:
    """Dynamic loss scaling for fp16: halve on overflow (and skip the step), double after
    ``growth_interval`` clean steps. Disabled (scale 1) for fp32 and bf16."""

    enabled: bool
    scale: float = 2.0**16
    growth_interval: int = 2000
    clean_steps: int = field(default=0)

    def loss_factor(self) -> float:
        return self.scale if self.enabled else 1.0

    def update(self, found_inf: bool) -> bool:
        """Record one step's outcome; returns True when the step must be skipped."""
        if not self.enabled:
            return False
        if found_inf:
            self.scale = max(self.scale / 2.0, 1.0)
            self.clean_steps = 0
            return True
        self.clean_steps += 1
        if self.clean_steps % self.growth_interval == 0:
            self.scale *= 2.0
        return False

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.clean_steps = state["scale"], state["clean_steps"]


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """Factor that scales gradients to ``max_norm`` (1.0 when clipping is off or not needed),
    computed exactly as ``torch.nn.utils.clip_grad_norm_`` does."""
    if max_norm <= 0 or not math.isfinite(total_norm):
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))
