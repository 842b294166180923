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

import logging

import torch
import torch.distributed as dist

from mobius import routing
from mobius.assemble import WeightSource
from mobius.checkpoint import ProcessGroup, RankState, ResumeState
from mobius.config import Config
from mobius.batch import MicroBatch, step_targets
from mobius.engine import DTYPES, StepStats
from mobius.errors import MobiusError
from mobius.models import ModelConfig, dropout_active, unit_specs
from mobius.models.experts import balance_of
from mobius.models.params import build_units, model_params
from mobius.optim import UpdateRule
from mobius.parallel import ParallelSettings
from mobius.layout import build_layout
from partition.zero import ZeroPlan
from scheduler.plan_check import check_plan
from scheduler.counters import Counters
from scheduler.trace import by_worker
from scheduler.zero.chunk_store import ChunkStore
from scheduler.zero.rank_cache import GradBuffers, RCache, Streams
from scheduler.dispatch_thread import Background
from scheduler.updater import sum_over_ranks
from scheduler.zero.shards import HostChunk, Shards
from scheduler.zero.unit_pass import PassOptions, PassState, UnitPass, share
from scheduler.zero.zero_checkpoint import ZeroCheckpoint
from scheduler.zero.zero_updates import ZeroUpdates

__all__ = ["ZeroEngine", "share"]

log = logging.getLogger(__name__)


class ZeroEngine:
    """Chunked ZeRO with rCache on this rank (module docstring): its shards (:class:`ChunkStore`), rCache and the
    gradient buffers, the pass over the units (:class:`UnitPass`), the flushes and updates (:class:`ZeroUpdates`)
    and the checkpoint state (:class:`ZeroCheckpoint`). ``settings`` is taken for the common engine signature;
    the plan carries everything zero mode needs from it."""

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
        dtype = DTYPES[cfg.train.precision]
        specs = unit_specs(model_cfg)
        self.layout = build_layout(model_params(model_cfg), len(specs), plan.chunk_size, self.world, plan.align)
        assert self.layout.num_chunks == plan.num_chunks, (self.layout.num_chunks, plan.num_chunks)
        self.counters = Counters()
        self.store = ChunkStore(self.layout, plan.gpu_chunks, self.rank, dtype, cfg.train, self.delayed, device,
                                self.counters, self.check)
        self.store.load_weights(weights_from or WeightSource(None, None, cfg.train.seed), model_cfg)
        self.streams = Streams(device)
        group = self._group(device)
        self.cache = RCache(self.layout, plan.cache_blocks, dtype, self.rank, self.world, group, self.streams,
                            self.store.fill, plan.prefetch, self.counters)
        self.grads = GradBuffers(self.layout, self.layout.min_blocks + 1, self.rank, self.world, group, self.streams,
                                 self.counters)
        self.bg = Background(device)  # the optimizer thread (no copy threads: the caches' streams are their own)
        self.rule = UpdateRule(cfg.train)
        self.balance = balance_of(model_cfg)  # an MoE's load-balancing loss (None: dense)
        self.unit_pass = self._unit_pass(specs)
        self.updates = ZeroUpdates(self.store, self.grads, self.cache, self.streams, self.bg, self.rule,
                                   self.counters, self.unit_pass.runs(), plan.barrier)
        self.state = ZeroCheckpoint(self.store, self.world, self.rule, model_cfg)
        log.debug("zero rank %d: %d chunks of %d (%d on %s, %d offloaded), %d rCache blocks", self.rank,
                  self.layout.num_chunks, self.layout.padded, len(self.gpu.chunks), device, len(self.hosts),
                  plan.cache_blocks)

    def _group(self, device: torch.device) -> object:
        """The chunks' collectives: NCCL between GPUs, gloo between CPU workers (none for one rank)."""
        if self.world == 1:
            return None
        return dist.new_group(backend="nccl" if device.type == "cuda" else "gloo")

    def _unit_pass(self, specs: list) -> UnitPass:
        """The operators over the model's units (built once), flushing into :attr:`updates`."""
        signatures = list(dict.fromkeys(u.signature for u in specs))
        options = PassOptions(self.cfg.train.precision, self.cfg.model.activation_checkpointing,
                              self.cfg.train.seed if dropout_active(self.model_cfg) else None, self.balance,
                              [signatures.index(u.signature) for u in specs])  # units of one signature compute alike
        units = build_units(self.model_cfg, 0, len(specs))
        return UnitPass(self.layout, units, self.cache, self.grads, self.rank, self.world, self.device, options,
                        lambda chunk, st: self.updates.flush(chunk, st))

    @property
    def gpu(self) -> Shards:
        """The GPU chunks' shards."""
        return self.store.gpu

    @property
    def hosts(self) -> dict[int, HostChunk]:
        """chunk -> an offloaded chunk's shards in host memory."""
        return self.store.hosts

    # ---- a step ---------------------------------------------------------------------------------
    def _begin(self, train: bool, step: int, batches: list[MicroBatch], factor: float) -> PassState:
        self.check()
        return self.unit_pass.begin(train, step, batches, factor, self.updates.take_updated())

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
        self.unit_pass.run(st)
        gathers = list(self.cache.gathered)
        computed = st.computed.stats(self.rank, self.world)  # (waits for the compute on a GPU)
        total = sum_over_ranks({"loss_sum": float(st.loss_sum), "sumsq": self.grads.take_sumsq(), **computed,
                                **(st.routed.stats() if st.routed is not None else {})})
        norm, skipped = self.updates.end_step(st, lr, total["sumsq"])
        mine = {f"{phase}_s": round(computed[f"{phase}_s"], 4) for phase in ("forward", "backward")}  # this rank's
        return StepStats(total["loss_sum"] / targets, norm, skipped, self.rule.loss_scale,
                         {**self._counters(gathers), **mine, **by_worker(total, self.world),
                          "compute_spread": round(total["compute_spread"] / self.world, 4),
                          "gather_wait_s": round(st.gather_wait_s, 4),
                          "reduce_scatter_s": round(st.reduce_scatter_s, 4),
                          **routing.metrics(total, self.balance, getattr(self.model_cfg, "moe_layers", ()), M)})

    def _counters(self, gathers: list[int]) -> dict:
        """Bytes this rank moved in the step (counted where each copy and collective is issued) and
        CPU AdamW seconds."""
        moved = self.counters.take()
        adam, _ = self.bg.updater.take()
        return {"gathers": len(gathers), "replaced_bytes": moved.get("replaced", 0),
                "allgather_bytes": moved.get("allgather", 0), "reduce_scatter_bytes": moved.get("reduce_scatter", 0),
                "h2d_bytes": moved["h2d"], "d2h_bytes": moved["d2h"], "cpu_adam_s": round(adam, 4)}

    @torch.no_grad()
    def evaluate(self, batches: list[MicroBatch]) -> float:
        """The held-out loss with the newest weights (under delayed, not the ones the next step computes
        with)."""
        with self.updates.newest():
            st = self._begin(False, 0, batches, 1.0)
            self.unit_pass.run(st)
        self.counters.take()  # a training step reports its own bytes only
        total = sum_over_ranks({"loss_sum": float(st.loss_sum)})
        return total["loss_sum"] / max(step_targets(batches), 1)

    # ---- state and threads ----------------------------------------------------------------------
    def rank_state(self, with_moments: bool, frozen: bool = True) -> RankState:
        """This rank's share of the checkpoint (:meth:`ZeroCheckpoint.rank_state`); every queued update has ended
        first."""
        self.sync()
        return self.state.rank_state(with_moments, frozen)

    def load_state(self, resume: ResumeState) -> None:
        """Moments, step count, loss scale and (delayed) compute weights from ``resume``
        (:meth:`ZeroCheckpoint.load_state`); a checkpoint of the other update rule is said in one line."""
        self.sync()
        said = self.state.load_state(resume)
        if said is not None and self.is_main:
            log.info(said)

    def sync(self) -> None:
        """Wait for every queued CPU update (and surface a failure of one)."""
        self.bg.sync()

    def check(self) -> None:
        """Raise what failed on the optimizer thread."""
        self.bg.check()

    def close(self) -> None:
        self.sync()
        self.bg.close()
