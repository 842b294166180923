"""The round-robin runtime's compute actions on one worker: a forward op over a micro-batch (keeping the inputs of
units where backward ops start, for their ``OFFLOAD``), a backward op's recompute from its kept input and its
backward, the fused op's forward, loss and backward; and the activations and gradients they send and receive
(:class:`~scheduler.messages.StageMessages`)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from mobius.engine import autocast
from mobius.models.base import lm_loss_sum, run_units
from mobius.models.experts import recording
from partition.schedule import Action
from partition.schedule.roundrobin_actions import Cuts
from scheduler.device_slot import DeviceSlot
from scheduler.messages import StageMessages
from scheduler.roundrobin_step import RoundRobinStep
from scheduler.stages import add_gradients

OnDevice = Callable[[int, int, bool], DeviceSlot]  # (op, round, with gradients) -> its slot, once it is ready


class OpCompute:
    """One worker's compute of the ops the rotation gives it, on the slot each op's upload filled (``on_device``),
    with ``units`` (every unit's modules, bound to a slot per op)."""

    def __init__(self, units: nn.ModuleList, cuts: Cuts, kept_cuts: list[int], precision: str, dtype: torch.dtype,
                 dropout_seed: int | None, device: torch.device, mail: StageMessages, on_device: OnDevice):
        self.units, self.cuts, self.kept_cuts, self.precision, self.dtype = units, cuts, kept_cuts, precision, dtype
        self.dropout_seed, self.device, self.mail, self.on_device = dropout_seed, device, mail, on_device

    def _run(self, st: RoundRobinStep, first: int, end: int, x: torch.Tensor, m: int) -> torch.Tensor:
        seed = (self.dropout_seed, st.step, m) if self.dropout_seed is not None else None
        return run_units(list(self.units[first:end]), x, first, dropout_seed=seed, docs=st.micro[m].docs)

    def _input(self, st: RoundRobinStep, k: int, m: int) -> torch.Tensor:
        if k == 0:
            return st.batches[0][m]
        return self.mail.take(st, "a", k, m)

    def forward(self, st: RoundRobinStep, a: Action) -> None:
        """A forward op over one micro-batch (no autograd); the inputs of units where backward ops start are
        kept for their OFFLOAD."""
        k, m = a.stage, a.micro
        self.on_device(k, st.sched.round_of(m), False)
        first, end = self.cuts.units(k)
        x = self._input(st, k, m)
        start = st.computed.mark()
        keep = [c for c in self.kept_cuts if first < c <= end]
        with torch.no_grad(), autocast(self.device, self.precision), recording() as log:
            lo = first
            for u in [c for c in keep if c < end] + [end]:  # [B, T, H] at each cut
                x = self._run(st, lo, u, x, m).to(self.dtype)
                lo = u
                if u in keep:
                    st.kept[(m, u)] = x
        if st.routed is not None:
            st.routed.add(log)
        st.outputs[("a", k, m)] = self.mail.pack(x, self.mail.so_far(st, k, m, log, x.device))
        st.computed.add("forward", start, "F", k)

    def recompute(self, st: RoundRobinStep, a: Action) -> None:
        """A backward op's forward again, with autograd, from its kept input (the tokens for unit 0)."""
        k, m = a.stage, a.micro
        self.on_device(k, st.sched.round_of(m), True)
        first, end = self.cuts.units(k)
        x = st.reloaded.pop((k, m)) if first > 0 else st.batches[0][m]
        start = st.computed.mark()
        if x.is_floating_point():
            x = x.detach().requires_grad_()
        with autocast(self.device, self.precision), recording() as log:
            st.graphs[(k, m)] = (x, self._run(st, first, end, x, m))
        st.logs[(k, m)] = log
        st.computed.add("backward", start, "C", k)

    def backward(self, st: RoundRobinStep, a: Action) -> None:
        k, m = a.stage, a.micro
        slot = self.on_device(k, st.sched.round_of(m), True)
        x, y = st.graphs.pop((k, m))
        log = st.logs.pop((k, m))
        g = self.mail.take(st, "g", k, m)
        everything = st.choices.pop(("g", k, m), None)  # an MoE's router choices of all the micro-batch's layers
        start = st.computed.mark()
        roots, grads = ([y], [g.to(y.dtype)]) if y.requires_grad else ([], [])  # (frozen units over token ids,
        # LoRA's embedding, have nothing to do)
        self.mail.aux(st, roots, grads, log, everything, st.aux_weight)
        if roots:
            torch.autograd.backward(roots, grads)
        add_gradients(slot.pairs)
        if self.cuts.units(k)[0] > 0:
            st.outputs[("g", k, m)] = self.mail.pack(x.grad, everything)
        st.computed.add("backward", start, "B", k)

    def fb(self, st: RoundRobinStep, a: Action) -> None:
        """The fused op: forward, loss and backward of one micro-batch (no recompute)."""
        k, m = a.stage, a.micro
        slot = self.on_device(k, st.sched.round_of(m), True)
        first, end = self.cuts.units(k)
        x = self._input(st, k, m).detach().requires_grad_()
        start = st.computed.mark()
        with autocast(self.device, self.precision), recording() as log:
            loss = lm_loss_sum(self._run(st, first, end, x, m), st.batches[1][m])
        everything = self.mail.so_far(st, k, m, log, loss.device)  # the micro-batch's router choices, all known now
        if st.routed is not None:
            st.routed.add(log)
        roots, grads = [loss * st.loss_factor], [None]
        self.mail.aux(st, roots, grads, log, everything, st.aux_weight)
        torch.autograd.backward(roots, grads)
        st.loss_sum = st.loss_sum + loss.detach().float()
        st.losses += st.micro[m].target_count
        add_gradients(slot.pairs)
        st.outputs[("g", k, m)] = self.mail.pack(x.grad, everything)
        st.computed.add("backward", start, "FB", k)
