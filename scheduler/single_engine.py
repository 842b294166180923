"""The reference engine: the whole model on one CPU or one GPU (``parallel.mode: single``).

fp32 master weights (a frozen LoRA base in the training dtype), autocast for bf16/fp16, torch's
AdamW, and the end of the step every engine shares (:class:`~mobius.optim.UpdateRule`: fp16 loss
scaling, global-norm clipping). Every parallel engine is tested against it. ``train.update``: the
optimizer updates the weights the model computes with (:class:`SyncWeights`), or a master copy one
update ahead of them (:class:`DelayedWeights`).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator

import torch
from torch import nn

from mobius.checkpoint import RankState, ResumeState, SingleProcess
from mobius.config import Config
from mobius.batch import MicroBatch, step_targets
from mobius.engine import DTYPES, StepStats, autocast
from mobius import routing
from mobius.models import ModelConfig, dropout_active
from mobius.models.base import CausalLM, lm_loss_sum, run_units
from mobius.models.experts import balance_of, recording
from mobius.models.lora import trains
from mobius.optim import UpdateRule, make_adamw

log = logging.getLogger(__name__)
Named = list[tuple[str, nn.Parameter]]


def sum_of_squares(grads: list[torch.Tensor]) -> float:
    """The squared L2 norm over all gradients (fp32 accumulation per tensor)."""
    if not grads:
        return 0.0
    return float(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]).square().sum())


class SyncWeights:
    """``train.update: sync``: the optimizer updates the parameters the model computes with."""

    def __init__(self, named: Named):
        self.named = named  # what the optimizer updates, by name

    def hand_over(self) -> None:
        """After a step's backward: nothing to do, the gradients are where the optimizer looks."""

    def newest(self) -> contextlib.AbstractContextManager:
        """While open, the model holds the newest weights (it always does)."""
        return contextlib.nullcontext()

    def in_flight(self) -> dict[str, torch.Tensor] | None:
        """What a checkpoint keeps besides the newest weights: nothing."""
        return None

    def resume(self, state: ResumeState, model_cfg: ModelConfig) -> None:
        """Continue a checkpoint with its newest weights (already in the model); a delayed checkpoint's
        compute weights are dropped."""
        if state.delayed:
            log.info("train.update=sync: resuming a delayed checkpoint from its newest weights; the compute weights "
                     "of its update in flight are dropped")


class DelayedWeights(SyncWeights):
    """``train.update: delayed``: the model computes with weights one update older than the newest.

    The optimizer updates an fp32 master copy of the trainable parameters (the newest weights); the
    model's own parameters are the compute weights. :meth:`hand_over`, after step t's backward, moves
    the model's gradients to the master and copies the master (still w_{t-1}) into the model; the
    optimizer step that follows makes w_t. So step t computes with w_{t-2} (steps 1 and 2 with w_0).
    """

    def __init__(self, named: Named):
        self.compute = named
        super().__init__([(n, nn.Parameter(p.detach().float().clone())) for n, p in named])

    @torch.no_grad()
    def hand_over(self) -> None:
        """The gradients of step t become the master's; the model computes step t+1 with w_{t-1}."""
        for (_, c), (_, m) in zip(self.compute, self.named):
            m.grad, c.grad = c.grad, None
            c.copy_(m)

    @contextlib.contextmanager
    def newest(self) -> Iterator[None]:
        """While open, the model holds the master (evaluation, the weights a checkpoint writes)."""
        self._swap()
        try:
            yield
        finally:
            self._swap()

    def _swap(self) -> None:
        for (_, c), (_, m) in zip(self.compute, self.named):
            c.data, m.data = m.data, c.data

    def in_flight(self) -> dict[str, torch.Tensor]:
        """The compute weights (one update behind the newest), fp32 by name, for a checkpoint."""
        return {n: p.detach().float().cpu() for n, p in self.compute}

    @torch.no_grad()
    def resume(self, state: ResumeState, model_cfg: ModelConfig) -> None:
        """Continue a checkpoint: its compute weights into the model (the master holds the newest, which
        the model was built with); a sync checkpoint has none, and its newest weights are computed with."""
        compute = state.compute_weights([n for n, _ in self.compute], model_cfg)
        if compute is None:
            log.info("train.update=delayed: resuming a sync checkpoint; the first step computes with its newest "
                     "weights")
            return
        for n, p in self.compute:
            p.copy_(compute[n])


class SingleEngine:
    """The whole model on one device."""

    is_main = True
    looks_ahead = False

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
        self.weights = DelayedWeights(self.named) if cfg.train.delayed else SyncWeights(self.named)
        self.optimizer = make_adamw(self.weights.named, cfg.train, fused=device.type == "cuda")
        self.rule = UpdateRule(cfg.train)
        self.dropout = dropout_active(model.config)
        self.balance = balance_of(model.config)  # MoE: the router's load-balancing loss

    def _forward_loss(self, b: MicroBatch, seed: tuple[int, int, int] | None) -> torch.Tensor:
        """The micro-batch's summed loss over its targets."""
        with autocast(self.device, self.cfg.train.precision):
            logits = run_units(self.model.units(), b.inputs.to(self.device), dropout_seed=seed,
                               checkpoint_blocks=self.cfg.model.activation_checkpointing, docs=b.docs)  # [B, T, V]
            return lm_loss_sum(logits, b.targets.to(self.device))

    def train_step(self, step: int, batches: list[MicroBatch], lr: float,
                   upcoming: tuple[list[MicroBatch], float] | None = None) -> StepStats:
        self.model.train()
        targets = max(step_targets(batches), 1)
        factor = self.rule.loss_factor() / targets  # the loss is the mean over the step's target tokens
        total = torch.zeros((), device=self.device)
        routed = routing.StepRouting(self.balance, self.model.config.moe_layers) if self.balance else None
        weight = routing.aux_weight(self.balance, self.rule.loss_factor(), len(batches)) if self.balance else 0.0
        for m, b in enumerate(batches):
            seed = (self.cfg.train.seed, step, m) if self.dropout else None
            with recording() as log:
                loss = self._forward_loss(b, seed)
            roots, grads = [loss * factor], [None]
            if routed is not None:  # the whole model ran: this forward's choices are the micro-batch's
                routed.add(log)
                routing.backward_roots(roots, grads, self.balance, log, log.count_sum(), weight, routed)
            torch.autograd.backward(roots, grads)
            total += loss.detach()
        grads = [p.grad for p in self.params if p.grad is not None]
        norm, skipped, coef = self.rule.end(sum_of_squares(grads))
        self.weights.hand_over()  # delayed: `grads` move to the master, the master (w_{t-1}) into the model
        if not skipped:
            if coef != 1.0:
                torch._foreach_mul_(grads, coef)
            self.optimizer.step(lr)
        self.optimizer.zero_grad()
        extra = routing.metrics(routed.stats(), self.balance, self.model.config.moe_layers, len(batches)) \
            if routed is not None else None
        return StepStats(float(total) / targets, norm, skipped, self.rule.loss_scale, extra)

    @torch.no_grad()
    def evaluate(self, batches: list[MicroBatch]) -> float:
        """The mean loss over the batches' target tokens, with the newest weights."""
        self.model.eval()
        with self.weights.newest():
            total = sum(float(self._forward_loss(b, None)) for b in batches)
        return total / max(1, step_targets(batches))

    def rank_state(self, with_moments: bool, frozen: bool = True) -> RankState:
        """The newest weights (``frozen``: also those that do not train) and, ``with_moments`` (a resumable
        checkpoint), the AdamW moments and under train.update=delayed the compute weights."""
        with self.weights.newest():
            weights = {k: v.detach().float().cpu() for k, v in self.model.state_dict().items()
                       if frozen or trains(self.model.config, k)}
        moments = {}
        if with_moments:
            for name, p in self.weights.named:
                st = self.optimizer.moments(p)
                if st is not None:
                    moments[name] = st.to("cpu", p.shape)
        return RankState(weights, moments, *self.rule.state(),
                         compute=self.weights.in_flight() if with_moments else None)

    def load_state(self, resume: ResumeState) -> None:
        """AdamW moments by parameter name (from any mode's checkpoint), step count, loss scale and, under
        train.update=delayed, the compute weights (a sync checkpoint: its newest weights)."""
        moments = resume.moments([n for n, _ in self.named], self.model.config)
        self.rule.load(resume.optimizer_step, resume.scaler)
        self.weights.resume(resume, self.model.config)
        if not moments:
            return
        for n, p in self.weights.named:
            self.optimizer.load(p, moments[n].as_rule(self.cfg.train.optimizer_states), self.rule.optimizer_step)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        pass
