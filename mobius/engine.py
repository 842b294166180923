"""Engines run one optimizer step over a list of micro-batches; the :class:`~mobius.trainer.Trainer`
loop around them (schedule, data, metrics, checkpoints) is shared by every parallel mode.

:class:`SingleEngine` is the reference: one CPU or one GPU, fp32 master weights, autocast for
bf16/fp16, dynamic loss scaling for fp16, global-norm clipping, torch AdamW. Every parallel engine
is tested against it.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Protocol

import torch

from mobius.checkpoint import Collective, RankState, ResumeState, SingleProcess
from mobius.config import Config
from mobius.models import dropout_active
from mobius.models.base import CausalLM, lm_loss, run_units
from mobius.optim import LossScaler, clip_coefficient, make_adamw, set_lr

Batch = tuple[torch.Tensor, torch.Tensor]  # (inputs [B, T], targets [B, T])
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class StepStats:
    loss: float  # mean loss over the step's micro-batches
    grad_norm: float  # global gradient norm before clipping (inf/nan on fp16 overflow)
    skipped: bool = False  # fp16 overflow: no update was made
    loss_scale: float = 1.0
    extra: dict | None = None  # engine-specific counters (bytes moved, stall time, ...)


class Engine(Protocol):
    """What every parallel mode implements; the :class:`~mobius.trainer.Trainer` drives it."""

    comm: Collective  # the ranks of the run (checkpoints are written through it)
    is_main: bool  # the process that logs and writes shared files

    def train_step(self, step: int, batches: list[Batch], lr: float) -> StepStats: ...
    def evaluate(self, batches: list[Batch]) -> float: ...
    def rank_state(self, with_moments: bool) -> RankState: ...  # finishes pending updates first
    def load_state(self, resume: ResumeState) -> None: ...  # optimizer moments by name, step, loss scale
    def sync(self) -> None: ...  # wait for every piece of work in flight (updates, copies, kernels)
    def close(self) -> None: ...


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[precision])


def global_norm(grads: list[torch.Tensor]) -> float:
    """L2 norm over all gradients (fp32 accumulation)."""
    if not grads:
        return 0.0
    norms = torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])
    return float(torch.linalg.vector_norm(norms))


class SingleEngine:
    """The reference engine: the whole model on one device."""

    is_main = True

    def __init__(self, model: CausalLM, cfg: Config, device: torch.device):
        self.model = model.to(device)
        self.cfg, self.device = cfg, device
        for p in self.model.parameters():  # a frozen weight (LoRA's base) is one copy in the training dtype
            if not p.requires_grad:
                p.data = p.data.to(DTYPES[cfg.train.precision])
        self.comm = SingleProcess()
        self.named = [(n, p) for n, p in dict((id(p), (n, p)) for n, p in model.named_parameters()).values()
                      if p.requires_grad]  # tied weights once; what trains (LoRA freezes the base weights)
        self.params = [p for _, p in self.named]
        self.optimizer = make_adamw(self.named, cfg.train, fused=device.type == "cuda")
        self.scaler = LossScaler(enabled=cfg.train.precision == "fp16")
        self.dropout = dropout_active(model.config)
        self.optimizer_step = 0

    def _forward_loss(self, x: torch.Tensor, y: torch.Tensor, seed: tuple[int, int, int] | None) -> torch.Tensor:
        with autocast(self.device, self.cfg.train.precision):
            logits = run_units(self.model.units(), x.to(self.device), dropout_seed=seed,
                               checkpoint_blocks=self.cfg.model.activation_checkpointing)  # [B, T, V]
            return lm_loss(logits, y.to(self.device))

    def train_step(self, step: int, batches: list[Batch], lr: float) -> StepStats:
        self.model.train()
        M = len(batches)
        factor = self.scaler.loss_factor()
        total = torch.zeros((), device=self.device)
        for m, (x, y) in enumerate(batches):
            seed = (self.cfg.train.seed, step, m) if self.dropout else None
            loss = self._forward_loss(x, y, seed)
            (loss * (factor / M)).backward()
            total += loss.detach()
        grads = [p.grad for p in self.params if p.grad is not None]
        if factor != 1.0:
            torch._foreach_mul_(grads, 1.0 / factor)
        norm = global_norm(grads)
        skipped = self.scaler.update(not math.isfinite(norm))
        if not skipped:
            coef = clip_coefficient(norm, self.cfg.train.grad_clip)
            if coef < 1.0:
                torch._foreach_mul_(grads, coef)
            set_lr(self.optimizer, lr)
            self.optimizer.step()
            self.optimizer_step += 1
        self.optimizer.zero_grad(set_to_none=True)
        return StepStats(float(total) / M, norm, skipped, self.scaler.scale if self.scaler.enabled else 1.0)

    @torch.no_grad()
    def evaluate(self, batches: list[Batch]) -> float:
        self.model.eval()
        losses = [float(self._forward_loss(x, y, None)) for x, y in batches]
        return sum(losses) / max(1, len(losses))

    def rank_state(self, with_moments: bool) -> RankState:
        weights = {k: v.detach().float().cpu() for k, v in self.model.state_dict().items()}
        moments = {}
        if with_moments:
            for name, p in self.named:
                st = self.optimizer.state.get(p)
                if st:
                    moments[name] = (st["exp_avg"].float().cpu(), st["exp_avg_sq"].float().cpu())
        return RankState(weights, moments, self.optimizer_step, self.scaler.state_dict())

    def load_state(self, resume: ResumeState) -> None:
        """AdamW moments by parameter name (from any mode's checkpoint), step count and loss scale."""
        moments = resume.moments([n for n, _ in self.named], self.model.config)
        self.optimizer_step = resume.optimizer_step
        self.scaler.load_state_dict(resume.scaler)
        if not moments:
            return
        index = {id(p): i for i, p in enumerate(p for g in self.optimizer.param_groups for p in g["params"])}
        state = {index[id(p)]: {"step": torch.tensor(float(self.optimizer_step)), "exp_avg": moments[n][0],
                                "exp_avg_sq": moments[n][1]} for n, p in self.named}
        self.optimizer.load_state_dict({"state": state, "param_groups": self.optimizer.state_dict()["param_groups"]})

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        pass
