"""One micro-batch as every engine receives it: token ids, next-token targets and, for packed
conversations, where each row's documents begin and end.

``targets`` holds :data:`IGNORE` where a position is not trained on (a prompt, padding). ``docs``
(None for plain text, whose blocks run across documents as one causal sequence) holds each row's
document lengths in order, zero after the last: attention never crosses from one document into the
next and positions start again at each. It is a few integers per row, so it travels with the
micro-batch to every stage and worker; the dense masks and positions are made where they are used
(:mod:`mobius.models.packing`).

The loss of a step is the sum of the cross entropy over every target token of the step (all its
micro-batches, on every rank), divided by their count (:func:`step_targets`), never a mean of
micro-batch means: a short answer weighs what a long one weighs per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE = -100  # a target that takes no loss (the value transformers' labels use)


@dataclass(frozen=True)
class MicroBatch:
    """``inputs`` [B, T] int64 token ids; ``targets`` [B, T] int64 (IGNORE: no loss); ``docs`` [B, D] int32
    document lengths per row (summing to T, zero-padded), or None: each row is one causal sequence."""

    inputs: torch.Tensor
    targets: torch.Tensor
    docs: torch.Tensor | None = None

    def __post_init__(self) -> None:
        assert self.inputs.shape == self.targets.shape and self.inputs.dim() == 2, (self.inputs.shape,
                                                                                   self.targets.shape)
        assert self.docs is None or (self.docs.dim() == 2 and self.docs.shape[0] == self.inputs.shape[0])

    @property
    def target_count(self) -> int:
        """How many positions take a loss."""
        return int((self.targets != IGNORE).sum())

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "MicroBatch":
        """The batch on ``device`` (document lengths too: the attention masks are made from them there)."""
        move = lambda t: None if t is None else t.to(device, non_blocking=non_blocking)  # noqa: E731
        return MicroBatch(move(self.inputs), move(self.targets), move(self.docs))


def step_targets(batches: list[MicroBatch]) -> int:
    """The step's target tokens over all its micro-batches: what its summed loss is divided by."""
    return sum(b.target_count for b in batches)
