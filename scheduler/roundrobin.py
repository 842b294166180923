"""The round-robin runtime: RoundPipe's schedule class (:mod:`partition.schedule.roundrobin`) on stateless
workers.

No stage is bound to a worker: op ``k`` of round ``q`` runs on worker ``(first + q*K + k) mod N``, so every
worker reads every unit's weights and adds into every unit's gradient sums. Those live once, in host memory
all workers map (:class:`~scheduler.shared.UnitStores`), and shared counters order what crosses workers:

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
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
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
from mobius.models.experts import RouterLog, balance_of, recording
from mobius.models.params import build_units
from mobius.optim import UpdateRule
from mobius.states import Moments
from mobius.parallel import ParallelSettings
from partition.plan import Plan
from partition.roundrobin import round_robin_options
from partition.schedule import COMPUTE, Action, Kind
from partition.schedule.roundrobin import RoundRobinSchedule, build_round_robin, rotation_start
from scheduler.counters import Counters
from scheduler.executor import DeviceSlot, batches_on
from scheduler.links import link_to, mailboxes_for, post_early
from scheduler.messages import Messages, trailer_numel
from scheduler.shared import Span, UnitStores, wait_for
from scheduler.stages import add_gradients, add_tied, bind
from scheduler.trace import ComputeSpans, DispatchTime, HeldTrace, StepTrace, by_worker, write_step_trace
from scheduler.updater import CpuUpdater, Events, sum_over_ranks

log = logging.getLogger(__name__)


class _Reduce:
    """A step's statistics summed over the workers: the collective is posted at the step's REDUCE and ended
    by the first that needs its result (the step's updates under a barrier, or ``train_step``), which also ends
    the step for the update rule, after the step before."""

    def __init__(self, stats: dict[str, float], rule: UpdateRule, before: _Reduce | None):
        self.names = sorted(stats)
        self.vec = torch.tensor([stats[k] for k in self.names], dtype=torch.float64)
        self.work = dist.all_reduce(self.vec, async_op=True) if dist.get_world_size() > 1 else None
        self.rule, self.before = rule, before
        self.lock = threading.Lock()
        self.done: tuple[dict[str, float], float, bool, float] | None = None

    def result(self) -> tuple[dict[str, float], float, bool, float]:
        """(the summed statistics, the global norm, whether the step is skipped, the updates' factor)."""
        with self.lock:
            if self.done is None:
                if self.before is not None:
                    self.before.result()
                    self.before = None
                if self.work is not None:
                    self.work.wait()
                total = dict(zip(self.names, self.vec.tolist()))
                self.done = (total, *self.rule.end(total["sumsq"]))
            return self.done


@dataclass
class _Step:
    """What lives for one step of the dispatch thread."""

    sched: RoundRobinSchedule
    index: int  # steps this engine has run before this one
    step: int  # the run's step (dropout seeds)
    micro: list[MicroBatch]  # the step's micro-batches, as the trainer gave them
    loss_factor: float  # loss scale / the step's target tokens
    lr: float
    adam_step: int  # the AdamW step this step's update is (when not skipped)
    aux_weight: float = 0.0  # an MoE's load-balancing loss: its factor on each micro-batch's (mobius.routing)
    routed: routing.StepRouting | None = None  # an MoE's routing over the step on this worker
    choices: dict[tuple[str, int, int], torch.Tensor] = field(default_factory=dict)  # ("a" | "g", op, micro) ->
    # the router choices a received message carried (so far, or all of the micro-batch's)
    logs: dict[tuple[int, int], RouterLog] = field(default_factory=dict)  # (op, micro) -> its recompute's routing
    kept: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # (micro, unit) -> input, until OFFLOAD
    reloads: dict[tuple[int, int], list[Action]] = field(default_factory=dict)  # (op, round) -> its RELOADs,
    # until its UPLOAD starts them
    reloading: dict[tuple[int, int], Future] = field(default_factory=dict)  # (op, micro) -> the input's way back
    reloaded: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # (op, micro) -> input
    graphs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # recomputed
    outputs: dict[tuple[str, int, int], torch.Tensor] = field(default_factory=dict)
    waiting: dict[tuple[str, int, int], object] = field(default_factory=dict)
    uploads: list[Future] = field(default_factory=list)
    d2h: list[Future] = field(default_factory=list)  # the download thread's jobs (offloads, gradient sums)
    downloaded: dict[int, Future] = field(default_factory=dict)  # op -> its last download job
    loss_sum: torch.Tensor | float = 0.0  # this worker's, on the device until REDUCE
    losses: int = 0  # target tokens behind loss_sum
    sumsq: float = 0.0
    wait_s: float = 0.0  # for uploads: the dispatch thread's waits, and the upload thread's for updates and sums
    dispatch_s: float = 0.0  # the dispatch thread's own time: every action outside its compute and what held it,
    # the reduce apart
    computed: ComputeSpans | None = None  # set by the dispatch for its device
    clock: DispatchTime | None = None  # the dispatch thread's time apart from ``computed`` (set with it)
    batches: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])  # (inputs, targets) on it (the dispatch's)
    reduce: _Reduce | None = None  # its statistics over the workers (posted at REDUCE)
    seconds: float = 0.0  # this worker's list, from its first action to its REDUCE
    trace: StepTrace | None = None  # parallel.trace_step's: its spans on the simulator's tracks


class RoundRobinEngine:
    """The round-robin schedule on this worker (rank) of the default process group: the ``Engine`` the
    trainer drives (train step, evaluation, checkpoint state)."""

    def __init__(self, cfg: Config, model_cfg: ModelConfig, plan: Plan, settings: ParallelSettings,
                 device: torch.device, weights_from: WeightSource | None = None, skip_updates: bool = False):
        self.cfg, self.model_cfg, self.device = cfg, model_cfg, device
        self.comm = ProcessGroup()
        self.rank, self.world = self.comm.rank, self.comm.world
        self.is_main = self.rank == 0
        if settings.nodes > 1:
            raise ConfigError("the round-robin schedule runs on one machine (its workers share host memory); "
                              f"this run spans {settings.nodes} nodes: use parallel.schedule=swapped")
        self.cuts = plan.round_robin_cuts()
        self.delayed = plan.options.delayed
        if self.delayed != (cfg.train.update == "delayed"):
            raise MobiusError(f"the plan was made for train.update={'delayed' if self.delayed else 'sync'}, but the "
                              f"run has train.update={cfg.train.update}; plan again for this configuration")
        if plan.options.states != cfg.train.optimizer_states:
            raise MobiusError(f"the plan was made for train.optimizer_states={plan.options.states}, but the run has "
                              f"{cfg.train.optimizer_states}; plan again for this configuration")
        self.dtype = DTYPES[cfg.train.precision]
        self.options = round_robin_options(plan.options)
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
        self.ex = _Dispatch(self, device)
        self.steps_run = 0
        # without fp16 (no loss scale to learn) no step needs the step before's statistics: its uploads wait for
        # the updates they read (the shared counters), so train_step may run the next step's list before it waits
        # for this one's statistics, and its REDUCE need not wait for its updates
        self.looks_ahead = cfg.train.precision != "fp16"
        self.ahead: _Step | None = None  # a step run ahead, whose statistics the next train_step returns
        self.traced = HeldTrace(cfg.train.max_steps)  # parallel.trace_step's trace, until the next step has run
        self.last_reduce: _Reduce | None = None
        self.adam_base = 0  # optimizer steps before this engine's first (no fp16: no step is skipped)
        self.dropout_seed = cfg.train.seed if dropout_active(model_cfg) else None
        self.param_bytes = self.stores.off[-1] * self.dtype.itemsize

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
        :attr:`~partition.schedule.roundrobin.RoundRobinSchedule.tie_readers`) and the head (the fused op)."""
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

    def _run(self, step: int, batches: list[MicroBatch], lr: float) -> _Step:
        """This worker's list of one step, to its REDUCE (posted, not waited for)."""
        index = self.steps_run
        adam_step = self.adam_base + index + 1 if self.looks_ahead else self.rule.optimizer_step + 1
        st = _Step(self.schedule(index), index, step, batches,
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
    """One worker's dispatch: runs its action lists over the shared stores, with an upload thread (the
    copy stream on a GPU), a reload thread (kept inputs back from the stash, on its own stream), a download thread
    (the d2h stream), a summing thread (middle rounds' gradients into the host sums) and the CPU optimizer
    thread."""

    def __init__(self, engine: RoundRobinEngine, device: torch.device):
        self.e, self.device = engine, device
        self.stores, self.cuts, self.counters = engine.stores, engine.cuts, engine.counters
        self.cuda = device.type == "cuda"
        U, K = self.stores.num_units, self.cuts.num_ops
        self.units = build_units(engine.model_cfg, 0, U)
        self.spans = [self.stores.span(*self.cuts.units(k)) for k in range(K)]
        numel, grad_numel = max(s.numel for s in self.spans), max(s.trainable for s in self.spans)
        acc = engine.dtype != torch.float32
        self.slots = [DeviceSlot(numel, grad_numel, engine.dtype, device, acc) for _ in range(2)]
        self.slot_queue = collections.deque(self.slots)  # the next upload's slot first (see _upload)
        self.slot_of: dict[tuple[int, int], DeviceSlot] = {}
        self.bound: tuple[int, int, str] | None = None  # (slot id, op, mode) the unit modules point at
        self.links = self._links()
        self.copier = ThreadPoolExecutor(1, thread_name_prefix="upload")
        self.reloader = ThreadPoolExecutor(1, thread_name_prefix="reload")
        self.downloader = ThreadPoolExecutor(1, thread_name_prefix="download")
        self.summer = ThreadPoolExecutor(1, thread_name_prefix="sum")
        self.freed = threading.Condition()  # a slot's last reader (its gradients' download) has ended
        self.tied_grad: torch.Tensor | None = None  # unit 0's gradient with the tied head's end's added (the
        # optimizer thread's: one update at a time; kept, as a fresh one of an embedding's size costs page faults)
        self.updater = CpuUpdater()
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(device)
            self.reload_stream = torch.cuda.Stream(device)
            self.d2h_stream = torch.cuda.Stream(device)
        self.failure: BaseException | None = None
        self._staging: torch.Tensor | None = None  # (pinned) fp32: a middle round's gradients waiting to be summed
        self._staging_free = threading.Semaphore(1)  # ... taken by its download, given back once they are added
        self._not_adding = threading.Event()  # cleared while the summing thread adds: this worker's updates pause
        self._not_adding.set()  # between blocks then (the sums hold up downloads and slots)
        for opt in self.stores.optimizers:
            opt.pause = self._not_adding.wait
        self.handlers = {Kind.UPLOAD: self._upload, Kind.FREE: self._free, Kind.FORWARD: self._forward,
                         Kind.FB: self._fb, Kind.RECOMPUTE: self._recompute, Kind.BACKWARD: self._backward,
                         Kind.RECV_ACT: self._recv, Kind.RECV_GRAD: self._recv, Kind.SEND_ACT: self._send,
                         Kind.SEND_GRAD: self._send, Kind.OFFLOAD: self._offload, Kind.RELOAD: self._reload,
                         Kind.DOWNLOAD: self._download, Kind.UPDATE: self._update, Kind.REDUCE: self._reduce}

    def _links(self) -> dict:
        """To the workers before and after this one in the ring (no peer-to-peer activations yet), through
        mailboxes sized for the first steps' rotations (page-locked on GPUs; the runs of one machine only)."""
        e = self.e
        lists = (e.schedule(i).actions for i in range(e.world))
        boxes = mailboxes_for(self.device.type, 1, e.world, lists, e.msg.shape, e.dtype)
        return {p: link_to(p, e.rank, self.device, self.counters, boxes=boxes)
                for p in sorted({(e.rank - 1) % e.world, (e.rank + 1) % e.world})}

    # ---- the loop -------------------------------------------------------------------------------
    def run(self, st: _Step, before: _Reduce | None) -> None:
        """This worker's actions of ``st`` (``before``: the previous step's statistics, ended before this one's)."""
        self.st, self.before = st, before
        st.computed = ComputeSpans(self.device)
        st.clock = DispatchTime(st.computed)
        st.batches = (batches_on(self.device, [b.inputs for b in st.micro]),
                      batches_on(self.device, [b.targets for b in st.micro]))
        for unit in self.units:
            unit.train(True)
        post_early(st.sched.actions[self.e.rank], self.links, self._recv)
        for a in st.sched.actions[self.e.rank]:
            if a.kind == Kind.RELOAD:
                st.reloads.setdefault((a.stage, self._round(a.micro)), []).append(a)
        for a in st.sched.actions[self.e.rank]:
            st.computed.last = None
            t0, t1, own = st.clock.run(self.handlers[a.kind], a)
            if a.kind != Kind.REDUCE:  # messages, copies, binding an op to its slot
                st.dispatch_s += own
            if st.trace is None:
                continue
            if a.kind not in COMPUTE:
                st.trace.add("dispatch", str(a), t0, t1)
            elif st.computed.last is not None:  # from after its waits for inputs
                st.trace.add("compute", str(a), *st.computed.last)

    def sync(self) -> None:
        self.updater.sync()
        self.check()

    def check(self) -> None:
        if self.failure is not None:
            raise RuntimeError(f"a copy failed: {type(self.failure).__name__}: {self.failure}") from self.failure
        self.updater.check()

    def close(self) -> None:
        self.copier.shutdown(wait=True)
        self.reloader.shutdown(wait=True)
        self.downloader.shutdown(wait=True)
        self.summer.shutdown(wait=True)
        self.updater.close()

    # ---- weights in ---------------------------------------------------------------------------
    def _ready_version(self, index: int | None = None) -> int:
        """The updates of an op that its uploads of step ``index`` (default: this one) wait for."""
        return (self.st.index if index is None else index) - (1 if self.e.delayed else 0)

    def _upload(self, a: Action) -> None:
        """Op k's upload into the slot uploaded longest ago, which its op frees first (ops compute, free and
        download in the order they were uploaded). The upload thread waits for it to be free: the dispatch thread
        goes on to the next op's compute, in the other slot, while the op before's gradients come down."""
        slot = self.slot_queue.popleft()
        self.slot_queue.append(slot)
        slot.ready.clear()  # its op has computed (its FREE or DOWNLOAD came before this upload)
        self.slot_of[(self.st.index, a.stage, a.round)] = slot
        upload = self.copier.submit(self._copy_job, self.st, a.stage, a.round, slot)
        self.st.uploads.append(upload)
        for r in self.st.reloads.pop((a.stage, a.round), []):  # in the order the op's backwards need them
            self.st.reloading[(r.stage, r.micro)] = self.reloader.submit(self._reload_job, self.st, r, upload)

    def _copy_job(self, st: _Step, k: int, q: int, slot: DeviceSlot) -> torch.cuda.Event | None:
        """(The upload thread) op k's units from step ``st``'s compute copy into ``slot``, once the updates its
        owners had to run have; in a step's last round after the first, a gradient op's host sum of the earlier
        rounds too, once they are down, so that its backward adds onto them (:meth:`_download`). Returns the
        copy's end on a GPU (the op's reloads follow it)."""
        if self.cuda:
            torch.cuda.set_device(self.device)
        try:
            with self.freed:
                self.freed.wait_for(lambda: slot.stage is None or self.failure is not None)
                if self.failure is not None:
                    return
                slot.stage, slot.grads_live = (k, q), False
            version = self._ready_version(st.index)
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
            self.failure = self.failure or e
        finally:
            slot.ready.set()

    def _to_slot(self, slot: DeviceSlot, src: torch.Tensor, trace: StepTrace | None = None, name: str = "",
                 sums: torch.Tensor | None = None) -> None:
        """``src`` into the slot's weights (and ``sums``, fp32, into its gradient sums), once its last reader is
        done."""
        n, moved = src.numel(), src.nbytes + (sums.nbytes if sums is not None else 0)
        if self.cuda:
            with torch.cuda.stream(self.copy_stream):
                if slot.released is not None:
                    self.copy_stream.wait_event(slot.released)
                start = trace.mark(self.copy_stream) if trace is not None else None
                slot.params[:n].copy_(src, non_blocking=True)
                if sums is not None:
                    slot.sums[:sums.numel()].copy_(sums, non_blocking=True)
                slot.ready_event = torch.cuda.Event()
                slot.ready_event.record(self.copy_stream)
                if trace is not None:
                    trace.add("h2d", name, start, trace.mark(self.copy_stream))
        else:
            start = time.perf_counter()
            slot.params[:n].copy_(src)
            if sums is not None:
                slot.sums[:sums.numel()].copy_(sums)
            if trace is not None:
                trace.add("h2d", name, start, time.perf_counter())
        self.counters.add(h2d=moved)

    def _free(self, a: Action) -> None:
        """The op's slot may take the next upload; an op with gradients keeps it until its DOWNLOAD has read
        them."""
        if self.cuts.kind(a.stage) == Kind.FORWARD:
            self._release(self.st.index, a.stage, a.round)

    def _release(self, index: int, k: int, round: int, compute: bool = True) -> None:
        """Op k's slot (of step ``index``'s round ``round``) is free: once the compute stream's work so far has
        ended (``compute``), or now (its gradients' download, which has read them)."""
        slot = self.slot_of.pop((index, k, round))
        slot.released = None
        if self.cuda and compute:
            slot.released = torch.cuda.Event()
            slot.released.record(torch.cuda.current_stream(self.device))
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
        self.check()
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

    # ---- compute --------------------------------------------------------------------------------
    def _run(self, first: int, end: int, x: torch.Tensor, m: int) -> torch.Tensor:
        st = self.st
        seed = (self.e.dropout_seed, st.step, m) if self.e.dropout_seed is not None else None
        return run_units(list(self.units[first:end]), x, first, dropout_seed=seed, docs=st.micro[m].docs)

    def _round(self, m: int) -> int:
        return self.st.sched.round_of(m)

    def _input(self, k: int, m: int) -> torch.Tensor:
        if k == 0:
            return self.st.batches[0][m]
        return self._take("a", k, m)

    def _take(self, kind: str, k: int, m: int) -> torch.Tensor:
        """A received message's activation (or gradient); its router choices go to ``choices``."""
        t, counts = self.e.msg.unpack(self.st.clock.take(self.st.waiting, (kind, k, m)))
        if counts is not None:
            self.st.choices[(kind, k, m)] = counts
        return t

    def _so_far(self, k: int, m: int, log: RouterLog, device: torch.device) -> torch.Tensor | None:
        """Micro-batch m's router choices up to op k's end: those it received and its own (an MoE)."""
        if self.e.balance is None:
            return None
        own = routing.own_counts(log, self.e.balance.experts, device)
        return own + self.st.choices.pop(("a", k, m)).to(device) if k > 0 else own

    def _aux(self, roots: list, grads: list, log: RouterLog | None, counts: torch.Tensor | None) -> None:
        """The aux loss's term of an op's backward (an MoE), given all the micro-batch's choices."""
        routing.backward_roots(roots, grads, self.e.balance, log, counts, self.st.aux_weight, self.st.routed)

    def _forward(self, a: Action) -> None:
        """A forward op over one micro-batch (no autograd); the inputs of units where backward ops start are
        kept for their OFFLOAD."""
        k, m, st = a.stage, a.micro, self.st
        self._on_device(k, self._round(m), grads=False)
        first, end = self.cuts.units(k)
        x = self._input(k, m)
        start = self.st.computed.mark()
        keep = [c for c in self.e.kept_cuts if first < c <= end]
        with torch.no_grad(), autocast(self.device, self.e.cfg.train.precision), recording() as log:
            lo = first
            for u in [c for c in keep if c < end] + [end]:  # [B, T, H] at each cut
                x = self._run(lo, u, x, m).to(self.e.dtype)
                lo = u
                if u in keep:
                    st.kept[(m, u)] = x
        if st.routed is not None:
            st.routed.add(log)
        st.outputs[("a", k, m)] = self.e.msg.pack(x, self._so_far(k, m, log, x.device))
        self.st.computed.add("forward", start, "F", k)

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
        ready = self._compute_so_far()

        def job() -> None:
            self._to_host(self._stash(index, i), x, ready, trace, f"H{a.unit}")
            self.stores.stashed(index)[i] = index + 1

        self.st.d2h.append(self._d2h_job(job))
        self.counters.add(d2h=x.nbytes)

    def _compute_so_far(self) -> torch.cuda.Event | None:
        """An event at the compute stream's work so far (None on the CPU, where it has all run)."""
        if not self.cuda:
            return None
        e = torch.cuda.Event()
        e.record(torch.cuda.current_stream(self.device))
        return e

    def _d2h_job(self, job: Callable[[], None], thread: ThreadPoolExecutor | None = None) -> Future:
        """Queue ``job`` on the download thread (or ``thread``); a failure is kept for the dispatch thread (and
        wakes it)."""
        def run() -> None:
            try:
                if self.cuda:
                    torch.cuda.set_device(self.device)
                job()
            except BaseException as e:
                with self.freed:
                    self.failure = self.failure or e
                    self.freed.notify_all()
                raise
        return (thread or self.downloader).submit(run)

    def _to_host(self, dst: torch.Tensor, src: torch.Tensor, ready: torch.cuda.Event | None,
                 trace: StepTrace | None = None, name: str = "") -> None:
        """(The download thread) ``src`` into host memory ``dst`` once ``ready``; returns when it is there
        (``trace``: its span on the d2h track, as ``name``)."""
        if not self.cuda:
            start = time.perf_counter()
            dst.copy_(src)
            if trace is not None:
                trace.add("d2h", name, start, time.perf_counter())
            return
        with torch.cuda.stream(self.d2h_stream):
            self.d2h_stream.wait_event(ready)
            start = trace.mark(self.d2h_stream) if trace is not None else None
            dst.copy_(src, non_blocking=True)
            if trace is not None:
                trace.add("d2h", name, start, trace.mark(self.d2h_stream))
        self.d2h_stream.synchronize()

    def _reload_job(self, st: _Step, a: Action, upload: Future) -> tuple[torch.Tensor, torch.cuda.Event | None] | None:
        """(The reload thread) a backward op's input back from the stash, once the op's upload is done and the
        forward (on whichever worker) has put the input there; None after another thread's failure."""
        if self.cuda:
            torch.cuda.set_device(self.device)
        uploaded = upload.result()
        i, index = self._entry(a.micro, a.unit), st.index
        stashed = self.stores.stashed(index)
        wait_for(lambda: self.failure is not None or int(stashed[i]) > index,
                 f"micro-batch {a.micro}'s input of unit {a.unit}")
        if self.failure is not None:
            return None
        src, trace, back = self._stash(index, i), st.trace, None
        if self.cuda:
            with torch.cuda.stream(self.reload_stream):
                if uploaded is not None:
                    self.reload_stream.wait_event(uploaded)
                start = trace.mark(self.reload_stream) if trace is not None else None
                x = src.to(self.device, non_blocking=True)
                back = torch.cuda.Event()
                back.record(self.reload_stream)
                if trace is not None:
                    trace.add("h2d", f"L{a.unit}", start, trace.mark(self.reload_stream))
        else:
            start = time.perf_counter()
            x = src.clone()
            if trace is not None:
                trace.add("h2d", f"L{a.unit}", start, time.perf_counter())
        self.counters.add(h2d=x.nbytes)
        return x, back

    def _reload(self, a: Action) -> None:
        """Wait (the dispatch thread, then the compute stream) for the reload thread's copy of a backward op's
        input (:meth:`_reload_job`, started by the op's UPLOAD)."""
        t0 = time.perf_counter()
        got = self.st.reloading.pop((a.stage, a.micro)).result()
        self.st.wait_s += self.st.clock.held_since(t0)
        self.check()
        assert got is not None, "a reload ended without its input and without a failure"
        x, back = got
        if back is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(back)
            x.record_stream(compute)  # made on the reload stream, read by the recompute
        self.st.reloaded[(a.stage, a.micro)] = x

    def _recompute(self, a: Action) -> None:
        """A backward op's forward again, with autograd, from its kept input (the tokens for unit 0)."""
        k, m = a.stage, a.micro
        self._on_device(k, self._round(m), grads=True)
        first, end = self.cuts.units(k)
        x = self.st.reloaded.pop((k, m)) if first > 0 else self.st.batches[0][m]
        start = self.st.computed.mark()
        if x.is_floating_point():
            x = x.detach().requires_grad_()
        with autocast(self.device, self.e.cfg.train.precision), recording() as log:
            self.st.graphs[(k, m)] = (x, self._run(first, end, x, m))
        self.st.logs[(k, m)] = log
        self.st.computed.add("backward", start, "C", k)

    def _backward(self, a: Action) -> None:
        k, m, st = a.stage, a.micro, self.st
        slot = self._on_device(k, self._round(m), grads=True)
        x, y = st.graphs.pop((k, m))
        log = st.logs.pop((k, m))
        g = self._take("g", k, m)
        everything = st.choices.pop(("g", k, m), None)  # an MoE's router choices of all the micro-batch's layers
        start = self.st.computed.mark()
        roots, grads = ([y], [g.to(y.dtype)]) if y.requires_grad else ([], [])  # (frozen units over token ids,
        # LoRA's embedding, have nothing to do)
        self._aux(roots, grads, log, everything)
        if roots:
            torch.autograd.backward(roots, grads)
        add_gradients(slot.pairs)
        if self.cuts.units(k)[0] > 0:
            st.outputs[("g", k, m)] = self.e.msg.pack(x.grad, everything)
        self.st.computed.add("backward", start, "B", k)

    def _fb(self, a: Action) -> None:
        """The fused op: forward, loss and backward of one micro-batch (no recompute)."""
        k, m, st = a.stage, a.micro, self.st
        slot = self._on_device(k, self._round(m), grads=True)
        first, end = self.cuts.units(k)
        x = self._input(k, m).detach().requires_grad_()
        start = self.st.computed.mark()
        with autocast(self.device, self.e.cfg.train.precision), recording() as log:
            loss = lm_loss_sum(self._run(first, end, x, m), st.batches[1][m])
        everything = self._so_far(k, m, log, loss.device)  # the micro-batch's router choices, all known now
        if st.routed is not None:
            st.routed.add(log)
        roots, grads = [loss * st.loss_factor], [None]
        self._aux(roots, grads, log, everything)
        torch.autograd.backward(roots, grads)
        st.loss_sum = st.loss_sum + loss.detach().float()
        st.losses += st.micro[m].target_count
        add_gradients(slot.pairs)
        st.outputs[("g", k, m)] = self.e.msg.pack(x.grad, everything)
        self.st.computed.add("backward", start, "FB", k)

    # ---- activations ----------------------------------------------------------------------------
    def _tag(self, kind: str, sender: int, m: int) -> int:
        return ((0 if kind == "a" else 1) * self.cuts.num_ops + sender) * self.st.sched.micro_batches + m

    def _recv(self, a: Action) -> None:
        kind = "a" if a.kind == Kind.RECV_ACT else "g"
        if (kind, a.stage, a.micro) in self.st.waiting:  # posted when the step began
            return
        self.st.waiting[(kind, a.stage, a.micro)] = self.links[a.peer].recv(self.e.msg.shape, self.e.dtype,
                                                                            self._tag(kind, a.stage - 1, a.micro))

    def _send(self, a: Action) -> None:
        kind = "a" if a.kind == Kind.SEND_ACT else "g"
        t = self.st.outputs.pop((kind, a.stage, a.micro))
        self.links[a.peer].send(t.to(self.e.dtype), self._tag(kind, a.stage, a.micro))

    # ---- gradients and updates ------------------------------------------------------------------
    def _download(self, a: Action) -> None:
        """Round ``a.round``'s gradient sums of op k to host memory (the download thread), and the slot is free.
        The first round of a step comes straight into the host sum, once the last update to read it (the step
        before's, or the one before that under delayed; a tied weight's other end too) has; so does the last,
        which took the earlier rounds' sums up (:meth:`_copy_job`) and is the step's total, whose share of the norm
        it reads on the device. A middle round comes into the staging buffer, which the summing thread then adds
        into the host sum after the rounds before."""
        k, q, st = a.stage, a.round, self.st
        s, slot, R, index = self.spans[k], self.slot_of[(st.index, k, a.round)], st.sched.rounds, st.index
        readers = (k, *(o for o in st.sched.tie_readers if k in self.e.tied and o != k)) if q == 0 else ()
        src, ready = slot.sums[:s.trainable], self._compute_so_far()
        done = index * R + q  # rounds of op k summed before this one
        dst = self.stores.grad(index)[s.glo:s.ghi]
        whole = q in (0, R - 1)  # straight into the host sum

        def copy() -> None:
            for o in readers:
                wait_for(lambda o=o: int(self.stores.version[o]) >= self._ready_version(index),
                         f"the update of op {o} that reads its gradient sums")
            if q == 0:  # the previous step's rounds are summed first (the sum counts in order)
                wait_for(lambda: int(self.stores.summed[k]) >= done, f"op {k}'s gradients of the step before")
            elif not whole:
                self._staging_free.acquire()
            self._to_host(dst if whole else self._staged(src.numel()), src, ready, st.trace, f"D{k}")
            if q == R - 1:
                st.sumsq += self._sumsq(k, src)  # (on the device, down before its slot is free)
            self._release(index, k, q, compute=False)
            if whole:
                self.stores.summed[k] = done + 1

        def add(copied: Future) -> None:
            try:
                copied.result()
                wait_for(lambda: int(self.stores.summed[k]) >= done, f"round {q - 1} of op {k}'s gradients")
                self._not_adding.clear()
                start = time.perf_counter()
                dst.add_(self._staged(src.numel()))
                if st.trace is not None:
                    st.trace.add("cpu", f"+{k}", start, time.perf_counter())
            finally:
                self._not_adding.set()
                self._staging_free.release()
            self.stores.summed[k] = done + 1

        copied = self._d2h_job(copy)
        st.downloaded[k] = copied if whole else self._d2h_job(lambda: add(copied), self.summer)
        st.d2h += [copied, st.downloaded[k]]
        self.counters.add(d2h=s.trainable * 4)

    def _staged(self, numel: int) -> torch.Tensor:
        """The staging buffer's first ``numel`` elements (pinned on a GPU's host; made on first use)."""
        if self._staging is None:
            self._staging = torch.empty(max(sp.trainable for sp in self.spans), dtype=torch.float32,
                                        pin_memory=self.cuda)
        return self._staging[:numel]

    def _sumsq(self, k: int, g: torch.Tensor) -> float:
        """The op's share of the squared gradient norm; a tied weight's end is left out (rank 0 counts the sum
        of both ends at REDUCE)."""
        if k not in self.e.tied:
            return float(torch.dot(g, g))
        _, mine, _ = self.e.tied[k]
        lo, hi = mine.start - self.spans[k].glo, mine.stop - self.spans[k].glo
        a, b = g[:lo], g[hi:]
        return float(torch.dot(a, a) + torch.dot(b, b))

    def _tied_sumsq(self) -> float:
        st, R = self.st, self.st.sched.rounds
        ops = list(self.e.tied)
        for o in ops:
            wait_for(lambda o=o: int(self.stores.summed[o]) >= (st.index + 1) * R, f"op {o}'s gradients")
        grad = self.stores.grad(st.index)
        _, ea, eb = self.e.tied[ops[0]]
        return add_tied(grad[ea], grad[eb])

    def _update(self, a: Action) -> None:
        """Queue the CPU AdamW of op k's units on the optimizer thread. After the step's REDUCE (a barrier) it
        first takes the step's factor and overflow check from the statistics over the workers; the embedding's
        end of a tied weight waits for the head's gradients and takes their sum (the stores copy the result into
        the head's end)."""
        k, st = a.stage, self.st
        lr, index, adam_step, R = st.lr, st.index, st.adam_step, st.sched.rounds
        reduced = st.reduce  # None before the REDUCE: no barrier, so no clipping and no fp16 (factor 1)
        s = self.spans[k]
        reads_tie = k in self.e.tied and k in st.sched.tie_readers

        def inputs() -> None:  # what the update waits for, outside the time it counts as the CPU AdamW's
            st.downloaded[k].result()
            if reduced is not None:
                reduced.result()
            if reads_tie:
                other, _, _ = self.e.tied[k]
                wait_for(lambda: int(self.stores.summed[other]) >= (index + 1) * R, f"op {other}'s gradients")

        def update() -> int:
            factor, skip = 1.0, False
            if reduced is not None:
                _, _, skip, factor = reduced.result()
            skip = skip or self.e.skip_updates
            grad = self.stores.grad(index)
            n = 0
            for u in range(s.first, s.end):
                us = self.stores.span(u, u + 1)
                g = grad[us.glo:us.ghi]
                if reads_tie and u == 0:
                    _, mine, theirs = self.e.tied[k]
                    if self.tied_grad is None or self.tied_grad.numel() < g.numel():
                        self.tied_grad = torch.empty(g.numel(), dtype=g.dtype)
                    g = self.tied_grad[:g.numel()].copy_(g)  # the shared sums stay as they are (rank 0's norm
                    # of the tied weight may still read them)
                    g[mine.start - us.glo:mine.stop - us.glo] += grad[theirs]
                n += self.stores.update(u, g, lr, factor, adam_step, skip, index)
            self.stores.version[k] = index + 1
            return n

        timed = (lambda t0, t1: st.trace.add("cpu", f"O{k}", t0, t1)) if st.trace is not None else None
        self.updater.submit(update, _Waited(inputs), Events(), timed)  # waiters read `version` instead

    def _reduce(self, a: Action) -> None:
        """The end of this worker's step: its sends, uploads and downloads finished, then its statistics posted to
        the sum over the workers (:class:`_Reduce`: the global norm, the fp16 overflow check, the factor)."""
        st = self.st
        for link in self.links.values():
            link.flush()
        for f in st.uploads + st.d2h:
            f.result()
        assert not st.reloading and not st.reloads, "reloads the step's list started but did not wait for"
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self.check()
        if self.e.tied and self.e.is_main:
            st.sumsq += self._tied_sumsq()
        adam_s, adam_params = self.updater.take()
        moved = self.counters.take()
        st.reduce = _Reduce({**(st.routed.stats() if st.routed is not None else {}),
                             "loss_sum": float(st.loss_sum), "losses": float(st.losses), "sumsq": st.sumsq,
                             "upload_wait_s": st.wait_s, "cpu_adam_s": adam_s, "cpu_adam_params": adam_params,
                             **st.computed.stats(self.e.rank, self.e.world), "dispatch_s": st.dispatch_s,
                             **{f"{kind}_bytes": float(n) for kind, n in moved.items()}},
                            self.e.rule, self.before)

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
            self.copy_stream.synchronize()
        master = self.stores.host["master"]
        for u in range(s.first, s.end):
            us = self.stores.span(u, u + 1)
            lo = us.lo - s.lo
            slot.params[lo:lo + us.trainable].copy_(master[us.glo:us.ghi])


class _Waited:
    """What an update waits for, as the optimizer thread waits (``synchronize``: ``wait()``, raising its failure)."""

    def __init__(self, wait: Callable[[], None]):
        self.synchronize = wait
