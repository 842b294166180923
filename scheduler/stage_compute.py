"""The swapped pipeline's compute actions on the compute stream: a stage's forward (with autograd kept for a kept
stage), the last stage's forward, loss and backward in one (``FB``), a backward recomputing its forward from the
saved input (or through the kept graph); and the activations and their gradients each sends and receives, an
MoE's router choices riding along (:class:`~scheduler.messages.StageMessages`)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from mobius.engine import autocast
from mobius.models.base import lm_loss_sum, run_units
from mobius.models.experts import RouterLog, recording
from partition.schedule import Action, Schedule
from scheduler.dispatch_thread import batches_on
from scheduler.executor_state import ExecutorOptions, StepIO, StepState
from scheduler.messages import StageMessages
from scheduler.stage_swaps import StageSwaps
from scheduler.stages import StageLayout, add_gradients


@dataclass
class Graph:
    """A kept stage's forward: its input (with ``requires_grad``) and output, graph attached; for a
    swapped stage also the parameters the graph accumulates into (re-pointed at the backward's slot)."""

    x: torch.Tensor
    y: torch.Tensor
    params: tuple[torch.Tensor, ...] = ()
    log: RouterLog | None = None  # an MoE's routing in that forward (its probabilities' graph too)


class StageCompute:
    """This worker's stages computed on whichever slot holds them (``swaps``), and their messages (``mail``)."""

    def __init__(self, device: torch.device, layouts: list[StageLayout], units: dict[int, nn.Module],
                 resident: set[int], options: ExecutorOptions, swaps: StageSwaps, mail: StageMessages):
        self.device, self.layouts, self.units, self.resident = device, layouts, units, resident
        self.precision, self.swaps, self.mail = options.precision, swaps, mail

    def stage_batches(self, sched: Schedule, io: StepIO) -> dict[str, list[torch.Tensor]]:
        """Token ids for stage 0 and targets for the last stage, copied to the device up front."""
        mine = set(self.units)
        inputs, targets = [b.inputs for b in io.batches], [b.targets for b in io.batches]
        return {"inputs": batches_on(self.device, inputs) if 0 in mine else [],
                "targets": batches_on(self.device, targets) if sched.num_stages - 1 in mine else []}

    def _run(self, st: StepState, j: int, x: torch.Tensor, m: int) -> tuple[torch.Tensor, RouterLog]:
        """Stage j's units on micro-batch m's input x; the output and what its MoE layers routed."""
        io = st.io
        seed = (io.dropout_seed, io.step, m) if io.dropout_seed is not None else None
        with recording() as log:
            y = run_units(list(self.units[j]), x, self.layouts[j].first_unit, dropout_seed=seed,
                          docs=st.io.batches[m].docs)
        return y, log

    def _input(self, st: StepState, j: int, m: int) -> torch.Tensor:
        if j == 0:
            return st.batches["inputs"][m]
        return self.mail.take(st, "a", j, m)

    def forward(self, st: StepState, a: Action) -> None:
        j, m = a.stage, a.micro
        if st.sched.train and j in st.sched.kept:
            return self._forward_kept(st, j, m)
        self.swaps.on_device(st, j, grads=False)
        x = self._input(st, j, m)
        start = st.computed.mark()
        with torch.no_grad(), autocast(self.device, self.precision):
            y, log = self._run(st, j, x, m)
            if j == st.sched.num_stages - 1:  # evaluation: the last stage's forward ends in the loss
                self._count_loss(st, lm_loss_sum(y, st.batches["targets"][m]), m)
                return
        if st.sched.train:
            st.saved[(j, m)] = x  # an OFFLOAD that follows moves it to host memory
            if st.routed is not None:
                st.routed.add(log)
        st.outputs[("a", j, m)] = self.mail.pack(y, self.mail.so_far(st, j, m, log, y.device))
        st.computed.add("forward", start, "F", j)

    def _forward_kept(self, st: StepState, j: int, m: int) -> None:
        """Forward with autograd on: the graph stays on the device for the backward (no recompute).
        A swapped stage's graph holds its weights by position (:meth:`StageSwaps.weights_by_position`), so its
        slot may take other stages before the backward."""
        swapped = j not in self.resident
        self.swaps.on_device(st, j, grads=not swapped, graph=swapped)
        x = self._input(st, j, m)
        start = st.computed.mark()
        if x.is_floating_point():
            x = x.detach().requires_grad_()
        with self.swaps.weights_by_position(j) if swapped else contextlib.nullcontext():
            with autocast(self.device, self.precision):
                y, log = self._run(st, j, x, m)
        params = tuple(self.units[j].parameters()) if swapped else ()
        st.saved[(j, m)] = Graph(x, y, params, log)
        if st.routed is not None:
            st.routed.add(log)
        st.outputs[("a", j, m)] = self.mail.pack(y.detach(), self.mail.so_far(st, j, m, log, y.device))
        st.computed.add("forward", start, "F", j)

    def fb(self, st: StepState, a: Action) -> None:
        """Last stage: forward, loss and backward of one micro-batch (no recompute)."""
        j, m = a.stage, a.micro
        slot = self.swaps.on_device(st, j, grads=True)
        x = self._input(st, j, m)
        start = st.computed.mark()
        if x.is_floating_point():
            x = x.detach().requires_grad_()
        with autocast(self.device, self.precision):
            y, log = self._run(st, j, x, m)
            loss = lm_loss_sum(y, st.batches["targets"][m])
        everything = self.mail.so_far(st, j, m, log, loss.device)  # the micro-batch's router choices, all known now
        if st.routed is not None:
            st.routed.add(log)
        roots, grads = [loss * st.io.loss_factor], [None]
        self.mail.aux(st, roots, grads, log, everything, st.io.aux_weight)
        torch.autograd.backward(roots, grads)
        self._count_loss(st, loss.detach(), m)
        add_gradients(slot.pairs)
        if j > 0:
            st.outputs[("g", j, m)] = self.mail.pack(x.grad, everything)
        st.computed.add("backward", start, "FB", j)

    def backward(self, st: StepState, a: Action) -> None:
        """Recompute the stage's forward from its saved input (or take its kept graph), then backpropagate."""
        j, m = a.stage, a.micro
        slot = self.swaps.on_device(st, j, grads=True)
        self.swaps.inputs_back(st, j)
        saved = st.saved.pop((j, m))
        g = self.mail.take(st, "g", j, m)
        everything = st.choices.pop(("g", j, m), None)  # an MoE's router choices of all the micro-batch's layers
        start = st.computed.mark()
        pairs = slot.pairs
        if isinstance(saved, Graph):
            x, y, log = saved.x, saved.y, saved.log
            if saved.params:  # swapped: the graph accumulates into its forward's parameters -> this slot's buffers
                sums, pairs = {id(p): total for p, total in slot.pairs}, []
                for old, new in zip(saved.params, self.units[j].parameters(), strict=True):
                    old.grad = new.grad  # fp32: the slot's gradient views; half: empty, the fp32 sums take them
                    if id(new) in sums:
                        pairs.append((old, sums[id(new)]))
        else:
            x = saved.detach().requires_grad_() if saved.is_floating_point() else saved
            with autocast(self.device, self.precision):
                y, log = self._run(st, j, x, m)
        roots, grads = ([y], [g.to(y.dtype)]) if y.requires_grad else ([], [])  # (a stage of frozen weights over
        # token ids, LoRA's embedding, has nothing to do)
        self.mail.aux(st, roots, grads, log, everything, st.io.aux_weight)
        if roots:
            torch.autograd.backward(roots, grads)
        add_gradients(pairs)
        if j > 0:
            st.outputs[("g", j, m)] = self.mail.pack(x.grad, everything)
        st.computed.add("backward", start, "B", j)

    def _count_loss(self, st: StepState, loss: torch.Tensor, m: int) -> None:
        """Micro-batch m's summed loss and its target tokens, towards the mean over the step's."""
        st.loss_sum = st.loss_sum + loss.detach().float()
        st.losses += st.io.batches[m].target_count
