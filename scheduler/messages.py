"""What crosses between stages (or ops) of a pipeline: a boundary activation, or its gradient, and for a
mixture-of-experts model the micro-batch's router choices.

The router's load-balancing loss of a micro-batch couples every MoE layer (:mod:`mobius.routing`): each stage's
backward needs the top-k choices per expert of all the micro-batch's layers, C [E]. So a forward's message
carries the choices of the layers so far after the activation, and a gradient's message carries all of them
(the last stage, which knows them all once its forward has run, starts the chain). They travel as a trailer of
the same message, their fp32 bits viewed in the message's dtype (a copy, no rounding), so that every link
(in place, mailboxes, gloo, NCCL) moves one message per hop, as for a dense model, whose messages have no
trailer and stay the bare [B, T, H].
"""

from __future__ import annotations

import math

import torch

from mobius.models.experts import balance_of


def trailer_numel(model_cfg: object, dtype: torch.dtype) -> int:
    """Elements of ``dtype`` a message's trailer takes: E fp32 counts (0 for a dense model)."""
    balance = balance_of(model_cfg)
    return 0 if balance is None else balance.experts * 4 // dtype.itemsize


class Messages:
    """The layout of one run's messages: the activation ``act_shape`` [B, T, H] in ``dtype``, then ``trailer``
    elements (the counts)."""

    def __init__(self, act_shape: tuple[int, ...], dtype: torch.dtype, trailer: int):
        self.act_shape, self.dtype, self.trailer = tuple(act_shape), dtype, trailer
        self.numel = math.prod(self.act_shape)

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape links receive: [B, T, H], or flat with the trailer."""
        return self.act_shape if not self.trailer else (self.numel + self.trailer,)

    def pack(self, t: torch.Tensor, counts: torch.Tensor | None) -> torch.Tensor:
        """The message of activation (or gradient) ``t`` and the choices ``counts`` [E] fp32."""
        if not self.trailer:
            return t.to(self.dtype)
        out = torch.empty(self.shape, dtype=self.dtype, device=t.device)
        out[:self.numel].copy_(t.reshape(-1))
        out[self.numel:].copy_(counts.to(device=t.device, dtype=torch.float32).contiguous().view(self.dtype))
        return out

    def unpack(self, msg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(activation [B, T, H], counts [E] fp32 or None) of a received message (views of it)."""
        if not self.trailer:
            return msg, None
        return msg[:self.numel].view(self.act_shape), msg[self.numel:].view(torch.float32)
