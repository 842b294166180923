"""One pass of a rank over the model's units: a training step's program or an evaluation's
(:mod:`partition.schedule.zero`), each operator run between rCache's acquire and release.

A training step: each unit's forward for all of this rank's micro-batches, the last unit's loss and backward,
then each unit's backward in reverse -- recomputing its forward from the saved input with activation
checkpointing, otherwise through the graph kept since the forward (autograd's saved tensors in a block packed
by chunk, :meth:`~scheduler.zero.rank_cache.RCache.pack`). A unit's modules are bound to views of the blocks
holding its chunks; its parameters' gradients are added into the chunks' fp32 gradient buffers, and a chunk
whose run of backward calls ends at an operator is handed to ``flush``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from mobius import routing
from mobius.batch import MicroBatch
from mobius.engine import autocast
from mobius.layout import ChunkLayout
from mobius.models import unit_prefix
from mobius.models.base import bind_parameters, lm_loss_sum, run_units
from mobius.models.experts import Balance, RouterLog, recording
from partition.schedule.zero import OpKind, eval_program, grad_flushes, train_program
from scheduler.dispatch_thread import batches_on
from scheduler.trace import ComputeSpans
from scheduler.zero.rank_cache import GradBuffers, RCache


def share(micro_batches: int, rank: int, world: int) -> range:
    """The micro-batches rank ``rank`` of ``world`` takes: a contiguous block, in order."""
    return range(rank * micro_batches // world, (rank + 1) * micro_batches // world)


@dataclass
class PassState:
    """Per-step (or per-evaluation) state of the dispatch thread."""

    train: bool
    step: int
    mine: range
    inputs: dict[int, torch.Tensor]
    targets: dict[int, torch.Tensor]
    docs: dict[int, torch.Tensor | None]  # each micro-batch's document lengths (host memory)
    factor: float = 1.0  # loss multiplier: loss scale / the step's target tokens (all ranks')
    lr: float = 0.0
    acts: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # (unit, micro) -> the unit's input
    graphs: dict[tuple[int, int], tuple] = field(default_factory=dict)  # (unit, micro) -> (input, output), no AC
    bound: dict[int, list] = field(default_factory=dict)  # unit -> parameters its kept graphs use
    dys: dict[int, torch.Tensor] = field(default_factory=dict)  # micro -> gradient flowing back
    loss_sum: torch.Tensor | float = 0.0
    flushed: dict[int, int] = field(default_factory=dict)  # chunk -> its runs flushed so far this step
    arrived: list[tuple[int, object]] = field(default_factory=list)  # offloaded chunk, its gradient's event
    computed: ComputeSpans | None = None  # each operator's compute, from after its gathers to its end
    gather_wait_s: float = 0.0  # the dispatch thread's time making the operators' chunks resident (waits, fills)
    reduce_scatter_s: float = 0.0  # its time issuing (on CPU workers: running) the gradients' reduce-scatters
    aux_weight: float = 0.0  # an MoE's load-balancing loss: its factor on each micro-batch's (mobius.routing)
    routed: routing.StepRouting | None = None  # an MoE's routing over the step on this rank
    choices: dict[int, torch.Tensor] = field(default_factory=dict)  # micro -> its router choices, every layer's
    logs: dict[tuple[int, int], RouterLog] = field(default_factory=dict)  # (unit, micro) -> its kept graph's routing


@dataclass(frozen=True)
class PassOptions:
    """How this rank's units compute, fixed for the run."""

    precision: str  # fp32 | bf16 | fp16 (autocast)
    checkpointing: bool  # activation checkpointing: recompute each unit's forward in its backward
    dropout_seed: int | None  # the run's seed when dropout is active
    balance: Balance | None  # an MoE's load-balancing loss (None: dense)
    alike: list[int]  # unit -> its signature's index (units of one signature compute alike: the spans' key)


class UnitPass:
    """The operators of one rank over ``units`` (the model's unit modules, computing on rCache's blocks):
    :meth:`begin` a pass, :meth:`run` its program; ``flush(chunk, state)`` takes a chunk whose gradient run
    ends."""

    def __init__(self, layout: ChunkLayout, units: torch.nn.ModuleList, cache: RCache, grads: GradBuffers,
                 rank: int, world: int, device: torch.device, options: PassOptions,
                 flush: Callable[[int, PassState], None]):
        self.layout, self.units, self.cache, self.grads = layout, units, cache, grads
        self.rank, self.world, self.device, self.opt, self.flush = rank, world, device, options, flush
        self.index = {n: i for i, p in enumerate(layout.params) for n in p.names}  # parameter name -> index
        self.program, self.eval_ops = train_program(layout.num_units), eval_program(layout.num_units)
        self.flushes = grad_flushes(self.program, layout)  # operator -> chunks whose gradient run ends there

    def runs(self) -> dict[int, int]:
        """chunk -> how many gradient runs (flushes) it has in a training step."""
        return {c: sum(c in f for f in self.flushes) for c in range(self.layout.num_chunks)}

    # ---- a pass ---------------------------------------------------------------------------------
    def begin(self, train: bool, step: int, batches: list[MicroBatch], factor: float,
              after: "torch.cuda.Event | None") -> PassState:
        """A pass over this rank's share of ``batches``, its inputs on the device; its gathers start after
        ``after`` (the last update of the master shards)."""
        mine = share(len(batches), self.rank, self.world)
        for unit in self.units:
            unit.train(train)
        self.cache.begin("train" if train else "eval", after)
        inputs = batches_on(self.device, [batches[m].inputs for m in mine])
        targets = batches_on(self.device, [batches[m].targets for m in mine])
        return PassState(train, step, mine, dict(zip(mine, inputs)), dict(zip(mine, targets)),
                         {m: batches[m].docs for m in mine}, factor, computed=ComputeSpans(self.device))

    def run(self, st: PassState) -> None:
        """The pass's operators in program order: each one's chunks made resident, its compute enqueued, its
        blocks released (the next operator's gathers start), then the flushes of the gradient runs it ends."""
        ops = self.program if st.train else self.eval_ops
        compute = {OpKind.FORWARD: self.forward, OpKind.LOSS: self.loss, OpKind.EVAL: self.loss,
                   OpKind.BACKWARD: self.backward}
        for t, op in enumerate(ops):
            chunks = self.layout.unit_chunks[op.unit]
            t0 = time.perf_counter()
            self.cache.acquire(chunks)
            start = st.computed.mark()
            st.gather_wait_s += time.perf_counter() - t0
            compute[op.kind](op.unit, st)
            st.computed.add("forward" if op.kind in (OpKind.FORWARD, OpKind.EVAL) else "backward", start,
                            op.kind.value, self.opt.alike[op.unit])
            self.cache.release(chunks)
            t0 = time.perf_counter()
            for c in self.flushes[t] if st.train else ():
                self.flush(c, st)
            st.reduce_scatter_s += time.perf_counter() - t0
        self.cache.end()

    # ---- operators ------------------------------------------------------------------------------
    def forward(self, unit: int, st: PassState) -> None:
        """Unit ``unit`` on each micro-batch: its output becomes the next unit's input; in training without
        activation checkpointing its graph is kept for the backward."""
        keep = st.train and not self.opt.checkpointing  # graphs wait for the backward
        bound = self.bind(unit, grad=keep)
        for m in st.mine:
            x = st.inputs[m] if unit == 0 else st.acts[(unit, m)]
            if keep:
                x = x.detach().requires_grad_() if x.is_floating_point() else x
                with torch.autograd.graph.saved_tensors_hooks(self.cache.pack, self.cache.unpack):
                    y, log = self.call(unit, x, m, st)
                st.graphs[(unit, m)] = (x, y)
                st.logs[(unit, m)] = log
            else:
                with torch.no_grad():
                    y, log = self.call(unit, x, m, st)
                if not st.train:
                    st.acts.pop((unit, m), None)
            if st.train:
                self._routed(m, log, st)
            st.acts[(unit + 1, m)] = y
        if keep:
            st.bound[unit] = bound

    def loss(self, unit: int, st: PassState) -> None:
        """The last unit: loss (and in training its backward, which starts the backward pass)."""
        bound = self.bind(unit, grad=st.train)
        for m in st.mine:
            x = st.acts.pop((unit, m))
            if not st.train:
                with torch.no_grad():
                    st.loss_sum = st.loss_sum + lm_loss_sum(self.call(unit, x, m, st)[0], st.targets[m])
                continue
            x = x.detach().requires_grad_()
            loss = lm_loss_sum(self.call(unit, x, m, st)[0], st.targets[m])
            (loss * st.factor).backward()
            self.fold(bound)
            st.dys[m] = x.grad
            st.loss_sum = st.loss_sum + loss.detach().float()

    def backward(self, unit: int, st: PassState) -> None:
        """Unit ``unit``'s backward on each micro-batch (its forward recomputed, or its kept graph), with an
        MoE's load-balancing loss; its gradients folded into the chunks' buffers."""
        ac = self.opt.checkpointing
        bound = self.bind(unit, grad=True) if ac else st.bound.pop(unit)
        for m in st.mine:
            dy = st.dys.pop(m)
            if ac:  # recompute the unit's forward from its saved input
                x = st.acts.pop((unit, m)) if unit else st.inputs[m]
                x = x.detach().requires_grad_() if x.is_floating_point() else x
                y, log = self.call(unit, x, m, st)
            else:
                x, y = st.graphs.pop((unit, m))
                log = st.logs.pop((unit, m))
            roots, grads = ([y], [dy.to(y.dtype)]) if y.requires_grad else ([], [])  # (frozen weights over token
            # ids, LoRA's embedding: nothing to compute)
            routing.backward_roots(roots, grads, self.opt.balance, log, st.choices.get(m), st.aux_weight, st.routed)
            if roots:
                torch.autograd.backward(roots, grads)
            self.fold(bound)
            if unit > 0:
                st.dys[m] = x.grad

    def call(self, unit: int, x: torch.Tensor, m: int, st: PassState) -> tuple[torch.Tensor, RouterLog]:
        """Unit ``unit`` on micro-batch m's input; its output and what its MoE layers routed."""
        seed = (self.opt.dropout_seed, st.step, m) if self.opt.dropout_seed is not None else None
        with autocast(self.device, self.opt.precision), recording() as log:
            return run_units([self.units[unit]], x, unit, dropout_seed=seed, docs=st.docs[m]), log

    def _routed(self, m: int, log: RouterLog, st: PassState) -> None:
        """A training forward's routing: its choices towards micro-batch m's (every layer's: this rank runs them
        all)."""
        if st.routed is None or log.empty:
            return
        st.routed.add(log)
        own = log.count_sum()
        st.choices[m] = st.choices[m] + own if m in st.choices else own

    # ---- parameters and gradients ---------------------------------------------------------------
    def bind(self, unit: int, grad: bool) -> list:
        """Point unit ``unit``'s modules at its parameters in rCache (a parameter split over chunks is
        assembled into one tensor); returns (parameter index, Parameter) pairs."""
        def tensor_of(name: str) -> torch.Tensor:
            i = self.index[name]
            shape, pieces = self.layout.params[i].shape, self.layout.pieces[i]
            parts = [self.cache.view(c)[seg.offset:seg.offset + seg.numel] for c, seg in pieces]  # [numel] each
            return (parts[0] if len(parts) == 1 else torch.cat(parts)).view(shape)
        prefix = unit_prefix(unit, len(self.units))
        wants = (lambda name: grad and self.layout.params[self.index[name]].trains)
        return [(self.index[n], p) for n, p in bind_parameters(self.units[unit], prefix, tensor_of, wants)]

    def fold(self, bound: list) -> None:
        """Add the parameters' gradients into their chunks' fp32 gradient buffers."""
        for i, p in bound:
            if p.grad is None:
                continue
            flat = p.grad.reshape(-1)  # [numel]
            for c, seg in self.layout.pieces[i]:
                self.grads.get(c)[seg.offset:seg.offset + seg.numel].add_(flat[seg.start:seg.start + seg.numel])
            p.grad = None
