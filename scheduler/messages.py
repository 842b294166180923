"""What crosses between stages (or ops) of a pipeline: a boundary activation, or its gradient, and for a
mixture-of-experts model the micro-batch's router choices.

The router's load-balancing loss of a micro-batch couples every MoE layer (:mod:`mobius.routing`): each stage's
backward needs the top-k choices per expert of all the micro-batch's layers, C [E]. So a forward's message
carries the choices of the layers so far after the activation, and a gradient's message carries all of them
(the last stage, which knows them all once its forward has run, starts the chain). They travel as a trailer of
the same message, their fp32 bits viewed in the message's dtype (a copy, no rounding), so that every link
(in place, mailboxes, gloo, NCCL) moves one message per hop, as for a dense model, whose messages have no
trailer and stay the bare [B, T, H].

:class:`Messages` is a run's layout of them; :class:`StageMessages` sends, receives and takes them apart for both
pipeline dispatchers.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Protocol

import torch

from mobius import routing
from mobius.models.experts import Balance, RouterLog, balance_of
from partition.schedule import Action, Kind
from scheduler.trace import DispatchTime


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


class MessageStep(Protocol):
    """What a dispatcher's step state holds for its messages."""

    sched: Any  # the step's schedule (its stage count, micro-batches and producers)
    waiting: dict[tuple[str, int, int], Callable[[], torch.Tensor]]  # posted receives
    outputs: dict[tuple[str, int, int], torch.Tensor]  # messages waiting to be sent
    choices: dict[tuple[str, int, int], torch.Tensor]  # the router choices the messages taken carried
    clock: DispatchTime
    routed: routing.StepRouting | None


class StageMessages:
    """A worker's activations and their gradients, to and from the workers of the stages (or round-robin ops)
    beside its own over ``links`` (peer -> link), each in ``msg``'s layout with an MoE's router choices in its
    trailer (``balance``; None: a dense model); tagged by kind, sender and micro-batch, unique within a step."""

    def __init__(self, links: dict, msg: Messages, balance: Balance | None):
        self.links, self.msg, self.balance = links, msg, balance

    @staticmethod
    def _tag(st: MessageStep, kind: str, sender: int, m: int) -> int:
        return ((0 if kind == "a" else 1) * st.sched.num_stages + sender) * st.sched.micro_batches + m

    def recv(self, st: MessageStep, a: Action) -> None:
        """Post the receive of ``a``'s message (unless it was posted when the step began)."""
        kind = "a" if a.kind == Kind.RECV_ACT else "g"
        if (kind, a.stage, a.micro) in st.waiting:  # posted when the step began
            return
        sender = st.sched.producer(a.stage, kind == "g")
        st.waiting[(kind, a.stage, a.micro)] = self.links[a.peer].recv(self.msg.shape, self.msg.dtype,
                                                                       self._tag(st, kind, sender, a.micro))

    def send(self, st: MessageStep, a: Action) -> None:
        kind = "a" if a.kind == Kind.SEND_ACT else "g"
        t = st.outputs.pop((kind, a.stage, a.micro))
        self.links[a.peer].send(t.to(self.msg.dtype), self._tag(st, kind, a.stage, a.micro))

    def pack(self, t: torch.Tensor, counts: torch.Tensor | None) -> torch.Tensor:
        return self.msg.pack(t, counts)

    def take(self, st: MessageStep, kind: str, j: int, m: int) -> torch.Tensor:
        """A received message's activation (or gradient); its router choices go to ``st.choices``."""
        t, counts = self.msg.unpack(st.clock.take(st.waiting, (kind, j, m)))
        if counts is not None:
            st.choices[(kind, j, m)] = counts
        return t

    def so_far(self, st: MessageStep, j: int, m: int, log: RouterLog, device: torch.device) -> torch.Tensor | None:
        """Micro-batch m's router choices up to stage (op) j's end: those it received and its own (an MoE)."""
        if self.balance is None:
            return None
        own = routing.own_counts(log, self.balance.experts, device)
        return own + st.choices.pop(("a", j, m)).to(device) if j > 0 else own

    def aux(self, st: MessageStep, roots: list, grads: list, log: RouterLog | None, counts: torch.Tensor | None,
            weight: float) -> None:
        """The aux loss's term (of factor ``weight``) of a backward (an MoE), given all the micro-batch's choices."""
        routing.backward_roots(roots, grads, self.balance, log, counts, weight, st.routed)
