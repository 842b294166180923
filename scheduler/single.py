"""The reference engine: the whole model on one CPU or one GPU (``parallel.mode: single``).

fp32 master weights (a frozen LoRA base in the training dtype), autocast for bf16/fp16, torch's
AdamW, and the end of the step every engine shares (:class:`~mobius.optim.UpdateRule`: fp16 loss
scaling, global-norm clipping). Every parallel engine is tested against it.
"""

from __future__ import annotations

import torch

from mobius.checkpoint import RankState, ResumeState, SingleProcess
from mobius.config import Config
from mobius.engine import DTYPES, Batch, StepStats, autocast
from mobius.models import dropout_active
from mobius.models.base import CausalLM, lm_loss, run_units
from mobius.optim import UpdateRule, make_adamw, set_lr


def sum_of_squares(grads: list[torch.Tensor]) -> float:
    """The squared L2 norm over all gradients (fp32 accumulation per tensor)."""
    if not grads:
        return 0.0
    return float(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]).square().sum())


class SingleEngine:
    """The whole model on one device."""

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
        self.rule = UpdateRule(cfg.train)
        self.dropout = dropout_active(model.config)

    def _forward_loss(self, x: torch.Tensor, y: torch.Tensor, seed: tuple[int, int, int] | None) -> torch.Tensor:
        with autocast(self.device, self.cfg.train.precision):
            logits = run_units(self.model.units(), x.to(self.device), dropout_seed=seed,
                               checkpoint_blocks=self.cfg.model.activation_checkpointing)  # [B, T, V]
            return lm_loss(logits, y.to(self.device))

    def train_step(self, step: int, batches: list[Batch], lr: float) -> StepStats:
        self.model.train()
        M = len(batches)
        factor = self.rule.loss_factor() / M
        total = torch.zeros((), device=self.device)
        for m, (x, y) in enumerate(batches):
            seed = (self.cfg.train.seed, step, m) if self.dropout else None
            loss = self._forward_loss(x, y, seed)
            (loss * factor).backward()
            total += loss.detach()
        grads = [p.grad for p in self.params if p.grad is not None]
        norm, skipped, coef = self.rule.end(sum_of_squares(grads))
        if not skipped:
            if coef != 1.0:
                torch._foreach_mul_(grads, coef)
            set_lr(self.optimizer, lr)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepStats(float(total) / M, norm, skipped, self.rule.loss_scale)

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
        return RankState(weights, moments, *self.rule.state())

    def load_state(self, resume: ResumeState) -> None:
        """AdamW moments by parameter name (from any mode's checkpoint), step count and loss scale."""
        moments = resume.moments([n for n, _ in self.named], self.model.config)
        self.rule.load(resume.optimizer_step, resume.scaler)
        if not moments:
            return
        index = {id(p): i for i, p in enumerate(p for g in self.optimizer.param_groups for p in g["params"])}
        step = float(self.rule.optimizer_step)
        state = {index[id(p)]: {"step": torch.tensor(step), "exp_avg": moments[n][0], "exp_avg_sq": moments[n][1]}
                 for n, p in self.named}
        self.optimizer.load_state_dict({"state": state, "param_groups": self.optimizer.state_dict()["param_groups"]})

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        pass
