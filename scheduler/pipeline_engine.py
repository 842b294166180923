"""The pipeline engine: one per worker, the same interface as the reference ``SingleEngine``.

It runs the plan it is given (stages, their workers, device slots, where boundary inputs wait,
resident and kept stages, the gradient download dtype): the schedule is built from the plan by
:mod:`partition.schedule` -- the same action lists the planner simulated -- and the
:class:`~scheduler.executor.Executor` dispatches them. Weights and optimizer moments are held per
stage (:mod:`scheduler.stage_store`): in host memory, or on the GPU for resident stages; checkpoints go
through :mod:`mobius.checkpoint` like every other mode's.

``train.update: delayed``: each store's copy the GPU computes with holds the compute weights, one
update behind the master (:class:`~scheduler.stage_store.StageStore`); evaluation puts the newest weights
there meanwhile, and a resumable checkpoint keeps the compute weights beside the newest.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator

import torch
import torch.distributed as dist

from mobius import routing
from mobius.assemble import WeightSource
from mobius.checkpoint import ProcessGroup, RankState, ResumeState
from mobius.config import Config
from mobius.batch import MicroBatch, step_targets
from mobius.engine import DTYPES, StepStats
from mobius.errors import CheckpointError, MobiusError
from mobius.models import ModelConfig, dropout_active, hidden_size, unit_prefix
from mobius.models.experts import balance_of
from mobius.optim import UpdateRule
from mobius.states import Moments
from mobius.parallel import ParallelSettings
from partition.swapped_plan import SwappedPlan
from partition.schedule import Schedule, build_eval_schedule, build_schedule
from scheduler.arbiter import UploadArbiter, arbiter_name, remove_stale
from scheduler.counters import Counters
from scheduler.links import link_to, mailboxes_for
from scheduler.plan_check import check_plan
from scheduler.executor import Executor
from scheduler.executor_state import Collectives, ExecutorOptions, StepIO
from scheduler.messages import trailer_numel
from scheduler.stages import stage_layouts, tied_places
from scheduler.stage_store import StageStore, TiedEnd, check_host_memory, host_bytes
from scheduler.trace import HeldTrace, StepTrace, by_worker, write_step_trace
from scheduler.updater import sum_over_ranks

log = logging.getLogger(__name__)
TIE_TAG = 1 << 30  # gloo tag of the tied-weight exchange
IN_STEP_WARMUP, IN_STEP_STEPS = 2, 5  # steps before, and steps of, the in-step CPU AdamW measurement


class PipelineEngine:
    """The swapped pipeline on this worker (rank) of the default process group."""

    looks_ahead = False

    def __init__(self, cfg: Config, model_cfg: ModelConfig, plan: SwappedPlan, settings: ParallelSettings,
                 device: torch.device, weights_from: WeightSource | None = None, skip_updates: bool = False):
        check_plan("the plan", plan.options.delayed, plan.options.states, cfg.train)
        self.cfg, self.model_cfg, self.plan, self.settings, self.device = cfg, model_cfg, plan, settings, device
        self.comm = ProcessGroup()
        self.rank, self.world = self.comm.rank, self.comm.world
        self.is_main = self.rank == 0
        self.dtype = DTYPES[cfg.train.precision]
        self.gpu_of = tuple(plan.gpu_of_stage(j) for j in range(plan.num_stages))
        self.layouts = stage_layouts(model_cfg, list(plan.boundaries))
        mine = [j for j in range(plan.num_stages) if self.gpu_of[j] == self.rank]
        if not mine:
            raise MobiusError(f"worker {self.rank} has no stage: {plan.num_stages} stages for {self.world} workers")
        half_grads = plan.options.grad_dtype == "half"
        if half_grads and self.dtype != torch.bfloat16:
            raise MobiusError(f"the plan downloads half-precision gradients, which needs bf16 training, not "
                              f"{cfg.train.precision}; plan again for this configuration")
        self.delayed = plan.options.delayed  # the plan carries the rule (check_plan: the run's)
        swapped = [j for j in mine if j not in plan.options.resident]
        tied_end = self._tied_end(swapped)
        held = self.layouts[-1].trainable_numel - tied_end[0] if tied_end else 0  # the end, padding included
        check_host_memory(host_bytes([self.layouts[j] for j in swapped], self.dtype, half_grads, self.delayed, held,
                                     cfg.train.optimizer_states), f"worker {self.rank}'s swapped stages")
        pin = device.type == "cuda"
        self.stores: dict[int, StageStore] = {}
        for j in mine:  # ascending: the embedding's store before the head's, which may read it
            head = tied_end is not None and j == mine[-1]
            tied = TiedEnd(tied_end[0], tied_end[1], self.stores[0], tied_end[2]) if head else None
            self.stores[j] = StageStore(self.layouts[j], self.dtype, cfg.train, pin, half_grads,
                                        device if j in plan.options.resident else "cpu", self.delayed, tied)
        self._load_weights(weights_from)
        self.counters = Counters()
        self.arbiter = self._arbiter()
        tied = self._tied_ranges()
        self.rule = UpdateRule(cfg.train)
        self.train_sched = build_schedule(plan.num_stages, self.world, cfg.train.micro_batches, list(self.gpu_of),
                                          plan.options, bool(tied))
        self.eval_scheds: dict[int, Schedule] = {}
        options = ExecutorOptions(plan.options, cfg.train.precision, self.dtype,
                                  (cfg.train.micro_batch_size, cfg.data.seq_len, hidden_size(model_cfg)),
                                  tied, skip_updates, trailer_numel(model_cfg, self.dtype))
        hosts = {j: s for j, s in self.stores.items() if j not in plan.options.resident}
        resident = {j: s for j, s in self.stores.items() if j in plan.options.resident}
        links = self._links(options.messages.shape)
        self.traced = HeldTrace(cfg.train.max_steps)  # parallel.trace_step's trace, until the next step has run
        self.ex = Executor(self.rank, device, model_cfg, self.layouts, hosts, links, self.arbiter,
                           self.counters, Collectives(sum_over_ranks, self._exchange), self.rule, options, resident)
        self.dropout_seed = cfg.train.seed if dropout_active(model_cfg) else None
        self.balance = balance_of(model_cfg)  # an MoE's load-balancing loss
        self.param_bytes = sum(lay.param_count for lay in self.layouts) * self.dtype.itemsize
        self._update_rate = [0, 0.0, 0.0]  # steps seen, CPU AdamW seconds and parameters (see update_rate)

    # ---- set-up ---------------------------------------------------------------------------------
    def _tied_end(self, swapped: list[int]) -> tuple[int, int, int] | None:
        """(offset in the head's buffers, numel, offset in the embedding's) of a trained tied weight whose
        two ends' stages are both swapped on this worker: the embedding's store updates it for both."""
        ends = self._tied_ranges()
        if not ends or not {j for j, _, _ in ends} <= set(swapped):
            return None
        (_, embed, n), (_, head, _) = ends
        return head, n, embed

    def _load_weights(self, source: WeightSource | None) -> None:
        """Each worker reads only its stages (a checkpoint) or initialises only them (from scratch), one
        unit at a time, straight into the stores: at most one unit's tensors exist beside them, so that
        starting takes about the host memory the plan says the stores need."""
        source = source or WeightSource(None, None, self.cfg.train.seed)
        num_units = self.plan.boundaries[-1]
        for j, store in self.stores.items():
            lay = self.layouts[j]
            missing = {n for p in lay.params for n in p.names} - store.tied_names  # the source's weights
            for k in range(lay.first_unit, lay.end_unit):
                names = {n for n in missing if n.startswith(unit_prefix(k, num_units))}
                if names:
                    missing -= store.load(source.load(self.model_cfg, names, {k}))
            if missing:
                raise CheckpointError(f"{source.base}: no weights for {sorted(missing)[:3]}")

    def _arbiter(self) -> UploadArbiter:
        """The upload arbiter's shared file: rank 0 makes it (removing any a dead run left) and names it
        to every rank; once all have mapped it, it is removed, so that no way of ending leaves it."""
        group = next((g for g in self.settings.groups if self.rank in g), (self.rank,))
        box = [None]
        if self.is_main:
            remove_stale()
            box = [arbiter_name()]
            arb = UploadArbiter(box[0], self.rank, self.world, list(group), create=True)
        dist.broadcast_object_list(box, src=0)
        if not self.is_main:
            arb = UploadArbiter(box[0], self.rank, self.world, list(group), create=False)
        dist.barrier()
        arb.unlink()
        return arb

    def _links(self, act_shape: tuple[int, ...]) -> dict:
        S = self.plan.num_stages
        peers = {self.gpu_of[j + d] for j in self.stores for d in (-1, 1) if 0 <= j + d < S}
        nccl = dist.new_group(backend="nccl") if self.settings.p2p else None
        boxes = mailboxes_for(self.device.type, self.settings.nodes, self.world, [self.train_sched.actions], act_shape,
                              self.dtype, self.settings.p2p)
        return {p: link_to(p, self.rank, self.device, self.counters, nccl, boxes) for p in sorted(peers)}

    def _tied_ranges(self) -> tuple[tuple[int, int, int], ...]:
        """(stage, offset, numel) of each end of the tied weight, when the ends are on two stages."""
        first, last = self.layouts[0], self.layouts[-1]
        places = tied_places(self.model_cfg, first, last) if first.index != last.index else None
        if places is None:  # one stage holds both ends (they share one buffer range), or the weight is frozen
            return ()
        a, b = places
        return (first.index, a.offset, a.numel), (last.index, b.offset, b.numel)

    # ---- collectives (gloo, the default group) --------------------------------------------------
    def _exchange(self, mine: torch.Tensor, peer: int) -> torch.Tensor:
        other = torch.empty_like(mine)
        reqs = [dist.isend(mine.contiguous(), peer, tag=TIE_TAG), dist.irecv(other, peer, tag=TIE_TAG)]
        for r in reqs:
            r.wait()
        return other

    # ---- a step ---------------------------------------------------------------------------------
    def train_step(self, step: int, batches: list[MicroBatch], lr: float,
                   upcoming: tuple[list[MicroBatch], float] | None = None) -> StepStats:
        io = StepIO(batches, step, self.rule.loss_factor() / max(step_targets(batches), 1), self.dropout_seed, lr,
                    aux_weight=routing.aux_weight(self.balance, self.rule.loss_factor(), len(batches))
                    if self.balance else 0.0)
        trace = StepTrace(self.device) if self.cfg.parallel.trace_step == step + 1 else None
        out = self.ex.run(self.train_sched, io, trace)
        waited = self.traced.step_ran(trace, step, self._write_trace)
        s, n = out.stats, self.world
        self._count_update_rate(s)
        moved = s["h2d_bytes"] + s["d2h_bytes"] + s["p2p_bytes"]
        extra = {"h2d_bytes": int(s["h2d_bytes"]), "d2h_bytes": int(s["d2h_bytes"]), "p2p_bytes": int(s["p2p_bytes"]),
                 "overflow_bytes": int(s["overflow_bytes"]),
                 "traffic_x_params": round(moved / self.param_bytes, 3), "stall_s": round(s["stall_s"] / n, 4),
                 "upload_wait_s": round(s["upload_wait_s"] / n, 4), "cpu_adam_s": round(s["cpu_adam_s"] / n, 4),
                 "forward_s": round(s["forward_s"] / n, 4), "backward_s": round(s["backward_s"] / n, 4),
                 "dispatch_s": round(s["dispatch_s"] / n, 4), "launch_s": round(s["launch_s"] / n, 4),
                 "compute_spread": round(s["compute_spread"] / n, 4),
                 "reduce_s": round(s["reduce_s"] / n, 4),
                 "reduce_wait_s": round(s["reduce_wait_s"] / n, 4), **by_worker(s, n)}
        if waited:
            extra["traced"] = True  # it waited for its CPU updates (and the step before's trace): not a steady step
        extra.update(routing.metrics(s, self.balance, getattr(self.model_cfg, "moe_layers", ()), len(batches)))
        return StepStats(out.loss, out.grad_norm, out.skipped, self.rule.loss_scale, extra)

    def _count_update_rate(self, stats: dict[str, float]) -> None:
        """After ``IN_STEP_WARMUP`` steps, sum the CPU AdamW's seconds and parameters over the next
        ``IN_STEP_STEPS`` (all workers; see :attr:`update_rate`); a delayed update's compute copies count in
        both, their parameters as :func:`partition.costs.compute_copy_work` weighs them."""
        seen = self._update_rate
        seen[0] += 1
        if IN_STEP_WARMUP < seen[0] <= IN_STEP_WARMUP + IN_STEP_STEPS:
            seen[1] += stats["cpu_adam_s"]
            seen[2] += stats["cpu_adam_params"]

    @property
    def update_rate(self) -> float | None:
        """The CPU AdamW's parameters per second per worker inside training steps (each worker's threads
        update its own stages), once ``IN_STEP_WARMUP + IN_STEP_STEPS`` steps have run; else None."""
        steps, seconds, params = self._update_rate
        if steps < IN_STEP_WARMUP + IN_STEP_STEPS or seconds <= 0 or params <= 0:
            return None
        return params / seconds

    def _write_trace(self, trace: StepTrace, step: int) -> None:
        """Finish the traced step (its CPU updates included) and write one Chrome trace for all workers."""
        self.ex.sync()
        write_step_trace(trace, self.comm, self.rank, self.device, self.cfg.output.dir, step)

    @torch.no_grad()
    def evaluate(self, batches: list[MicroBatch]) -> float:
        """The held-out loss with the newest weights (under delayed, not the ones the next step computes
        with)."""
        self.ex.sync()
        M = len(batches)
        if M not in self.eval_scheds:
            self.eval_scheds[M] = build_eval_schedule(self.plan.num_stages, self.world, M, list(self.gpu_of),
                                                      self.plan.options)
        io = StepIO(batches, 0, 1.0, None, training=False)
        with self._newest():
            return self.ex.run(self.eval_scheds[M], io).loss

    @contextlib.contextmanager
    def _newest(self) -> Iterator[None]:
        """While open, every stage computes with its newest weights (see StageStore.newest)."""
        with contextlib.ExitStack() as stack:
            for store in self.stores.values():
                stack.enter_context(store.newest())
            yield

    # ---- state ----------------------------------------------------------------------------------
    def rank_state(self, with_moments: bool, frozen: bool = True) -> RankState:
        """This worker's stages: fp32 weights (the newest; ``frozen``: also those that do not train) and,
        ``with_moments`` (a resumable checkpoint), AdamW moments and under train.update=delayed the compute
        weights, by parameter name; every queued update has ended first."""
        self.ex.sync()
        weights: dict[str, torch.Tensor] = {}
        moments: dict[str, Moments] = {}
        compute: dict[str, torch.Tensor] | None = {} if with_moments and self.delayed else None
        for j, host in self.stores.items():
            weights.update(host.weights(frozen))
            if with_moments:
                moments.update(host.moments())
            if compute is not None:
                compute.update(host.compute_weights())
        return RankState(weights, moments, *self.rule.state(), compute=compute)

    def load_state(self, resume: ResumeState) -> None:
        """Optimizer moments by name (from a checkpoint of any mode or partition), the loss scale and,
        under train.update=delayed, the compute weights (a sync checkpoint has none: the first step
        computes with its newest weights, which the stores hold)."""
        self.rule.load(resume.optimizer_step, resume.scaler)
        trained = {j: [p.names[0] for p in self.layouts[j].params if p.offset < self.layouts[j].trainable_numel]
                   for j in self.stores}
        for j, host in self.stores.items():
            host.load_moments(resume.moments(trained[j], self.model_cfg), resume.optimizer_step)
        if not self.delayed:
            if resume.delayed and self.is_main:
                log.info("train.update=sync: resuming a delayed checkpoint from its newest weights; the compute "
                         "weights of its update in flight are dropped")
            return
        compute = resume.compute_weights([n for names in trained.values() for n in names], self.model_cfg)
        if compute is None:
            if self.is_main:
                log.info("train.update=delayed: resuming a sync checkpoint; the first step computes with its newest "
                         "weights")
            return
        for host in self.stores.values():
            host.load_compute(compute)

    def sync(self) -> None:
        self.ex.sync()

    def close(self) -> None:
        self.ex.sync()
        self.ex.close()
        self.arbiter.close()

