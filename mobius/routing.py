"""The router's load-balancing loss in a training step, the same in every engine.

A step's objective is the mean next-token loss over its target tokens plus ``router_aux_loss_coef`` times the
mean over its micro-batches of transformers' load-balancing loss of each (:class:`mobius.models.experts.Balance`;
transformers adds ``coef * aux`` to each forward's loss; over accumulated micro-batches mobius takes their
mean, so the objective's scale does not change with ``train.micro_batches``). Each micro-batch's aux depends on
that micro-batch alone (its tokens' routing through every MoE layer), so every mode computes the same one
wherever its layers run: a stage's share of the aux's gradient is ``weight * norm * C . Q_stage`` (C: the top-k
choices of every layer of the micro-batch, all stages together; Q_stage: the router probabilities of its own
layers), which its backward takes beside the gradient of its output (:func:`aux_root`).

``metrics.jsonl`` carries ``aux_loss`` (the micro-batches' mean, before the coefficient: transformers'
``aux_loss``), ``expert_share_max`` and ``expert_share_min`` (per MoE layer, the busiest and the least used
expert's share of the layer's top-k choices over the step; 1/E when the experts are used evenly); ``loss`` stays
the next-token loss.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mobius.models.experts import Balance, RouterLog, shares

AUX = "moe_aux"  # the statistics' names (summed over workers)
COUNT = "moe_count"


def aux_weight(balance: Balance, scale: float, micro_batches: int) -> float:
    """The factor on one micro-batch's aux in the step's backward: the loss scale (fp16) times the coefficient
    over the step's micro-batches (all ranks')."""
    return scale * balance.coef / micro_batches


def aux_root(balance: Balance, log: RouterLog, counts: torch.Tensor, weight: float
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """What a forward's backward adds for the aux: (its layers' probability sums Q [E], their gradient
    ``weight * norm * C`` [E], its share of the micro-batch's aux value, a 0-dim tensor on Q's device) given the
    choices ``counts`` C of every layer of the micro-batch; None when it ran no MoE layer. Q takes part in the
    backward when it requires grad."""
    if log.empty:
        return None
    q = log.prob_sum()
    norm = balance.norm(log.tokens)
    c = counts.to(q.device, q.dtype)
    return q, c * (weight * norm), norm * torch.dot(c, q.detach())


def backward_roots(roots: list[torch.Tensor], grads: list[torch.Tensor | None], balance: Balance | None,
                   log: RouterLog | None, counts: torch.Tensor | None, weight: float,
                   step: "StepRouting | None") -> None:
    """Add a forward's aux term to a backward's roots and gradients (in place; nothing for a dense model or a
    forward without MoE layers), and its value to the step's."""
    if balance is None or log is None:
        return
    term = aux_root(balance, log, counts, weight)
    if term is None:
        return
    q, gq, value = term
    if step is not None:
        step.add_aux(value)
    if q.requires_grad:
        roots.append(q)
        grads.append(gq)


def own_counts(log: RouterLog, experts: int, device: torch.device) -> torch.Tensor:
    """[E] fp32 the top-k choices of a forward's layers (zeros when it ran none)."""
    return log.count_sum() if not log.empty else torch.zeros(experts, device=device)


@dataclass
class StepRouting:
    """One worker's routing over a step: its shares of the micro-batches' aux values and the top-k choices per
    layer and expert, kept on the device until :meth:`stats` (every worker names every MoE layer ``layers``, so
    the statistics sum over workers)."""

    balance: Balance
    layers: tuple[int, ...]
    aux: torch.Tensor | float = 0.0
    counts: dict[int, torch.Tensor] = field(default_factory=dict)

    def add(self, log: RouterLog) -> None:
        """A training forward's choices, per layer (a recomputation is not added again)."""
        for layer, c in log.counts.items():
            self.counts[layer] = self.counts[layer] + c if layer in self.counts else c.detach().clone()

    def add_aux(self, value: torch.Tensor) -> None:
        self.aux = self.aux + value.detach()

    def stats(self) -> dict[str, float]:
        """Flat statistics, summable over workers (one read from the device)."""
        E = self.balance.experts
        grid = torch.zeros(len(self.layers), E, dtype=torch.float64)
        if self.counts:
            rows = torch.stack([self.counts.get(layer, torch.zeros(E, device=next(iter(self.counts.values())).device))
                                for layer in self.layers]).double().cpu()
            grid.copy_(rows)
        out = {AUX: float(self.aux)}
        for i, layer in enumerate(self.layers):
            out.update({f"{COUNT}.{layer}.{e}": v for e, v in enumerate(grid[i].tolist())})
        return out


def metrics(total: dict[str, float], balance: Balance | None, layers: tuple[int, ...],
            micro_batches: int) -> dict:
    """``aux_loss``, ``expert_share_max`` and ``expert_share_min`` for metrics.jsonl from the step's summed
    statistics ({} for a dense model)."""
    if balance is None or AUX not in total:
        return {}
    out: dict = {"aux_loss": round(total[AUX] / max(micro_batches, 1), 6)}
    most, least = [], []
    for layer in layers:
        c = torch.tensor([total.get(f"{COUNT}.{layer}.{e}", 0.0) for e in range(balance.experts)])
        hi, lo = shares(c)
        most.append(round(hi, 4))
        least.append(round(lo, 4))
    out.update(expert_share_max=most, expert_share_min=least)
    return out
