"""The zero-mode engine: data parallelism over chunked, sharded model states with rCache (Elixir).

One per rank of the default process group; the same interface as the reference ``SingleEngine``.
A step runs the unit-major program of :mod:`partition.schedule.zero`: each unit's forward for all of
this rank's micro-batches, the last unit's loss and backward, then each unit's backward in reverse
(recomputing its forward from the saved input with activation checkpointing; otherwise through the
graph kept since the forward). Before an operator runs, rCache holds the chunks its unit uses
(:class:`~scheduler.zero.rank_cache.RCache`); after the last backward call of a chunk's run, its gradient
is reduce-scattered into the owners' shards (:class:`~scheduler.zero.rank_cache.GradBuffers`). Then the
global norm, clipping and loss scaling as in the other modes; GPU chunks take one fused AdamW step,
offloaded chunks a CPU AdamW each on the optimizer thread -- as soon as their gradients are down
when nothing waits for the norm (no clipping, no fp16), which then overlaps the backward and the next
step's forward until that chunk is gathered.

Micro-batches: rank ``r`` of ``N`` takes micro-batches ``r*M/N .. (r+1)*M/N - 1`` of the step's ``M``
(dropout seeded by their global index), so every mode trains the same model from the same config.

``train.update: delayed``: gathers read each shard's compute copy, one update behind the master
(:mod:`scheduler.zero.shards`); an update first copies the master into it, then runs AdamW on the
master alone -- offloaded chunks on the optimizer thread beside the next step's forward, whose
gathers wait only for the copy. Evaluation puts the newest weights in the compute copies meanwhile;
a resumable checkpoint keeps the compute weights beside the newest.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.distributed as dist

from mobius import routing
from mobius.assemble import WeightSource
from mobius.checkpoint import ProcessGroup, RankState, ResumeState
from mobius.config import Config
from mobius.batch import MicroBatch, step_targets
from mobius.engine import DTYPES, StepStats, autocast
from mobius.errors import CheckpointError, MobiusError
from mobius.models import ModelConfig, dropout_active, unit_prefix, unit_specs
from mobius.models.base import bind_parameters, lm_loss_sum, run_units
from mobius.models.experts import RouterLog, balance_of, recording
from mobius.models.params import build_units, model_params
from mobius.optim import UpdateRule
from mobius.states import Moments
from mobius.parallel import ParallelSettings
from mobius.layout import build_layout
from partition.costs import host_bytes_per_param
from partition.schedule.zero import OpKind, eval_program, grad_flushes, train_program
from partition.zero import ZeroPlan
from scheduler.plan_check import check_plan
from scheduler.collectives import all_gather_flat
from scheduler.counters import Counters
from scheduler.pinned import host_zeros
from scheduler.stage_store import check_host_memory
from scheduler.trace import ComputeSpans, by_worker
from scheduler.zero.rank_cache import GradBuffers, RCache, Streams
from scheduler.dispatch_thread import Background
from scheduler.updater import sum_over_ranks
from scheduler.zero.shards import HostChunk, Shards

log = logging.getLogger(__name__)


def share(micro_batches: int, rank: int, world: int) -> range:
    """The micro-batches rank ``rank`` of ``world`` takes: a contiguous block, in order."""
    return range(rank * micro_batches // world, (rank + 1) * micro_batches // world)


@dataclass
class _Pass:
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
    flushed: dict[int, int] = field(default_factory=dict)
    arrived: list[tuple[int, object]] = field(default_factory=list)  # offloaded chunk, its gradient's event
    computed: ComputeSpans | None = None  # each operator's compute, from after its gathers to its end
    gather_wait_s: float = 0.0  # the dispatch thread's time making the operators' chunks resident (waits, fills)
    reduce_scatter_s: float = 0.0  # its time issuing (on CPU workers: running) the gradients' reduce-scatters
    aux_weight: float = 0.0  # an MoE's load-balancing loss: its factor on each micro-batch's (mobius.routing)
    routed: routing.StepRouting | None = None  # an MoE's routing over the step on this rank
    choices: dict[int, torch.Tensor] = field(default_factory=dict)  # micro -> its router choices, every layer's
    logs: dict[tuple[int, int], RouterLog] = field(default_factory=dict)  # (unit, micro) -> its kept graph's routing


class ZeroEngine:
    """Chunked ZeRO with rCache on this rank (module docstring). ``settings`` is taken for the common
    engine signature; the plan carries everything zero mode needs from it."""

    looks_ahead = False

    def __init__(self, cfg: Config, model_cfg: ModelConfig, plan: ZeroPlan, settings: ParallelSettings,
                 device: torch.device, weights_from: WeightSource | None = None):
        check_plan("the zero plan", plan.delayed, plan.states, cfg.train)
        self.cfg, self.model_cfg, self.plan, self.device = cfg, model_cfg, plan, device
        self.delayed = plan.delayed  # the plan carries the rule (check_plan: the run's)
        self.comm = ProcessGroup()
        self.rank, self.world = self.comm.rank, self.comm.world
        self.is_main = self.rank == 0
        if self.world != plan.world:
            raise MobiusError(f"the zero plan is for {plan.world} ranks but {self.world} are running")
        self.dtype = DTYPES[cfg.train.precision]
        specs = unit_specs(model_cfg)
        num_units = len(specs)
        signatures = list(dict.fromkeys(u.signature for u in specs))
        self.alike = [signatures.index(u.signature) for u in specs]  # units of one signature compute alike
        self.layout = build_layout(model_params(model_cfg), num_units, plan.chunk_size, self.world, plan.align)
        assert self.layout.num_chunks == plan.num_chunks, (self.layout.num_chunks, plan.num_chunks)
        self.index = {n: i for i, p in enumerate(self.layout.params) for n in p.names}
        self.program, self.eval_ops = train_program(num_units), eval_program(num_units)
        self.flushes = grad_flushes(self.program, self.layout)
        self.runs = {c: sum(c in f for f in self.flushes) for c in range(self.layout.num_chunks)}
        self._build_state(plan, device)
        self._load_weights(weights_from)
        self.streams = Streams(device)
        group = self._group(device)
        self.counters = Counters()
        self.cache = RCache(self.layout, plan.cache_blocks, self.dtype, self.rank, self.world, group, self.streams,
                            self._fill, plan.prefetch, self.counters)
        self.grads = GradBuffers(self.layout, self.layout.min_blocks + 1, self.rank, self.world, group, self.streams,
                                 self.counters)
        self.units = build_units(model_cfg, 0, num_units)
        self.bg = Background(device)  # the optimizer thread (no copy threads: the caches' streams are their own)
        self.updated: torch.cuda.Event | None = None  # the last GPU update (gathers of the next pass wait)
        self.rule = UpdateRule(cfg.train)
        self.dropout_seed = cfg.train.seed if dropout_active(model_cfg) else None
        self.balance = balance_of(model_cfg)  # an MoE's load-balancing loss (None: dense)
        log.debug("zero rank %d: %d chunks of %d (%d on %s, %d offloaded), %d rCache blocks", self.rank,
                  self.layout.num_chunks, self.layout.padded, len(self.gpu.chunks), device, len(self.hosts),
                  plan.cache_blocks)

    # ---- set-up ---------------------------------------------------------------------------------
    def _build_state(self, plan: ZeroPlan, device: torch.device) -> None:
        """The first ``gpu_chunks`` chunks on the GPU, the others in host memory; a trainable chunk
        keeps its fp32 master, moments and gradient shard (under delayed also its compute copy in the
        training dtype), a frozen one (LoRA's base weights) only its shard in the training dtype."""
        lay, s = self.layout, self.layout.shard
        n, g = lay.num_chunks, min(plan.gpu_chunks, lay.num_chunks)
        trainable = [c for c in range(n) if lay.trains(c)]
        offloaded = [c for c in range(g, n) if lay.trains(c)]
        per = host_bytes_per_param(self.cfg.train.precision, False, self.delayed,  # as a swapped pipeline stage's
                                   self.cfg.train.optimizer_states)
        frozen_host = sum(1 for c in range(g, n) if not lay.trains(c)) * s * self.dtype.itemsize
        check_host_memory(round(len(offloaded) * s * per) + frozen_host, f"zero rank {self.rank}'s offloaded chunks")
        self.gpu = Shards(lay, [c for c in trainable if c < g], self.rank, device, self.cfg.train,
                          compute=self.dtype if self.delayed else None)
        pin = device.type == "cuda"
        self.hosts = {c: HostChunk(lay, c, self.rank, self.dtype, self.cfg.train, pin, self.delayed)
                      for c in offloaded}
        self.frozen = {c: (torch.zeros(s, dtype=self.dtype, device=device) if c < g else host_zeros(s, self.dtype, pin,
                                                                                                     self))
                       for c in range(n) if not lay.trains(c)}

    def _group(self, device: torch.device) -> object:
        """The chunks' collectives: NCCL between GPUs, gloo between CPU workers (none for one rank)."""
        if self.world == 1:
            return None
        return dist.new_group(backend="nccl" if device.type == "cuda" else "gloo")

    def _my_segments(self, chunk: int) -> list[tuple[int, int, int, int]]:
        """(param, start in the param, start in my shard, length) of what my shard of ``chunk`` holds."""
        s = self.layout.shard
        lo, hi = self.rank * s, (self.rank + 1) * s
        out = []
        for seg in self.layout.chunks[chunk].segments:
            a, b = max(seg.offset, lo), min(seg.offset + seg.numel, hi)
            if a < b:
                out.append((seg.param, seg.start + a - seg.offset, a - lo, b - a))
        return out

    def _shards_of(self, chunk: int) -> Shards:
        return self.hosts[chunk].shards if chunk in self.hosts else self.gpu

    def _load_weights(self, source: WeightSource | None) -> None:
        """Fill this rank's master shards from a checkpoint (only the tensors they need) or the seed."""
        source = source or WeightSource(None, None, self.cfg.train.seed)
        needed = {p for c in range(self.layout.num_chunks) for p, *_ in self._my_segments(c)}
        names = {self.layout.params[p].names[0] for p in needed}
        weights = source.load(self.model_cfg, names, {self.layout.params[p].units[0] for p in needed})
        missing = names - set(weights)
        if missing:
            raise CheckpointError(f"{source.base}: no weights for {sorted(missing)[:3]}")
        for c in range(self.layout.num_chunks):
            dst = self.frozen[c] if c in self.frozen else self._shards_of(c).master_of(c)
            for p, start, at, n in self._my_segments(c):
                flat = weights[self.layout.params[p].names[0]].reshape(-1)
                dst[at:at + n].copy_(flat[start:start + n])
        self.gpu.master_to_compute()  # delayed: the first two steps compute with w_0
        for host in self.hosts.values():
            host.refresh_half()

    # ---- gathers --------------------------------------------------------------------------------
    def _fill(self, chunk: int, mine: torch.Tensor) -> None:
        """This rank's slice of a gathered chunk: the GPU master shard cast to the compute dtype (under
        delayed its compute copy), or the offloaded chunk's half copy uploaded once its CPU update has
        written it (delayed: once the update has copied the master into it)."""
        if chunk in self.frozen:  # LoRA's base weights: their one copy, uploaded when it lives on the host
            src = self.frozen[chunk]
            mine.copy_(src, non_blocking=True)
            if chunk >= self.plan.gpu_chunks:  # offloaded
                self.counters.add(h2d=mine.nbytes)
            return
        host = self.hosts.get(chunk)
        if host is None:
            mine.copy_(self.gpu.compute_of(chunk) if self.delayed else self.gpu.master_of(chunk))
            return
        while not host.ready.wait(0.1):
            self.check()  # an update that failed before its copy (delayed) would leave the gather waiting
        mine.copy_(host.half, non_blocking=True)
        self.counters.add(h2d=mine.nbytes)

    # ---- a step ---------------------------------------------------------------------------------
    def _begin(self, train: bool, step: int, batches: list[MicroBatch], factor: float) -> _Pass:
        self.check()
        mine = share(len(batches), self.rank, self.world)
        put = (lambda t: t.pin_memory().to(self.device, non_blocking=True)) if self.device.type == "cuda" else \
            (lambda t: t)
        for unit in self.units:
            unit.train(train)
        self.cache.begin("train" if train else "eval", self.updated)
        self.updated = None
        return _Pass(train, step, mine, {m: put(batches[m].inputs) for m in mine},
                     {m: put(batches[m].targets) for m in mine}, {m: batches[m].docs for m in mine}, factor,
                     computed=ComputeSpans(self.device))

    def _run(self, st: _Pass) -> None:
        ops = self.program if st.train else self.eval_ops
        for t, op in enumerate(ops):
            chunks = self.layout.unit_chunks[op.unit]
            t0 = time.perf_counter()
            self.cache.acquire(chunks)
            start = st.computed.mark()
            st.gather_wait_s += time.perf_counter() - t0
            {OpKind.FORWARD: self._forward, OpKind.LOSS: self._loss, OpKind.EVAL: self._loss,
             OpKind.BACKWARD: self._backward}[op.kind](op.unit, st)
            st.computed.add("forward" if op.kind in (OpKind.FORWARD, OpKind.EVAL) else "backward", start,
                            op.kind.value, self.alike[op.unit])
            self.cache.release(chunks)
            t0 = time.perf_counter()
            for c in self.flushes[t] if st.train else ():
                self._flush(c, st)
            st.reduce_scatter_s += time.perf_counter() - t0
        self.cache.end()

    def train_step(self, step: int, batches: list[MicroBatch], lr: float,
                   upcoming: tuple[list[MicroBatch], float] | None = None) -> StepStats:
        M = len(batches)
        if M % self.world:
            raise MobiusError(f"{M} micro-batches cannot be split evenly among {self.world} zero ranks")
        targets = max(step_targets(batches), 1)  # every rank's: the loss is the mean over the step's target tokens
        st = self._begin(True, step, batches, self.rule.loss_factor() / targets)
        st.lr = lr
        if self.balance is not None:  # the mean of the step's micro-batches' aux losses (every rank's)
            st.aux_weight = routing.aux_weight(self.balance, self.rule.loss_factor(), M)
            st.routed = routing.StepRouting(self.balance, self.model_cfg.moe_layers)
        self._run(st)
        gathers = list(self.cache.gathered)
        computed = st.computed.stats(self.rank, self.world)  # (waits for the compute on a GPU)
        total = sum_over_ranks({"loss_sum": float(st.loss_sum), "sumsq": self.grads.take_sumsq(), **computed,
                                **(st.routed.stats() if st.routed is not None else {})})
        norm, skipped, factor = self.rule.end(total["sumsq"])
        self.updated = self._update_gpu(lr, factor, skipped)
        if self.plan.barrier:  # the updates waited for the global norm: in forward order, where the next step's
            # gathers wait for them (sync), or in the downloads' order, where only its downloads do (delayed)
            for c, done in (st.arrived if self.delayed else sorted(st.arrived, key=lambda x: x[0])):
                self._queue_update(c, done, lr, factor, skipped)
        self.cache.invalidate()
        mine = {f"{phase}_s": round(computed[f"{phase}_s"], 4) for phase in ("forward", "backward")}  # this rank's
        return StepStats(total["loss_sum"] / targets, norm, skipped, self.rule.loss_scale,
                         {**self._counters(gathers), **mine, **by_worker(total, self.world),
                          "compute_spread": round(total["compute_spread"] / self.world, 4),
                          "gather_wait_s": round(st.gather_wait_s, 4),
                          "reduce_scatter_s": round(st.reduce_scatter_s, 4),
                          **routing.metrics(total, self.balance, getattr(self.model_cfg, "moe_layers", ()), M)})

    def _update_gpu(self, lr: float, factor: float, skip: bool) -> "torch.cuda.Event | None":
        """The GPU chunks' update on the compute stream (``skip``: an fp16 overflow, no AdamW). Returns
        the event the next pass's gathers wait for: the update's end, or under delayed its first part
        (the compute copy has taken the master, w_{t-1}, a skipped step too; the AdamW after it writes the
        master alone)."""
        self.gpu.master_to_compute()  # (no compute copy in sync: nothing)
        copied = self.streams.record() if self.delayed else None
        if not skip:
            self.gpu.step(lr, factor)
        return copied if self.delayed else self.streams.record()

    def _counters(self, gathers: list[int]) -> dict:
        """Bytes this rank moved in the step (counted where each copy and collective is issued) and
        CPU AdamW seconds."""
        moved = self.counters.take()
        adam, _ = self.bg.updater.take()
        return {"gathers": len(gathers), "replaced_bytes": moved.get("replaced", 0),
                "allgather_bytes": moved.get("allgather", 0), "reduce_scatter_bytes": moved.get("reduce_scatter", 0),
                "h2d_bytes": moved["h2d"], "d2h_bytes": moved["d2h"], "cpu_adam_s": round(adam, 4)}

    # ---- operators ------------------------------------------------------------------------------
    def _bind(self, unit: int, grad: bool) -> list:
        """Point unit ``unit``'s modules at its parameters in rCache (a parameter split over chunks is
        assembled into one tensor); returns (parameter index, Parameter) pairs."""
        def tensor_of(name: str) -> torch.Tensor:
            i = self.index[name]
            shape, pieces = self.layout.params[i].shape, self.layout.pieces[i]
            parts = [self.cache.view(c)[seg.offset:seg.offset + seg.numel] for c, seg in pieces]
            return (parts[0] if len(parts) == 1 else torch.cat(parts)).view(shape)
        prefix = unit_prefix(unit, len(self.units))
        wants = (lambda name: grad and self.layout.params[self.index[name]].trains)
        return [(self.index[n], p) for n, p in bind_parameters(self.units[unit], prefix, tensor_of, wants)]

    def _call(self, unit: int, x: torch.Tensor, m: int, st: _Pass) -> torch.Tensor:
        return self._call_logged(unit, x, m, st)[0]

    def _call_logged(self, unit: int, x: torch.Tensor, m: int, st: _Pass) -> tuple[torch.Tensor, RouterLog]:
        """Unit ``unit`` on micro-batch m's input; its output and what its MoE layers routed."""
        seed = (self.dropout_seed, st.step, m) if self.dropout_seed is not None else None
        with autocast(self.device, self.cfg.train.precision), recording() as log:
            return run_units([self.units[unit]], x, unit, dropout_seed=seed, docs=st.docs[m]), log

    def _routed(self, m: int, log: RouterLog, st: _Pass) -> None:
        """A training forward's routing: its choices towards micro-batch m's (every layer's: this rank runs them
        all)."""
        if st.routed is None or log.empty:
            return
        st.routed.add(log)
        own = log.count_sum()
        st.choices[m] = st.choices[m] + own if m in st.choices else own

    def _forward(self, unit: int, st: _Pass) -> None:
        keep = st.train and not self.cfg.model.activation_checkpointing  # graphs wait for the backward
        bound = self._bind(unit, grad=keep)
        for m in st.mine:
            x = st.inputs[m] if unit == 0 else st.acts[(unit, m)]
            if keep:
                x = x.detach().requires_grad_() if x.is_floating_point() else x
                with torch.autograd.graph.saved_tensors_hooks(self.cache.pack, self.cache.unpack):
                    y, log = self._call_logged(unit, x, m, st)
                st.graphs[(unit, m)] = (x, y)
                st.logs[(unit, m)] = log
            else:
                with torch.no_grad():
                    y, log = self._call_logged(unit, x, m, st)
                if not st.train:
                    st.acts.pop((unit, m), None)
            if st.train:
                self._routed(m, log, st)
            st.acts[(unit + 1, m)] = y
        if keep:
            st.bound[unit] = bound

    def _loss(self, unit: int, st: _Pass) -> None:
        """The last unit: loss (and in training its backward, which starts the backward pass)."""
        bound = self._bind(unit, grad=st.train)
        for m in st.mine:
            x = st.acts.pop((unit, m))
            if not st.train:
                with torch.no_grad():
                    st.loss_sum = st.loss_sum + lm_loss_sum(self._call(unit, x, m, st), st.targets[m])
                continue
            x = x.detach().requires_grad_()
            loss = lm_loss_sum(self._call(unit, x, m, st), st.targets[m])
            (loss * st.factor).backward()
            self._fold(bound)
            st.dys[m] = x.grad
            st.loss_sum = st.loss_sum + loss.detach().float()

    def _backward(self, unit: int, st: _Pass) -> None:
        ac = self.cfg.model.activation_checkpointing
        bound = self._bind(unit, grad=True) if ac else st.bound.pop(unit)
        for m in st.mine:
            dy = st.dys.pop(m)
            if ac:  # recompute the unit's forward from its saved input
                x = st.acts.pop((unit, m)) if unit else st.inputs[m]
                x = x.detach().requires_grad_() if x.is_floating_point() else x
                y, log = self._call_logged(unit, x, m, st)
            else:
                x, y = st.graphs.pop((unit, m))
                log = st.logs.pop((unit, m))
            roots, grads = ([y], [dy.to(y.dtype)]) if y.requires_grad else ([], [])  # (frozen weights over token
            # ids, LoRA's embedding: nothing to compute)
            routing.backward_roots(roots, grads, self.balance, log, st.choices.get(m), st.aux_weight, st.routed)
            if roots:
                torch.autograd.backward(roots, grads)
            self._fold(bound)
            if unit > 0:
                st.dys[m] = x.grad

    def _fold(self, bound: list) -> None:
        """Add the parameters' gradients into their chunks' fp32 gradient buffers."""
        for i, p in bound:
            if p.grad is None:
                continue
            flat = p.grad.reshape(-1)
            for c, seg in self.layout.pieces[i]:
                self.grads.get(c)[seg.offset:seg.offset + seg.numel].add_(flat[seg.start:seg.start + seg.numel])
            p.grad = None

    # ---- gradients and updates ------------------------------------------------------------------
    def _flush(self, chunk: int, st: _Pass) -> None:
        st.flushed[chunk] = st.flushed.get(chunk, 0) + 1
        final = st.flushed[chunk] == self.runs[chunk]
        host = self.hosts.get(chunk)
        if host is not None and final:
            if not host.consumed.is_set():  # delayed: the previous AdamW still reads the gradient shard
                host.consumed.wait()
            self.check()
            host.ready.clear()  # its half copy is stale until the CPU update (delayed: until its copy)
            host.consumed.clear()
        target = host.shards.grad if host is not None else self.gpu.grad_of(chunk)
        done = self.grads.flush(chunk, final, target)
        if host is not None and final:
            self.counters.add(d2h=target.nbytes)
            st.arrived.append((chunk, done))
            if self.delayed:  # what the next step's gathers wait for, ahead of every AdamW (barrier or not)
                self.bg.updater.submit(host.to_compute, done, host.ready, first=True)
            if not self.plan.barrier:  # the factor is 1: update as soon as the gradient is down
                self._queue_update(chunk, done, st.lr, 1.0, False)

    def _queue_update(self, chunk: int, done: object, lr: float, factor: float, skip: bool) -> None:
        """CPU AdamW of an offloaded chunk on the optimizer thread, once its gradient shard is in host
        memory (``done``); its half copy is rewritten in the same pass (delayed: took the master as the gradient
        landed, which set ``ready``); ``consumed`` is set at the job's end."""
        host = self.hosts[chunk]

        def update() -> int:
            host.update(lr, factor, skip)
            return 0 if skip else self.layout.shard

        self.bg.updater.submit(update, done, host.consumed)

    def sync(self) -> None:
        """Wait for every queued CPU update (and surface a failure of one)."""
        self.bg.sync()

    def check(self) -> None:
        self.bg.check()

    # ---- evaluation -----------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, batches: list[MicroBatch]) -> float:
        """The held-out loss with the newest weights (under delayed, not the ones the next step computes
        with)."""
        with self._newest():
            st = self._begin(False, 0, batches, 1.0)
            self._run(st)
        self.counters.take()  # a training step reports its own bytes only
        total = sum_over_ranks({"loss_sum": float(st.loss_sum)})
        return total["loss_sum"] / max(step_targets(batches), 1)

    @contextlib.contextmanager
    def _newest(self) -> Iterator[None]:
        """While open, every compute copy holds its master (the newest weights; see Shards.newest) and
        gathers wait for that; afterwards the compute weights are back and rCache forgets the blocks
        gathered meanwhile. Without delayed: nothing to do."""
        if not self.delayed:
            yield
            return
        self.sync()  # every AdamW has written its master
        try:
            with contextlib.ExitStack() as stack:
                for shards in [self.gpu, *(h.shards for h in self.hosts.values())]:
                    stack.enter_context(shards.newest())
                self.updated = self.streams.record()
                yield
        finally:
            self.updated = self.streams.record()
            self.cache.invalidate()

    # ---- state ----------------------------------------------------------------------------------
    def _owners(self) -> list[int]:
        """The rank that writes each parameter: contiguous runs of about equal size; a LoRA adapter goes
        with its layer's weight (so that each rank can merge what it writes)."""
        total, acc, out = self.layout.param_numel, 0, []
        for p in self.layout.params:
            out.append(min(self.world - 1, acc * self.world // max(total, 1)))
            acc += p.numel
        index = {n: i for i, p in enumerate(self.layout.params) for n in p.names}
        for i, p in enumerate(self.layout.params):
            layer, adapter, _ = p.names[0].partition(".lora_")
            if adapter and f"{layer}.weight" in index:
                out[i] = out[index[f"{layer}.weight"]]
        return out

    def rank_state(self, with_moments: bool, frozen: bool = True) -> RankState:
        """This rank's share of complete fp32 weights (the newest; ``frozen``: also those that do not train)
        and, ``with_moments`` (a resumable checkpoint), AdamW moments (in the rule's storage) and under
        train.update=delayed the compute weights, by parameter name; every queued update has ended first."""
        self.sync()
        owner = self._owners()
        mine = [i for i, r in enumerate(owner) if r == self.rank and (frozen or self.layout.params[i].trains)]
        moments = with_moments and self.rule.optimizer_step > 0
        compute = with_moments and self.delayed
        parts = 1 + compute  # master, compute copy
        full = {i: torch.zeros(parts, self.layout.params[i].numel) for i in mine}  # [parts, numel]
        pieces: dict[int, list[tuple[int, Moments]]] = {i: [] for i in mine}  # param -> (start, moments) in order
        for c in range(self.layout.num_chunks):
            if c in self.frozen and not frozen:  # LoRA's base weights (the same chunks on every rank)
                continue
            chunk = self._gather_state(c, compute)  # [parts, P]
            held = self._gather_moments(c) if moments and c not in self.frozen else None
            for seg in self.layout.chunks[c].segments:
                if owner[seg.param] == self.rank:
                    full[seg.param][:, seg.start:seg.start + seg.numel] = chunk[:, seg.offset:seg.offset + seg.numel]
                    if held is not None:
                        pieces[seg.param].append((seg.start, held.part(seg.offset, seg.numel)))
        weights, mom, kept = {}, {}, {}
        for i in mine:
            p = self.layout.params[i]
            for name in p.names:
                weights[name] = full[i][0].view(p.shape)
                if compute and p.trains:
                    kept[name] = full[i][parts - 1].view(p.shape)
            if moments and p.trains:
                mom[p.names[0]] = Moments.cat([m for _, m in sorted(pieces[i], key=lambda x: x[0])]).to("cpu", p.shape)
        return RankState(weights, mom, *self.rule.state(), compute=kept if compute else None)

    def _gather_state(self, chunk: int, compute: bool = False) -> torch.Tensor:
        """A whole chunk's fp32 master (and ``compute``, its compute copy) on every rank, on the CPU: [parts, P]
        (a frozen chunk: its weights, and zeros for the rest)."""
        frozen = self.frozen.get(chunk)
        shards = self._shards_of(chunk) if frozen is None else None
        rows = [shards.master_of(chunk) if frozen is None else frozen]
        if compute:
            rows.append(shards.compute_of(chunk) if shards is not None else torch.zeros(rows[0].shape))
        mine = torch.stack([r.detach().float().cpu() for r in rows])  # [parts, s]
        if self.world == 1:
            return mine
        out = torch.empty(self.world * mine.shape[0], mine.shape[1])
        all_gather_flat(out, mine)
        return out.view(self.world, -1, mine.shape[1]).permute(1, 0, 2).reshape(mine.shape[0], -1)

    def _gather_moments(self, chunk: int) -> Moments:
        """A trainable chunk's AdamW moments on every rank, on the CPU, in the rule's storage: the ranks' shards
        gathered as bytes and joined."""
        mine = self._shards_of(chunk).moments_of(chunk).to("cpu")
        if self.world == 1:
            return mine
        names = list(mine.tensors())
        sizes = [t.numel() * t.element_size() for t in mine.tensors().values()]
        flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in mine.tensors().values()])  # [bytes]
        out = torch.empty(self.world * flat.numel(), dtype=torch.uint8)
        all_gather_flat(out, flat)
        shards = []
        for part in out.view(self.world, -1):
            got = dict(zip(names, (b.view(t.dtype) for b, t in zip(part.split(sizes), mine.tensors().values()))))
            shards.append(Moments.from_tensors(got))
        return Moments.cat(shards)

    def load_state(self, resume: ResumeState) -> None:
        """AdamW moments by parameter name (from any mode's checkpoint, another rule's converted), step count, loss
        scale and, under train.update=delayed, the compute weights (a sync checkpoint has none: the first step
        computes with its newest weights, which the compute copies hold)."""
        self.sync()
        self.rule.load(resume.optimizer_step, resume.scaler)
        for c in range(self.layout.num_chunks):
            if c in self.frozen:
                continue
            segs = self._my_segments(c)
            names = sorted({self.layout.params[p].names[0] for p, *_ in segs})
            moments = resume.moments(names, self.model_cfg) if names else {}
            if not moments:
                continue
            for p, start, at, n in segs:
                got = moments[self.layout.params[p].names[0]].part(start, n)
                self._shards_of(c).load_moments_of(c, got, resume.optimizer_step, at)
        self._load_compute(resume)

    def _load_compute(self, resume: ResumeState) -> None:
        """The compute copies from a delayed checkpoint's compute weights (by name, whichever mode wrote
        them); the two cases across update rules say so in one line."""
        if not self.delayed:
            if resume.delayed and self.is_main:
                log.info("train.update=sync: resuming a delayed checkpoint from its newest weights; the compute "
                         "weights of its update in flight are dropped")
            return
        trainable = [c for c in range(self.layout.num_chunks) if c not in self.frozen]
        names = sorted({self.layout.params[p].names[0] for c in trainable for p, *_ in self._my_segments(c)})
        compute = resume.compute_weights(names, self.model_cfg)
        if compute is None:
            if self.is_main:
                log.info("train.update=delayed: resuming a sync checkpoint; the first step computes with its newest "
                         "weights")
            return
        for c in trainable:
            dst = self._shards_of(c).compute_of(c)
            for p, start, at, n in self._my_segments(c):
                flat = compute[self.layout.params[p].names[0]].reshape(-1)
                dst[at:at + n].copy_(flat[start:start + n])

    def close(self) -> None:
        self.sync()
        self.bg.close()
