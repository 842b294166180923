"""The round-robin runtime: RoundPipe's schedule class (:mod:`partition.schedule.roundrobin_actions`) on stateless
workers.

No stage is bound to a worker: op ``k`` of round ``q`` runs on worker ``(first + q*K + k) mod N``, so every
worker reads every unit's weights and adds into every unit's gradient sums. Those live once, in host memory
all workers map (:class:`~scheduler.roundrobin_host.UnitStores`), and shared counters order what crosses workers:

* an ``UPLOAD`` copies the op's units (one slice) into a device slot once the updates they wait for have run
  (sync: the previous step's; delayed: the one before, which wrote the compute copy this step reads);
* a ``DOWNLOAD`` adds the round's gradient sums (fp32) into the host sum in round order (the first round of a
  step writes it; the step before's update of those units, and of a tied weight's other end, must have read it);
* an ``UPDATE`` runs the op's units' CPU AdamW on this worker's optimizer thread and counts the op's update;
* a forward's ``OFFLOAD`` puts a micro-batch's input of a unit where a backward op starts into the shared
  stash, and that backward op's ``RELOAD`` (on whichever worker it runs) takes it back: the reload thread copies
  it once the op's upload is done (on a GPU, after the upload's copy) and the input is stashed, as the simulator
  starts it, and the ``RELOAD`` waits for that copy; activations and their gradients go to the next worker of the
  ring, through mailboxes in host memory both map (page-locked between GPUs).

A weight tied between the embedding and the head has an end in the fused op and one in the last backward op:
the embedding's end's update waits for the head's gradients, runs the AdamW of their sum and copies the result
into the head's end (whose update leaves the tied weight out, and whose uploads wait for that copy); rank 0
counts the sum's square once.
Each step's lists are the schedule the planner simulated (``steps=1``, the rotation carried from step to step);
a step's ``REDUCE`` posts the sum of its statistics over the workers. Without fp16 (sync or delayed)
``train_step`` runs the next step's list before it waits for that sum, when the trainer hands it the next
step (``upcoming``: not before a checkpoint, an evaluation or the end), so a worker that has finished its part of a
step goes on with the next while the others finish, as in the simulator's program of consecutive steps.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from concurrent.futures import Future
from typing import Callable

import torch
import torch.distributed as dist

from mobius import routing
from mobius.assemble import WeightSource
from mobius.checkpoint import ProcessGroup, RankState, ResumeState
from mobius.config import Config
from mobius.batch import MicroBatch, step_targets
from mobius.engine import DTYPES, StepStats, autocast
from mobius.errors import CheckpointError, ConfigError, MobiusError
from mobius.models import ModelConfig, dropout_active, hidden_size, unit_prefix
from mobius.models.base import lm_loss_sum, run_units
from mobius.models.experts import balance_of
from mobius.models.params import build_units
from mobius.optim import UpdateRule
from mobius.states import Moments
from mobius.parallel import ParallelSettings
from partition.roundrobin_plan import RoundRobinPlan
from partition.schedule import Action, Kind
from partition.schedule.roundrobin_actions import RoundRobinSchedule, build_round_robin, rotation_start
from scheduler.counters import Counters
from scheduler.device_slot import DeviceSlot
from scheduler.dispatch_thread import Background, batches_on, copy_after, dispatch_action, event_now
from scheduler.links import link_to, mailboxes_for, post_early
from scheduler.messages import Messages, StageMessages, trailer_numel
from scheduler.plan_check import check_plan
from scheduler.roundrobin_compute import OpCompute
from scheduler.roundrobin_step import RoundRobinStep, StepReduce, ready_version
from scheduler.roundrobin_updates import OpUpdates
from scheduler.roundrobin_host import Span, UnitStores, wait_for
from scheduler.stages import bind
from scheduler.trace import ComputeSpans, DispatchTime, HeldTrace, StepTrace, by_worker, write_step_trace
from scheduler.updater import sum_over_ranks

log = logging.getLogger(__name__)


class RoundRobinEngine:
    """The round-robin schedule on this worker (rank) of the default process group: the ``Engine`` the
    trainer drives (train step, evaluation, checkpoint state)."""

    def __init__(self, cfg: Config, model_cfg: ModelConfig, plan: RoundRobinPlan, settings: ParallelSettings,
                 device: torch.device, weights_from: WeightSource | None = None, skip_updates: bool = False):
        check_plan("the round-robin plan", plan.options.delayed, plan.options.states, cfg.train)
        self.cfg, self.model_cfg, self.device = cfg, model_cfg, device
        self.comm = ProcessGroup()
        self.rank, self.world = self.comm.rank, self.comm.world
        self.is_main = self.rank == 0
        if settings.nodes > 1:
            raise ConfigError("the round-robin schedule runs on one machine (its workers share host memory); "
                              f"this run spans {settings.nodes} nodes: use parallel.schedule=swapped")
        self.cuts, self.options = plan.cuts, plan.options
        self.delayed = plan.options.delayed
        self.dtype = DTYPES[cfg.train.precision]
        M, (B, T, H) = cfg.train.micro_batches, (cfg.train.micro_batch_size, cfg.data.seq_len, hidden_size(model_cfg))
        self.act_shape = (B, T, H)
        self.balance = balance_of(model_cfg)  # an MoE's load-balancing loss (None: dense)
        self.msg = Messages(self.act_shape, self.dtype, trailer_numel(model_cfg, self.dtype))
        self.kept_cuts = list(self.cuts.backward[1:-1])  # units whose inputs wait in the stash
        self.stores = UnitStores(model_cfg, self.dtype, cfg.train, self.delayed, self.cuts.num_ops,
                                 (M * len(self.kept_cuts), B * T * H), device.type == "cuda")
        if self.stores.num_units != self.cuts.num_units:
            raise MobiusError(f"the plan's round-robin cuts cover {self.cuts.num_units} units, the model has "
                              f"{self.stores.num_units}; plan again for this model")
        self._load_weights(weights_from or WeightSource(None, None, cfg.train.seed))
        self.counters = Counters()
        self.rule = UpdateRule(cfg.train)
        self.skip_updates = skip_updates
        self.tied = self._tied()
        self.scheds: dict[int, RoundRobinSchedule] = {}
        self.steps_run = 0
        # without fp16 (no loss scale to learn) no step needs the step before's statistics: its uploads wait for
        # the updates they read (the shared counters), so train_step may run the next step's list before it waits
        # for this one's statistics, and its REDUCE need not wait for its updates
        self.looks_ahead = cfg.train.precision != "fp16"
        self.ahead: RoundRobinStep | None = None  # a step run ahead, whose statistics the next train_step returns
        self.traced = HeldTrace(cfg.train.max_steps)  # parallel.trace_step's trace, until the next step has run
        self.last_reduce: StepReduce | None = None
        self.adam_base = 0  # optimizer steps before this engine's first (no fp16: no step is skipped)
        self.dropout_seed = cfg.train.seed if dropout_active(model_cfg) else None
        self.param_bytes = self.stores.off[-1] * self.dtype.itemsize
        self.ex = _Dispatch(self, device)  # (reads the facts above)

    # ---- set-up ---------------------------------------------------------------------------------
    def _my_units(self) -> range:
        return range(self.rank, self.stores.num_units, self.world)

    def _load_weights(self, source: WeightSource) -> None:
        """Each rank reads (or initialises) every ``world``-th unit straight into the shared buffers."""
        U = self.stores.num_units
        for u in self._my_units():
            names = {n for p in self.stores.layouts[u].params for n in p.names if n.startswith(unit_prefix(u, U))}
            missing = names - self.stores.load(u, source.load(self.model_cfg, names, {u}))
            if missing:
                raise CheckpointError(f"{source.base}: no weights for {sorted(missing)[:3]}")
        dist.barrier()

    def _tied(self) -> dict[int, tuple[int, slice, slice]]:
        """op -> (the other end's op, this end's slice and the other's in the fp32 buffers) for a tied weight
        that trains; its two ends are in unit 0 (the last backward op, whose update runs the tied weight's AdamW:
        :attr:`~partition.schedule.roundrobin_actions.RoundRobinSchedule.tie_readers`) and the head (the fused op)."""
        t, U = self.stores.tie, self.stores.num_units
        if t is None:
            return {}
        sa, sb = self.stores.span(0, 1), self.stores.span(U - 1, U)
        ea = slice(sa.glo + t.embed, sa.glo + t.embed + t.numel)
        eb = slice(sb.glo + t.head, sb.glo + t.head + t.numel)
        K, F = self.cuts.num_ops, self.cuts.num_forward
        return {K - 1: (F, ea, eb), F: (K - 1, eb, ea)}

    def schedule(self, index: int) -> RoundRobinSchedule:
        """Step ``index``'s lists: the rotation goes on from the step before (its first op on the worker after
        the one that ran the previous step's last)."""
        first = rotation_start(self.cuts, self.world, self.cfg.train.micro_batches, index)
        if first not in self.scheds:
            self.scheds[first] = build_round_robin(self.cuts, self.world, self.cfg.train.micro_batches, 1, self.options,
                                                   bool(self.tied), first)
        return self.scheds[first]

    # ---- the Engine interface -------------------------------------------------------------------
    def train_step(self, step: int, batches: list[MicroBatch], lr: float,
                   upcoming: tuple[list[MicroBatch], float] | None = None) -> StepStats:
        """Run step ``step`` (unless it ran ahead) and, when ``upcoming`` is given and the rule allows, the next
        step's list too before waiting for this step's statistics: this worker goes on while the others finish."""
        if self.ahead is not None and self.ahead.step == step:
            st, self.ahead = self.ahead, None
            if not all(torch.equal(a.inputs, b.inputs) for a, b in zip(st.micro, batches)):
                raise MobiusError(f"internal error: step {step}'s batches differ from those it ran ahead with")
        else:
            st = self._run(step, batches, lr)
        if upcoming is not None and self.looks_ahead:
            self.ahead = self._run(step + 1, *upcoming)
        total, norm, skipped, _ = st.reduce.result()
        waited = self.traced.step_ran(st.trace, step, self._write_trace)
        n = self.world
        moved = total["h2d_bytes"] + total["d2h_bytes"] + total["p2p_bytes"]
        extra = {"schedule": "round_robin", "h2d_bytes": int(total["h2d_bytes"]), "d2h_bytes": int(total["d2h_bytes"]),
                 "p2p_bytes": int(total["p2p_bytes"]), "overflow_bytes": int(total["overflow_bytes"]),
                 "traffic_x_params": round(moved / self.param_bytes, 3),
                 **{k: round(total[k] / n, 4) for k in ("upload_wait_s", "cpu_adam_s", "forward_s", "backward_s",
                                                        "dispatch_s", "launch_s", "compute_spread")},
                 **by_worker(total, n)}
        if waited:
            extra["traced"] = True  # it waited for the updates (and the step before's trace): not a steady step
        extra.update(routing.metrics(total, self.balance, getattr(self.model_cfg, "moe_layers", ()), len(batches)))
        return StepStats(total["loss_sum"] / max(total["losses"], 1), norm, skipped, self.rule.loss_scale, extra,
                         seconds=st.seconds if self.looks_ahead else None)

    def _run(self, step: int, batches: list[MicroBatch], lr: float) -> RoundRobinStep:
        """This worker's list of one step, to its REDUCE (posted, not waited for)."""
        index = self.steps_run
        adam_step = self.adam_base + index + 1 if self.looks_ahead else self.rule.optimizer_step + 1
        st = RoundRobinStep(self.schedule(index), index, step, batches,
                   self.rule.loss_factor() / max(step_targets(batches), 1), lr, adam_step)
        if self.balance is not None:
            st.aux_weight = routing.aux_weight(self.balance, self.rule.loss_factor(), len(batches))
            st.routed = routing.StepRouting(self.balance, self.model_cfg.moe_layers)
        if self.cfg.parallel.trace_step == step + 1:
            st.trace = StepTrace(self.device)
        t0 = time.perf_counter()
        self.ex.run(st, self.last_reduce)
        st.seconds = time.perf_counter() - t0  # this worker's part of the step, to its REDUCE
        self.last_reduce = st.reduce
        self.steps_run += 1
        return st

    @torch.no_grad()
    def evaluate(self, batches: list[MicroBatch]) -> float:
        """The held-out loss with the newest weights (the masters): each worker runs every ``world``-th
        micro-batch through the forward ops and the fused op's forward."""
        self.updates_done()
        return self.ex.evaluate(batches)

    def _write_trace(self, trace: StepTrace, step: int) -> None:
        """Once every worker's updates of the steps run so far (and so the traced step's) have ended, one Chrome
        trace for all workers."""
        self.updates_done()
        write_step_trace(trace, self.comm, self.rank, self.device, self.cfg.output.dir, step)

    def updates_done(self) -> None:
        """Wait until every worker's updates of the steps run so far have ended."""
        self.ex.sync()
        want = self.steps_run
        for k in range(self.cuts.num_forward, self.cuts.num_ops):
            wait_for(lambda k=k: int(self.stores.version[k]) >= want, f"the update of op {k} (step {want})")

    def rank_state(self, with_moments: bool, frozen: bool = True) -> RankState:
        """Every ``world``-th unit from this rank: fp32 weights (the newest; ``frozen``: also those that do not
        train), and ``with_moments`` the AdamW moments and under delayed the compute weights the next step
        reads, by parameter name."""
        self.updates_done()
        weights: dict[str, torch.Tensor] = {}
        moments: dict[str, Moments] = {}
        compute: dict[str, torch.Tensor] | None = {} if with_moments and self.delayed else None
        for u in self._my_units():
            weights.update(self.stores.weights(u, frozen))
            if with_moments and self.rule.optimizer_step > 0:
                moments.update(self.stores.moments(u))
            if compute is not None:
                compute.update(self.stores.compute_weights(u, self.steps_run))
        return RankState(weights, moments, *self.rule.state(), compute=compute)

    def load_state(self, resume: ResumeState) -> None:
        """Moments of this rank's units by name, the loss scale, and under delayed the compute weights of the
        checkpoint's update in flight (a sync checkpoint has none: the first step computes with its newest)."""
        self.rule.load(resume.optimizer_step, resume.scaler)
        self.adam_base = resume.optimizer_step - self.steps_run
        for u in self._my_units():
            trained = self.stores.trained(u)
            got = resume.moments([name for name, _, _ in trained], self.model_cfg)
            if got:
                self.stores.load_moments(u, got)
            if self.delayed:
                compute = resume.compute_weights([name for name, _, _ in trained], self.model_cfg)
                if compute is not None and trained:
                    self.stores.load_compute(u, self.steps_run, compute)
        dist.barrier()

    def sync(self) -> None:
        self.updates_done()

    def close(self) -> None:
        self.ex.sync()
        self.ex.close()


class _Dispatch:
    """One worker's dispatch of its action lists over the shared stores: its two device slots and the copies into
    and out of them and the stash, on an upload thread (the copy stream on a GPU), a reload thread (kept inputs
    back from the stash, on its own stream) and a download thread (the d2h stream) (:class:`Background`, which
    also holds the summing thread and the CPU optimizer thread); its compute (:class:`OpCompute`) and its
    gradients, updates and step end (:class:`OpUpdates`) take each other action."""

    def __init__(self, engine: RoundRobinEngine, device: torch.device):
        e = self.e = engine
        self.device, self.cuda = device, device.type == "cuda"
        self.stores, self.cuts, self.counters = e.stores, e.cuts, e.counters
        self.units = build_units(e.model_cfg, 0, self.stores.num_units)
        self.spans = [self.stores.span(*self.cuts.units(k)) for k in range(self.cuts.num_ops)]
        numel, grad_numel = max(s.numel for s in self.spans), max(s.trainable for s in self.spans)
        self.slots = [DeviceSlot(numel, grad_numel, e.dtype, device, e.dtype != torch.float32) for _ in range(2)]
        self.slot_queue = collections.deque(self.slots)  # the next upload's slot first (see _upload)
        self.slot_of: dict[tuple[int, int, int], DeviceSlot] = {}  # (step index, op, round) -> its slot
        self.bound: tuple[int, int, str] | None = None  # (slot id, op, mode) the unit modules point at
        self.freed = threading.Condition()  # a slot's last reader (its gradients' download) has ended, or a job failed
        self.bg = Background(device, threads=("upload", "reload", "download", "sum"),
                             streams=("copy", "reload", "d2h"), what="a copy failed", wake=self.freed)
        self.links = self._links(e)
        mail = StageMessages(self.links, e.msg, e.balance)
        self.compute = OpCompute(self.units, self.cuts, e.kept_cuts, e.cfg.train.precision, e.dtype, e.dropout_seed,
                                 device, mail, self._on_device)
        self.updates = OpUpdates(e.stores, self.spans, e.tied, e.rule, (e.rank, e.world), e.skip_updates,
                                 self.counters, self.links, self.bg, self.slot_of, self._to_host, self._release)
        c, u = self.compute, self.updates
        self.handlers: dict[Kind, Callable[[Action], None]] = {
            Kind.UPLOAD: self._upload, Kind.FREE: self._free, Kind.OFFLOAD: self._offload, Kind.RELOAD: self._reload,
            **{kind: (lambda a, run=run: run(self.st, a)) for kind, run in (
                (Kind.FORWARD, c.forward), (Kind.FB, c.fb), (Kind.RECOMPUTE, c.recompute), (Kind.BACKWARD, c.backward),
                (Kind.RECV_ACT, mail.recv), (Kind.RECV_GRAD, mail.recv), (Kind.SEND_ACT, mail.send),
                (Kind.SEND_GRAD, mail.send), (Kind.DOWNLOAD, u.download), (Kind.UPDATE, u.update))},
            Kind.REDUCE: lambda a: u.reduce(self.st, a, self.before)}

    def _links(self, e: RoundRobinEngine) -> dict:
        """To the workers before and after this one in the ring (no peer-to-peer activations yet), through
        mailboxes sized for the first steps' rotations (page-locked on GPUs; the runs of one machine only)."""
        lists = (e.schedule(i).actions for i in range(e.world))
        boxes = mailboxes_for(self.device.type, 1, e.world, lists, e.msg.shape, e.dtype)
        return {p: link_to(p, e.rank, self.device, self.counters, boxes=boxes)
                for p in sorted({(e.rank - 1) % e.world, (e.rank + 1) % e.world})}

    # ---- the loop -------------------------------------------------------------------------------
    def run(self, st: RoundRobinStep, before: StepReduce | None) -> None:
        """This worker's actions of ``st`` (``before``: the previous step's statistics, ended before this one's)."""
        self.st, self.before = st, before
        st.computed = ComputeSpans(self.device)
        st.clock = DispatchTime(st.computed)
        st.batches = (batches_on(self.device, [b.inputs for b in st.micro]),
                      batches_on(self.device, [b.targets for b in st.micro]))
        for unit in self.units:
            unit.train(True)
        post_early(st.sched.actions[self.e.rank], self.links, self.handlers[Kind.RECV_ACT])
        for a in st.sched.actions[self.e.rank]:
            if a.kind == Kind.RELOAD:
                st.reloads.setdefault((a.stage, st.sched.round_of(a.micro)), []).append(a)
        for a in st.sched.actions[self.e.rank]:
            _, _, own = dispatch_action(self.handlers[a.kind], a, st.computed, st.clock, st.trace)
            if a.kind != Kind.REDUCE:  # messages, copies, binding an op to its slot
                st.dispatch_s += own

    def sync(self) -> None:
        self.bg.sync()

    def close(self) -> None:
        self.bg.close()

    # ---- weights in ---------------------------------------------------------------------------
    def _upload(self, a: Action) -> None:
        """Op k's upload into the slot uploaded longest ago, which its op frees first (ops compute, free and
        download in the order they were uploaded). The upload thread waits for it to be free: the dispatch thread
        goes on to the next op's compute, in the other slot, while the op before's gradients come down."""
        slot = self.slot_queue.popleft()
        self.slot_queue.append(slot)
        slot.ready.clear()  # its op has computed (its FREE or DOWNLOAD came before this upload)
        self.slot_of[(self.st.index, a.stage, a.round)] = slot
        upload = self.bg.submit("upload", self._copy_job, self.st, a.stage, a.round, slot)
        self.st.uploads.append(upload)
        for r in self.st.reloads.pop((a.stage, a.round), []):  # in the order the op's backwards need them
            self.st.reloading[(r.stage, r.micro)] = self.bg.submit("reload", self._reload_job, self.st, r, upload)

    def _copy_job(self, st: RoundRobinStep, k: int, q: int, slot: DeviceSlot) -> torch.cuda.Event | None:
        """(The upload thread) op k's units from step ``st``'s compute copy into ``slot``, once the updates its
        owners had to run have; in a step's last round after the first, a gradient op's host sum of the earlier
        rounds too, once they are down, so that its backward adds onto them (:meth:`OpUpdates.download`). Returns
        the copy's end on a GPU (the op's reloads follow it)."""
        try:
            with self.freed:
                self.freed.wait_for(lambda: slot.stage is None or self.bg.failure is not None)
                if self.bg.failure is not None:
                    return
                slot.stage, slot.grads_live = (k, q), False
            version = ready_version(st.index, self.stores.delayed)
            for o in st.sched.update_deps(k):
                st.wait_s += wait_for(lambda o=o: int(self.stores.version[o]) >= version,
                                      f"the update of op {o} (step {version})")
            s, sums = self.spans[k], None
            if st.sched.sums_up(k, q):
                done = st.index * st.sched.rounds + q  # rounds of op k summed before this one
                st.wait_s += wait_for(lambda: int(self.stores.summed[k]) >= done, f"op {k}'s gradients of round {q - 1}")
                sums = self.stores.grad(st.index)[s.glo:s.ghi]
            self._to_slot(slot, self.stores.half(st.index)[s.lo:s.hi], st.trace, f"U{k}", sums)
            slot.grads_live = sums is not None  # the backward adds onto the sums it brought
            return slot.ready_event  # read before `ready` is set: the dispatch thread takes it after
        except BaseException as e:  # raised by check() on the dispatch thread
            self.bg.fail(e)
        finally:
            slot.ready.set()

    def _to_slot(self, slot: DeviceSlot, src: torch.Tensor, trace: StepTrace | None = None, name: str = "",
                 sums: torch.Tensor | None = None) -> None:
        """``src`` into the slot's weights (and ``sums``, fp32, into its gradient sums), once its last reader is
        done."""
        n = src.numel()

        def copy() -> None:
            slot.params[:n].copy_(src, non_blocking=self.cuda)
            if sums is not None:
                slot.sums[:sums.numel()].copy_(sums, non_blocking=self.cuda)

        _, ready = copy_after(self.bg.streams["copy"], slot.released, copy, trace, "h2d", name)
        if self.cuda:
            slot.ready_event = ready
        self.counters.add(h2d=src.nbytes + (sums.nbytes if sums is not None else 0))

    def _free(self, a: Action) -> None:
        """The op's slot may take the next upload; an op with gradients keeps it until its DOWNLOAD has read
        them."""
        if self.cuts.kind(a.stage) == Kind.FORWARD:
            self._release(self.st.index, a.stage, a.round)

    def _release(self, index: int, k: int, round: int, compute: bool = True) -> None:
        """Op k's slot (of step ``index``'s round ``round``) is free: once the compute stream's work so far has
        ended (``compute``), or now (its gradients' download, which has read them)."""
        slot = self.slot_of.pop((index, k, round))
        slot.released = event_now(self.device) if compute else None
        with self.freed:
            slot.stage = None
            self.freed.notify_all()

    def _on_device(self, k: int, round: int, grads: bool) -> DeviceSlot:
        """Wait for op k's upload and point the unit modules of its units at the slot."""
        slot = self.slot_of[(self.st.index, k, round)]
        if not slot.ready.is_set():
            t0 = time.perf_counter()
            slot.ready.wait()
            self.st.wait_s += self.st.clock.held_since(t0)
        self.bg.check()
        if self.cuda and slot.ready_event is not None:
            torch.cuda.current_stream(self.device).wait_event(slot.ready_event)
            slot.ready_event = None
        s = self.spans[k]
        if grads and not slot.grads_live:
            slot.sums[:s.trainable].zero_()
            slot.grads_live = True
        key = (self.slots.index(slot), k, "grads" if grads else "infer")
        if self.bound != key:
            self._bind(slot, s, grads)
            self.bound = key
        return slot

    def _bind(self, slot: DeviceSlot, s: Span, grads: bool) -> None:
        """Bind the op's units to the slot (half precision with gradients: each micro-batch's gradients go
        into the fp32 sums, ``slot.pairs``)."""
        U = self.stores.num_units

        def make() -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
            pairs = []
            for u in range(s.first, s.end):
                us = self.stores.span(u, u + 1)
                lo, glo = us.lo - s.lo, us.glo - s.glo
                into, sums = slot.gradients_to(glo, glo + us.trainable) if grads else (None, None)
                pairs += bind(self.units[u:u + 1], self.stores.layouts[u], U, slot.params[lo:lo + us.numel], into,
                              requires_grad=grads, sums=sums)
            return pairs
        slot.point((s.first, s.end, grads), self.units[s.first:s.end], make)

    # ---- kept inputs: the stash ---------------------------------------------------------------
    def _entry(self, m: int, unit: int) -> int:
        """Micro-batch ``m``'s input of ``unit``: its entry in the step's stash (:meth:`UnitStores.stash`)."""
        return m * len(self.e.kept_cuts) + self.e.kept_cuts.index(unit)

    def _stash(self, index: int, i: int) -> torch.Tensor:
        n = self.e.act_shape[0] * self.e.act_shape[1] * self.e.act_shape[2]
        return self.stores.stash(index)[i * n:(i + 1) * n].view(self.e.act_shape)

    def _offload(self, a: Action) -> None:
        """A micro-batch's input of a unit where a backward op starts to the shared stash (the download thread)."""
        x, i = self.st.kept.pop((a.micro, a.unit)), self._entry(a.micro, a.unit)
        index, trace = self.st.index, self.st.trace
        ready = event_now(self.device)

        def job() -> None:
            self._to_host(self._stash(index, i), x, ready, trace, f"H{a.unit}")
            self.stores.stashed(index)[i] = index + 1

        self.st.d2h.append(self.bg.submit("download", job))
        self.counters.add(d2h=x.nbytes)

    def _to_host(self, dst: torch.Tensor, src: torch.Tensor, ready: torch.cuda.Event | None,
                 trace: StepTrace | None = None, name: str = "") -> None:
        """(The download thread) ``src`` into host memory ``dst`` once ``ready``; returns when it is there
        (``trace``: its span on the d2h track, as ``name``)."""
        stream = self.bg.streams["d2h"]
        copy_after(stream, ready, lambda: dst.copy_(src, non_blocking=self.cuda), trace, "d2h", name)
        if stream is not None:
            stream.synchronize()

    def _reload_job(self, st: RoundRobinStep, a: Action, upload: Future) -> tuple[torch.Tensor, torch.cuda.Event | None] | None:
        """(The reload thread) a backward op's input back from the stash, once the op's upload is done and the
        forward (on whichever worker) has put the input there; None after another thread's failure."""
        uploaded = upload.result()
        i, index = self._entry(a.micro, a.unit), st.index
        stashed = self.stores.stashed(index)
        wait_for(lambda: self.bg.failure is not None or int(stashed[i]) > index,
                 f"micro-batch {a.micro}'s input of unit {a.unit}")
        if self.bg.failure is not None:
            return None
        src = self._stash(index, i)
        x, back = copy_after(self.bg.streams["reload"], uploaded,
                             lambda: src.to(self.device, non_blocking=True) if self.cuda else src.clone(),
                             st.trace, "h2d", f"L{a.unit}")
        self.counters.add(h2d=x.nbytes)
        return x, back

    def _reload(self, a: Action) -> None:
        """Wait (the dispatch thread, then the compute stream) for the reload thread's copy of a backward op's
        input (:meth:`_reload_job`, started by the op's UPLOAD)."""
        t0 = time.perf_counter()
        got = self.st.reloading.pop((a.stage, a.micro)).result()
        self.st.wait_s += self.st.clock.held_since(t0)
        self.bg.check()
        assert got is not None, "a reload ended without its input and without a failure"
        x, back = got
        if back is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(back)
            x.record_stream(compute)  # made on the reload stream, read by the recompute
        self.st.reloaded[(a.stage, a.micro)] = x

    # ---- evaluation -----------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, batches: list[MicroBatch]) -> float:
        """Every ``world``-th micro-batch of ``batches`` on this worker, op by op through one slot with the
        newest weights (the master of what trains); the mean loss over all."""
        e, slot = self.e, self.slots[0]
        for unit in self.units:
            unit.train(False)
        mine = list(range(e.rank, len(batches), e.world))
        xs = [batches[m].inputs.to(self.device) for m in mine]
        loss = torch.zeros((), dtype=torch.float64)
        for k in range(self.cuts.num_forward + 1):
            first, end = self.cuts.units(k)
            self._newest_to_slot(slot, self.stores.span(first, end))
            self._bind(slot, self.stores.span(first, end), grads=False)
            self.bound = None
            with autocast(self.device, e.cfg.train.precision):
                for i, m in enumerate(mine):
                    y = run_units(list(self.units[first:end]), xs[i], first, docs=batches[m].docs)
                    if k < self.cuts.num_forward:
                        xs[i] = y.to(e.dtype)
                    else:
                        loss += float(lm_loss_sum(y, batches[m].targets.to(self.device)))
        self.counters.take()  # an evaluation's uploads are not the next step's traffic
        total = sum_over_ranks({"loss": float(loss)})
        return total["loss"] / max(step_targets(batches), 1)

    def _newest_to_slot(self, slot: DeviceSlot, s: Span) -> None:
        """Units of ``s`` into ``slot``: the newest weights (the fp32 master cast) of what trains, the compute
        copy of what is frozen."""
        self._to_slot(slot, self.stores.half(0)[s.lo:s.hi])
        if self.cuda:
            self.bg.streams["copy"].synchronize()
        master = self.stores.host["master"]
        for u in range(s.first, s.end):
            us = self.stores.span(u, u + 1)
            lo = us.lo - s.lo
            slot.params[lo:lo + us.trainable].copy_(master[us.glo:us.ghi])
