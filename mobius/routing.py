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
             ) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """What a forward's backward adds for the aux: (its layers' probability sums Q [E], their gradient
    ``weight * norm * C`` [E], its share of the micro-batch's aux value) given the choices ``counts`` C of every
    layer of the micro-batch; None when it ran no MoE layer. Q takes part in the backward when it requires grad."""
    if log.empty:
        return None
    q = log.prob_sum()
    norm = balance.norm(log.tokens)
    c = counts.to(q.device, q.dtype)
    return q, c * (weight * norm), norm * float(torch.dot(c, q.detach()))


@dataclass
class StepRouting:
    """One worker's routing over a step: the aux values of the micro-batches (its shares, on a stage) and the
    top-k choices per layer and expert, as statistics every engine sums over its workers (:meth:`stats`)."""

    balance: Balance
    aux: float = 0.0
    counts: dict[int, torch.Tensor] = field(default_factory=dict)

    def add(self, log: RouterLog, aux: float = 0.0) -> None:
        """A forward's log (its layers' choices) and its share of its micro-batch's aux value."""
        self.aux += aux
        for layer, c in log.counts.items():
            c = c.detach().double().cpu()
            self.counts[layer] = self.counts[layer] + c if layer in self.counts else c

    def stats(self) -> dict[str, float]:
        """Flat statistics, summable over workers."""
        out = {AUX: self.aux}
        for layer, c in self.counts.items():
            out.update({f"{COUNT}.{layer}.{e}": float(v) for e, v in enumerate(c.tolist())})
        return out


def metrics(total: dict[str, float], balance: Balance | None, layers: tuple[int, ...],
            micro_batches: int) -> dict:
    """``aux_loss``, ``expert_share_max`` and ``expert_share_min`` for metrics.jsonl from the step's summed
    statistics ({} for a dense model, or an evaluation)."""
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


def strip(total: dict[str, float]) -> dict[str, float]:
    """The summed statistics without the routing's (what the rest of an engine's accounting reads)."""
    return {k: v for k, v in total.items() if not k.startswith((AUX, COUNT))}
