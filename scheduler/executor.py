"""The dispatcher: runs one worker's action list (:mod:`partition.schedule`).

Threads and streams (see scheduler/README.md for who owns which buffer and event):

* the **dispatch thread** (the caller of :meth:`Executor.run`) walks the action list, enqueues
  compute on the compute stream, sends and receives activations, and blocks only where data must
  be present (a residency's upload, a received activation);
* the **upload thread** copies a stage's half-precision weights from its pinned host copy into a
  device slot on the copy stream, in chunks served in stage order per root complex
  (:class:`~scheduler.arbiter.UploadArbiter`);
* the **download stream** brings each stage's gradient sums (fp32, or rounded to the half dtype)
  to its pinned host buffer;
* the **optimizer thread** runs each stage's CPU AdamW (``UPDATE``) once its gradients are down
  (``train.update: delayed``: the copy of the master into the upload copy, which is all the next
  step's uploads wait for, is queued by the step's last upload of the stage, ahead of every AdamW
  once the stage's earlier AdamWs have run; :class:`~scheduler.store.StageStore`).

Device memory holds ``num_slots`` *slots* (the running stage and the prefetched one), each with
the stage's half-precision parameters, their gradients and an fp32 gradient sum -- or, with one
slot, a *prefetch buffer* for the first elements of the next stage's parameters (``PREFETCH``; its
``UPLOAD`` moves them into the slot on the device and copies the rest); a permanent slot
per *resident* stage, beside its fp32 master and AdamW moments (updated on the compute stream,
``DEVICE_UPDATE``); the boundary activations of the stages in flight, or the autograd graphs of
*kept* stages (their backward reuses the forward's graph instead of recomputing); nothing else. A
stage's parameters live in its slot as views, so the unit modules (built once on the meta device)
compute on whatever slot holds them.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from mobius import routing
from mobius.batch import MicroBatch
from mobius.engine import autocast
from mobius.models import ModelConfig
from mobius.models.base import lm_loss_sum, run_units
from mobius.models.experts import RouterLog, balance_of, recording
from mobius.optim import UpdateRule
from partition.schedule import COMPUTE, Action, Kind, PipelineOptions, Schedule
from scheduler.arbiter import UploadArbiter
from scheduler.counters import Counters
from scheduler.links import post_early
from scheduler.messages import Messages
from scheduler.shared import WAIT_TIMEOUT_S
from mobius.models.params import build_units
from scheduler.stages import StageLayout, add_gradients, add_tied, bind
from scheduler.store import StageStore
from scheduler.trace import ComputeSpans, DispatchTime, StepTrace
from scheduler.updater import CpuUpdater

log = logging.getLogger(__name__)
UPLOAD_CHUNK = 64 << 20  # bytes per arbitrated upload chunk
ORDER_STRIDE = 1 << 20  # upload orders of consecutive steps never interleave


@dataclass(frozen=True)
class ExecutorOptions:
    """Everything about how this worker runs that is fixed for the whole run: the plan's pipeline
    settings (the schedules' own :class:`~partition.schedule.PipelineOptions`) and the runtime's."""

    pipeline: PipelineOptions  # slots, resident / kept stages, gradient dtype, ... as planned
    precision: str  # fp32 | bf16 | fp16 (autocast)
    dtype: torch.dtype  # half-precision copy on the device (fp32 when precision is fp32)
    activation_shape: tuple[int, int, int]  # [B, T, H] of a boundary activation
    tied: tuple[tuple[int, int, int], ...] = ()  # (stage, offset, numel) of a tied weight's ends on two stages
    skip_updates: bool = False  # benchmark ablation: no AdamW (the GPU side alone)
    trailer: int = 0  # elements after the activation in each message: an MoE's router choices (scheduler/messages)

    @property
    def messages(self) -> Messages:
        return Messages(self.activation_shape, self.dtype, self.trailer)

    @property
    def half_grads(self) -> bool:
        """Gradients come down rounded to the half dtype, into the stage's half copy."""
        return self.pipeline.grad_dtype == "half"

    @property
    def step_waits_for_updates(self) -> bool:
        """Whether a step without a barrier ends only when its CPU updates have (sync: the next step's
        uploads would wait for them anyway); a delayed step's updates run beside the next step."""
        return not self.pipeline.delayed


@dataclass
class StepIO:
    batches: list[MicroBatch]  # the step's micro-batches (token ids, targets, documents)
    step: int
    loss_factor: float  # loss scale / the step's target tokens (each micro-batch's loss is its sum)
    dropout_seed: int | None  # the run's seed when dropout is active
    lr: float = 0.0
    training: bool = True  # False: an evaluation (dropout off)
    aux_weight: float = 0.0  # an MoE's load-balancing loss: its factor on each micro-batch's (mobius.routing)


@dataclass
class StepOutcome:
    """A step as every worker saw it (statistics already summed over workers, by name)."""

    loss: float  # mean over the step's target tokens
    grad_norm: float  # global, before clipping (inf on fp16 overflow); 0 in evaluation
    skipped: bool  # fp16 overflow: no update
    stats: dict[str, float]


class Collectives:
    """What the executor needs from the other workers: a sum of named statistics and a swap of
    one tensor with a peer (given by the engine, which owns the process group)."""

    def __init__(self, reduce: Callable[[dict[str, float]], dict[str, float]],
                 exchange: Callable[[torch.Tensor, int], torch.Tensor]):
        self.reduce, self.exchange = reduce, exchange


@dataclass
class Graph:
    """A kept stage's forward: its input (with ``requires_grad``) and output, graph attached; for a
    swapped stage also the parameters the graph accumulates into (re-pointed at the backward's slot)."""

    x: torch.Tensor
    y: torch.Tensor
    params: tuple[torch.Tensor, ...] = ()
    log: RouterLog | None = None  # an MoE's routing in that forward (its probabilities' graph too)


@dataclass(frozen=True)
class SlotView:
    """A tensor a kept graph saved that is a view of its stage's slot, by position in the slot."""

    offset: int  # elements from the start of the slot's parameter buffer
    shape: tuple[int, ...]
    stride: tuple[int, ...]


class DeviceSlot:
    """One stage's worth of device memory: parameters, gradients of what trains (and their fp32
    accumulator). A resident stage's slot computes on its store's half copy (``params``) and is never
    freed."""

    def __init__(self, numel: int, grad_numel: int, dtype: torch.dtype, device: torch.device, accumulate_fp32: bool,
                 params: torch.Tensor | None = None):
        self.params = torch.empty(numel, dtype=dtype, device=device) if params is None else params
        self.grads = torch.zeros(grad_numel, dtype=dtype, device=device)
        self.acc = torch.zeros(grad_numel, dtype=torch.float32, device=device) if accumulate_fp32 else None
        self.stage: int | None = None
        self.ready = threading.Event()  # set by the upload thread once the copy is enqueued (or done, on the CPU)
        self.ready_event: torch.cuda.Event | None = None  # upload finished (CUDA)
        self.released: torch.cuda.Event | None = None  # last use finished (CUDA); the next upload waits on it
        self.grads_live = False  # gradients zeroed for this residency
        self.bound: tuple[int, str] | None = None  # (stage, "grads" | "graph" | "infer") the modules point here for
        self.pairs: list[tuple[nn.Parameter, torch.Tensor]] = []  # with ``acc``: (bound parameter, its fp32 sum)
        self.bindings: dict[tuple, tuple[list[tuple[nn.Module, str, nn.Parameter]], list]] = {}  # see point()

    @property
    def sums(self) -> torch.Tensor:
        """The gradients summed over the step's micro-batches: the fp32 accumulator in half precision, the
        gradient buffer itself in fp32."""
        return self.acc if self.acc is not None else self.grads

    def point(self, key: tuple, units: nn.Module, make: Callable[[], list[tuple[nn.Parameter, torch.Tensor]]]) -> None:
        """Point ``units``' parameters at this slot's buffers the way ``key`` names (what computes and how): the
        first time through ``make`` (:func:`~scheduler.stages.bind`, which returns the gradient pairs), after that
        by putting back the parameters it made. Making them costs about 40 us a parameter (an op of 3 GPT-2
        blocks, 36 parameters: 1.5 ms of the dispatch thread at every switch), putting them back a dict store
        each. The parameters are views of the slot's buffers, which never move."""
        if key not in self.bindings:
            pairs = make()
            self.bindings[key] = ([(m, leaf, p) for m in units.modules() for leaf, p in m._parameters.items()
                                   if p is not None], pairs)
        params, self.pairs = self.bindings[key]
        for module, leaf, param in params:
            module._parameters[leaf] = param

    def gradients_to(self, lo: int, hi: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Where elements ``[lo, hi)`` of a backward's gradients go, as :func:`~scheduler.stages.bind` takes them
        (``grads``, ``sums``): in fp32 ``.grad`` views autograd accumulates into; in half precision the fp32
        sums, each micro-batch's handed over to :func:`~scheduler.stages.add_gradients`."""
        return (None, self.acc[lo:hi]) if self.acc is not None else (self.grads[lo:hi], None)


def batches_on(device: torch.device, ts: list[torch.Tensor]) -> list[torch.Tensor]:
    """A step's token ids (or targets) on ``device``, copied when the step begins: pinned and asynchronous on a
    GPU, where a copy from pageable memory first waits for the stream's queued work, so that the host would stall
    at every micro-batch; CPU workers use them as they are."""
    if device.type != "cuda":
        return ts
    return [t.pin_memory().to(device, non_blocking=True) for t in ts]


@dataclass
class StepState:
    """Per-step state of the dispatch thread (a fresh one for every :meth:`Executor.run`)."""

    io: StepIO
    sched: Schedule
    batches: dict[str, list[torch.Tensor]]
    trace: StepTrace | None
    order_base: int
    saved: dict[tuple[int, int], object] = field(default_factory=dict)  # (stage, micro) -> boundary input or Graph
    outputs: dict[tuple[str, int, int], torch.Tensor] = field(default_factory=dict)  # waiting to be sent
    waiting: dict[tuple[str, int, int], Callable[[], torch.Tensor]] = field(default_factory=dict)  # posted receives
    loss_sum: torch.Tensor | float = 0.0  # on the device until REDUCE (no host sync per micro-batch)
    losses: int = 0  # target tokens behind loss_sum
    stall_s: float = 0.0  # compute stream idle waiting for stage data (GPU events; host time on the CPU)
    wait_s: float = 0.0  # dispatch thread blocked on uploads (which wait for the stage's CPU update)
    dispatch_s: float = 0.0  # dispatch thread's own time: every action outside its compute and what held it, the
    # tied ends' sum and the reduce apart
    tie_s: float = 0.0  # dispatch thread summing the tied ends' gradients (host time; counted in reduce_s)
    reduce_wait_s: float = 0.0  # the reduce waiting for this worker's transfers and device work to end
    uploads: list[Future] = field(default_factory=list)
    prefetched: dict[int, int] = field(default_factory=dict)  # stage -> its first elements in the prefetch buffer
    reloads: dict[int, Future] = field(default_factory=dict)  # stage -> its offloaded inputs' way back
    stall_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = field(default_factory=list)
    computed: ComputeSpans | None = None  # set by Executor.run for its device
    clock: DispatchTime | None = None  # the dispatch thread's time apart from ``computed`` (set with it)
    arrived: dict[int, torch.cuda.Event | None] = field(default_factory=dict)  # stage -> its gradients' download
    head_down: threading.Event = field(default_factory=threading.Event)  # the last stage's DOWNLOAD issued (or the
    # step abandoned): stage 0's backward upload may bring the head's tied gradient up (``Schedule.tie_in``)
    sumsq: list[torch.Tensor] = field(default_factory=list)  # per stage, on the device
    tied_sumsq: float = 0.0
    factor: float = 1.0  # gradient multiplier of this step's updates (clipping / loss scale)
    skipped: bool = False
    outcome: StepOutcome | None = None
    routed: routing.StepRouting | None = None  # an MoE's routing over the step (training)
    choices: dict[tuple[str, int, int], torch.Tensor] = field(default_factory=dict)  # ("a" | "g", stage, micro)
    # -> the router choices a received message carried (so far, or all of the micro-batch's)


class _UpdateEnd:
    """What a stage's CPU update sets when it ends or fails: ``consumed`` (the next download may come; in sync the
    same event as ``updated``), after counting it run (a compute copy waiting for it may go)."""

    def __init__(self, host: StageStore):
        self.host = host

    def set(self) -> None:
        self.host.updates_run += 1
        self.host.consumed.set()


class Executor:
    """Runs schedules for one worker (``rank``) over its swapped stages' host stores (``hosts``) and
    its resident stages' device stores (``resident``)."""

    def __init__(self, rank: int, device: torch.device, model_cfg: ModelConfig, layouts: list[StageLayout],
                 hosts: dict[int, StageStore], links: dict, arbiter: UploadArbiter, counters: Counters,
                 collectives: Collectives, rule: UpdateRule, options: ExecutorOptions,
                 resident: dict[int, StageStore] | None = None):
        self.rank, self.device, self.layouts, self.hosts = rank, device, layouts, hosts
        self.resident = resident or {}
        self.links, self.arbiter, self.counters, self.coll = links, arbiter, counters, collectives
        self.rule, self.opt = rule, options
        self.num_units = layouts[-1].end_unit
        mine = sorted(set(hosts) | set(self.resident))
        self.units = {j: build_units(model_cfg, layouts[j].first_unit, layouts[j].end_unit) for j in mine}
        acc = options.dtype != torch.float32
        numel = max((layouts[j].numel for j in hosts), default=0)
        grad_numel = max((layouts[j].trainable_numel for j in hosts), default=0)
        self.slots = [DeviceSlot(numel, grad_numel, options.dtype, device, acc)
                      for _ in range(options.pipeline.num_slots if hosts else 0)]
        item = torch.empty(0, dtype=options.dtype).element_size()
        prefetch = min(numel, options.pipeline.prefetch_bytes // item) if hosts else 0
        self.buffer = torch.empty(prefetch, dtype=options.dtype, device=device)  # partial prefetch (one slot)
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(device)
            self.d2h_stream = torch.cuda.Stream(device)
        self.copier = ThreadPoolExecutor(1, thread_name_prefix="upload")
        self.updater = CpuUpdater()
        self.tied = {j: (o, n) for j, o, n in options.tied if j in hosts}
        self.balance = balance_of(model_cfg)  # an MoE's load-balancing loss (None: dense)
        self.moe_layers = getattr(model_cfg, "moe_layers", ())
        self.msg = options.messages
        self.slot_of: dict[int, DeviceSlot] = {}
        for j, store in self.resident.items():  # permanent slots
            slot = DeviceSlot(layouts[j].numel, layouts[j].trainable_numel, options.dtype, device, acc, params=store.half)
            slot.stage = j
            slot.ready.set()
            self.slot_of[j] = slot
        self.failure: BaseException | None = None  # from the upload thread, raised by check()
        self._runs = 0
        self.handlers: dict[Kind, Callable[[Action], None]] = {
            Kind.UPLOAD: self._upload, Kind.PREFETCH: self._prefetch, Kind.FREE: self._free,
            Kind.FORWARD: self._forward, Kind.FB: self._fb,
            Kind.BACKWARD: self._backward, Kind.RECV_ACT: self._recv, Kind.RECV_GRAD: self._recv,
            Kind.SEND_ACT: self._send, Kind.SEND_GRAD: self._send, Kind.OFFLOAD: self._offload,
            Kind.RELOAD: self._reload, Kind.DOWNLOAD: self._download,
            Kind.UPDATE: self._update, Kind.DEVICE_UPDATE: self._device_update, Kind.TIE: self._tie,
            Kind.REDUCE: self._reduce}

    # ---- the dispatch loop ----------------------------------------------------------------------
    def run(self, sched: Schedule, io: StepIO, trace: StepTrace | None = None) -> StepOutcome:
        """Dispatch this worker's actions of ``sched``; returns after its REDUCE (updates that
        follow a barrier keep running on the optimizer thread)."""
        self._runs += 1
        for units in self.units.values():
            units.train(io.training)
        self.st = StepState(io, sched, self._stage_batches(sched, io), trace, self._runs * ORDER_STRIDE,
                            computed=ComputeSpans(self.device))
        if self.balance is not None and sched.train:
            self.st.routed = routing.StepRouting(self.balance, self.moe_layers)
        self.st.clock = DispatchTime(self.st.computed)
        post_early(sched.actions[self.rank], self.links, self._recv)
        try:
            for action in sched.actions[self.rank]:
                self._dispatch(action, trace)
        finally:
            self.st.head_down.set()  # an upload waiting for the head's download goes on (and fails, if it never came)
        assert self.st.outcome is not None
        return self.st.outcome

    def _dispatch(self, action: Action, trace: StepTrace | None) -> None:
        st = self.st
        st.computed.last = None
        t0, t1, own = st.clock.run(self.handlers[action.kind], action)
        if action.kind == Kind.TIE:  # the step's end apart (the tied ends' sum and the reduce: reduce_s)
            st.tie_s += t1 - t0
        elif action.kind != Kind.REDUCE:  # messages, uploads issued, downloads, binding a stage to its slot
            st.dispatch_s += own
        if trace is None:
            return
        if action.kind not in COMPUTE:
            trace.add("dispatch", str(action), t0, t1)
        elif st.computed.last is not None:  # from after its waits for inputs
            trace.add("compute", str(action), *st.computed.last)

    def sync(self) -> None:
        """Wait for every queued CPU update, all of it (under delayed the AdamW after the copy too),
        and surface a failure of one."""
        self.updater.sync()
        for host in self.hosts.values():
            host.updated.wait()
            host.consumed.wait()
        self.check()

    def check(self) -> None:
        """Raise on the dispatch thread what failed on a background thread (uploads, CPU updates)."""
        if self.failure is not None:
            raise RuntimeError(f"a background task failed: {type(self.failure).__name__}: {self.failure}") \
                from self.failure
        self.updater.check()

    def close(self) -> None:
        self.copier.shutdown(wait=True)
        self.updater.close()

    # ---- swaps ----------------------------------------------------------------------------------
    def _prefetch(self, a: Action) -> None:
        """The first elements of stage j's weights into the prefetch buffer (one slot): its UPLOAD,
        once the slot is free, moves them into the slot and copies only the rest."""
        n = min(self.buffer.numel(), self.layouts[a.stage].numel)
        self.st.prefetched[a.stage] = n
        order = self.st.order_base + self.st.sched.upload_order[(a.stage, a.phase)]
        self.st.uploads.append(self.copier.submit(self._copy_job, self.st, a.stage, None, order, 0, n))

    def _upload(self, a: Action) -> None:
        slot = next(s for s in self.slots if s.stage is None)
        slot.stage, slot.grads_live, slot.bound = a.stage, False, None
        slot.ready.clear()
        self.slot_of[a.stage] = slot
        order = self.st.order_base + self.st.sched.upload_order[(a.stage, a.phase)]
        tie_in = self.st.sched.tie_in and a.stage == 0 and a.phase == "b"
        last = self.st.sched.train and self.hosts[a.stage].delayed and self.st.sched.last_uploads[a.stage] == a.phase
        self.st.uploads.append(self.copier.submit(self._copy_job, self.st, a.stage, slot, order,
                                                  self.st.prefetched.pop(a.stage, 0), self.layouts[a.stage].numel,
                                                  tie_in, last))

    def _copy_job(self, st: StepState, j: int, slot: DeviceSlot | None, order: int, lo: int, hi: int,
                  tie_in: bool = False, refresh: bool = False) -> None:
        """(The upload thread) elements ``lo:hi`` of stage j's weights from its host copy: into ``slot``,
        whose first ``lo`` come from the prefetch buffer (a copy on the device); or, without a slot
        (``PREFETCH``, ``lo`` 0), into the prefetch buffer. ``tie_in``: then the head's end of the tied
        weight's gradient into the slot's sums (:meth:`_tied_gradient_in`); ``refresh``: the step's last read
        of a delayed store's compute copy, which then takes the master (:meth:`_refresh_compute`)."""
        if self.cuda:
            torch.cuda.set_device(self.device)  # this thread's current device
        try:
            self._copy(st, j, slot, order, lo, hi, tie_in)
            if refresh:
                self._refresh_compute(st, j, slot)
        except BaseException as e:  # surfaced by check() on the dispatch thread
            self.failure = self.failure or e
            self.arbiter.release()
        finally:
            if slot is not None:
                slot.ready.set()

    def _copy(self, st: StepState, j: int, slot: DeviceSlot | None, order: int, lo: int, hi: int,
              tie_in: bool = False) -> None:
        host = self.hosts[j]
        host.wait_ready()  # the CPU update of the previous step has written this stage's copy (delayed: the
        # compute copy, taken after the previous step's last upload of the stage)
        if self.failure is not None:
            raise RuntimeError("not uploading after an earlier failure")
        dst = slot.params if slot is not None else self.buffer
        step = max(1, UPLOAD_CHUNK // dst.element_size())
        trace = st.trace
        if self.cuda:
            with torch.cuda.stream(self.copy_stream):
                if slot is not None and slot.released is not None:
                    self.copy_stream.wait_event(slot.released)
                start = trace.mark(self.copy_stream) if trace is not None else None
                dst[:lo].copy_(self.buffer[:lo], non_blocking=True)  # the prefetched part, on the device
                for a, b, src in host.upload_pieces(lo, hi):  # a tied end from the embedding's store
                    for c in range(a, b, step):
                        self.arbiter.acquire(order)
                        dst[c:min(c + step, b)].copy_(src[c - a:min(c + step, b) - a], non_blocking=True)
                        if self.arbiter.peers:
                            self.copy_stream.synchronize()  # the next chunk is arbitrated again
                self.arbiter.release()
                moved = self._tied_gradient_in(st, slot, order) if tie_in else 0
                if slot is not None:
                    slot.ready_event = torch.cuda.Event()
                    slot.ready_event.record(self.copy_stream)
        else:
            start = trace.mark() if trace is not None else None
            dst[:lo].copy_(self.buffer[:lo])
            self.arbiter.acquire(order)
            for a, b, src in host.upload_pieces(lo, hi):
                dst[a:b].copy_(src)
            self.arbiter.release()
            moved = self._tied_gradient_in(st, slot, order) if tie_in else 0
        self.counters.add(h2d=(hi - lo) * dst.element_size() + moved)
        if trace is not None:
            trace.add("h2d", f"{'U' if slot is not None else 'P'}{j}", start,
                      trace.mark(self.copy_stream if self.cuda else None))

    def _refresh_compute(self, st: StepState, j: int, slot: DeviceSlot | None) -> None:
        """(The upload thread, delayed) the step's last upload of stage j is enqueued: its compute copy takes the
        master (w_{t-1}, what the next step computes with) once that upload has read it and the stage's AdamWs
        queued so far have run, ahead of every other waiting job; the next step's uploads wait for it
        (``updated``). Queued here rather than when the gradients land, so the copy is off the path from the
        step's last backward to the next step's first forward."""
        host = self.hosts[j]
        host.updated.clear()
        queued = host.updates_queued  # this step's AdamW is queued after the backward that waits for this upload
        read = slot.ready_event if self.cuda and slot is not None else None
        timed = (lambda t0, t1: st.trace.add("cpu", f"K{j}", t0, t1)) if st.trace is not None else None
        self.updater.submit(host.to_compute, read, host.updated, timed, first=True,
                            after=lambda: host.updates_run >= queued)

    def _tied_gradient_in(self, st: StepState, slot: DeviceSlot | None, order: int) -> int:
        """(The upload thread, after stage 0's weights; on the copy stream) one worker holds both ends of the tied
        weight: the slot's gradient sums zeroed and the head's end's gradient, down since the head's DOWNLOAD, put
        in the tied range, so that stage 0's backward adds onto it and its download is the weight's whole
        gradient (no sum on the host). Returns the bytes moved."""
        assert slot is not None
        last, n_sums = st.sched.num_stages - 1, self.layouts[0].trainable_numel
        if not st.head_down.wait(WAIT_TIMEOUT_S) or last not in st.arrived:
            raise RuntimeError("the head's gradients never came down: the step ended before their download")
        (lo, n), (head_lo, _) = self.tied[0], self.tied[last]
        src = self.hosts[last].grads_in[head_lo:head_lo + n]  # fp32, or the half dtype
        sums = slot.sums[lo:lo + n]
        if self.cuda and st.arrived[last] is not None:
            self.copy_stream.wait_event(st.arrived[last])
        slot.sums[:n_sums].zero_()
        self.arbiter.acquire(order)
        if src.dtype == sums.dtype:
            sums.copy_(src, non_blocking=self.cuda)
        else:  # through the slot's half gradients, free until the backward: no temporary of the weight's size
            sums.copy_(slot.grads[lo:lo + n].copy_(src, non_blocking=self.cuda))
        self.arbiter.release()
        slot.grads_live = True  # set before the slot is ready: the backward does not zero the sums again
        return n * src.element_size()

    def _offload(self, a: Action) -> None:
        """A forward's boundary input to pinned host memory until the stage's backward."""
        key = (a.stage, a.micro)
        x = self.st.saved[key]
        self.counters.add(d2h=x.nbytes)
        if not self.cuda:
            self.st.saved[key] = ("host", x.clone(), None)
            return
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.d2h_stream):
            self.d2h_stream.wait_event(ready)
            host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
            host.copy_(x, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.d2h_stream)
        x.record_stream(self.d2h_stream)  # its memory is reused only after the copy has read it
        self.st.saved[key] = ("host", host, done)

    def _reload(self, a: Action) -> None:
        """Stage j's offloaded inputs back, on the upload thread right after its backward upload
        (the backward waits for them as for the upload)."""
        self.st.reloads[a.stage] = self.copier.submit(self._reload_job, self.st, a.stage)

    def _reload_job(self, st: StepState, j: int) -> torch.cuda.Event | None:
        if self.cuda:
            torch.cuda.set_device(self.device)
        for m in range(st.sched.micro_batches):
            _, host, done = st.saved[(j, m)]
            self.counters.add(h2d=host.nbytes)
            if self.cuda:
                with torch.cuda.stream(self.copy_stream):
                    self.copy_stream.wait_event(done)
                    dev = host.to(self.device, non_blocking=True)
                    dev.record_stream(torch.cuda.current_stream(self.device))
            else:
                dev = host.clone()
            st.saved[(j, m)] = dev
        if not self.cuda:
            return None
        back = torch.cuda.Event()
        back.record(self.copy_stream)
        return back

    def _inputs_back(self, j: int) -> None:
        """Wait (the dispatch thread, then the compute stream) for stage j's reloaded inputs."""
        job = self.st.reloads.pop(j, None)
        if job is None:
            return
        t0 = time.perf_counter()
        back = job.result()
        self.st.wait_s += self.st.clock.held_since(t0)
        if back is not None:
            torch.cuda.current_stream(self.device).wait_event(back)

    def _free(self, a: Action) -> None:
        slot = self.slot_of.pop(a.stage)
        if self.cuda and slot.released is None:
            slot.released = torch.cuda.Event()
            slot.released.record(torch.cuda.current_stream(self.device))
        slot.stage = None

    def _on_device(self, j: int, grads: bool, graph: bool = False) -> DeviceSlot:
        """Wait for stage j's upload (counting the stall) and bind its modules to its slot: with
        gradients, or (``graph``) requiring them without buffers, or for inference."""
        slot = self.slot_of[j]
        if not slot.ready.is_set():
            t0 = time.perf_counter()
            slot.ready.wait()
            self.st.wait_s += self.st.clock.held_since(t0)
            if not self.cuda:
                self.st.stall_s += time.perf_counter() - t0
        self.check()
        if self.cuda and slot.ready_event is not None:
            before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            stream = torch.cuda.current_stream(self.device)
            before.record(stream)
            stream.wait_event(slot.ready_event)
            after.record(stream)
            self.st.stall_events.append((before, after))
            slot.ready_event = None
            slot.released = None
        n, t = self.layouts[j].numel, self.layouts[j].trainable_numel
        if grads and not slot.grads_live:
            slot.sums[:t].zero_()
            slot.grads_live = True
        mode = "grads" if grads else "graph" if graph else "infer"
        if slot.bound != (j, mode):
            into, sums = slot.gradients_to(0, t) if grads else (None, None)
            slot.point((j, mode), self.units[j], lambda: bind(self.units[j], self.layouts[j], self.num_units,
                                                              slot.params[:n], into, grads or graph, sums))
            slot.bound = (j, mode)
        return slot

    # ---- compute --------------------------------------------------------------------------------
    def _run(self, j: int, x: torch.Tensor, m: int) -> tuple[torch.Tensor, RouterLog]:
        """Stage j's units on micro-batch m's input x; the output and what its MoE layers routed."""
        io = self.st.io
        seed = (io.dropout_seed, io.step, m) if io.dropout_seed is not None else None
        with recording() as log:
            y = run_units(list(self.units[j]), x, self.layouts[j].first_unit, dropout_seed=seed,
                          docs=self.st.io.batches[m].docs)
        return y, log

    def _input(self, j: int, m: int) -> torch.Tensor:
        if j == 0:
            return self.st.batches["inputs"][m]
        return self._take("a", j, m)

    def _take(self, kind: str, j: int, m: int) -> torch.Tensor:
        """A received message's activation (or gradient); its router choices go to ``choices``."""
        t, counts = self.msg.unpack(self.st.clock.take(self.st.waiting, (kind, j, m)))
        if counts is not None:
            self.st.choices[(kind, j, m)] = counts
        return t

    def _so_far(self, j: int, m: int, log: RouterLog, device: torch.device) -> torch.Tensor | None:
        """Micro-batch m's router choices up to stage j's end: those it received and its own (an MoE)."""
        if self.balance is None:
            return None
        own = routing.own_counts(log, self.balance.experts, device)
        return own + self.st.choices.pop(("a", j, m)).to(device) if j > 0 else own

    def _aux(self, roots: list, grads: list, log: RouterLog | None, counts: torch.Tensor | None) -> None:
        """The aux loss's term of a stage's backward (an MoE), given all the micro-batch's choices."""
        routing.backward_roots(roots, grads, self.balance, log, counts, self.st.io.aux_weight, self.st.routed)

    def _forward(self, a: Action) -> None:
        j, m, st = a.stage, a.micro, self.st
        if st.sched.train and j in st.sched.kept:
            return self._forward_kept(j, m)
        self._on_device(j, grads=False)
        x = self._input(j, m)
        start = self.st.computed.mark()
        with torch.no_grad(), autocast(self.device, self.opt.precision):
            y, log = self._run(j, x, m)
            if j == st.sched.num_stages - 1:  # evaluation: the last stage's forward ends in the loss
                self._count_loss(lm_loss_sum(y, st.batches["targets"][m]), m)
                return
        if st.sched.train:
            st.saved[(j, m)] = x  # an OFFLOAD that follows moves it to host memory
            if st.routed is not None:
                st.routed.add(log)
        st.outputs[("a", j, m)] = self.msg.pack(y, self._so_far(j, m, log, y.device))
        self.st.computed.add("forward", start, "F", j)

    def _forward_kept(self, j: int, m: int) -> None:
        """Forward with autograd on: the graph stays on the device for the backward (no recompute).
        A swapped stage's graph holds its weights by position (:meth:`_weights_by_position`), so its
        slot may take other stages before the backward."""
        swapped = j not in self.resident
        self._on_device(j, grads=not swapped, graph=swapped)
        x = self._input(j, m)
        start = self.st.computed.mark()
        if x.is_floating_point():
            x = x.detach().requires_grad_()
        with self._weights_by_position(j) if swapped else contextlib.nullcontext():
            with autocast(self.device, self.opt.precision):
                y, log = self._run(j, x, m)
        params = tuple(self.units[j].parameters()) if swapped else ()
        self.st.saved[(j, m)] = Graph(x, y, params, log)
        if self.st.routed is not None:
            self.st.routed.add(log)
        self.st.outputs[("a", j, m)] = self.msg.pack(y.detach(), self._so_far(j, m, log, y.device))
        self.st.computed.add("forward", start, "F", j)

    def _weights_by_position(self, j: int) -> torch.autograd.graph.saved_tensors_hooks:
        """Saved-tensor hooks for stage j's kept forward: a saved view of its slot is kept as its
        position in the slot and read back from whichever slot holds the stage at the backward."""
        base = self.slot_of[j].params
        ptr, start = base.untyped_storage().data_ptr(), base.storage_offset()

        def pack(t: torch.Tensor) -> torch.Tensor | SlotView:
            if t.device != base.device or t.untyped_storage().data_ptr() != ptr:
                return t
            assert t.dtype == base.dtype, (t.dtype, base.dtype)
            return SlotView(t.storage_offset() - start, tuple(t.shape), tuple(t.stride()))

        def unpack(v: torch.Tensor | SlotView) -> torch.Tensor:
            if not isinstance(v, SlotView):
                return v
            cur = self.slot_of[j].params
            return cur.as_strided(v.shape, v.stride, cur.storage_offset() + v.offset)

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def _fb(self, a: Action) -> None:
        """Last stage: forward, loss and backward of one micro-batch (no recompute)."""
        j, m, st = a.stage, a.micro, self.st
        slot = self._on_device(j, grads=True)
        x = self._input(j, m)
        start = self.st.computed.mark()
        if x.is_floating_point():
            x = x.detach().requires_grad_()
        with autocast(self.device, self.opt.precision):
            y, log = self._run(j, x, m)
            loss = lm_loss_sum(y, st.batches["targets"][m])
        everything = self._so_far(j, m, log, loss.device)  # the micro-batch's router choices, all known now
        if st.routed is not None:
            st.routed.add(log)
        roots, grads = [loss * st.io.loss_factor], [None]
        self._aux(roots, grads, log, everything)
        torch.autograd.backward(roots, grads)
        self._count_loss(loss.detach(), m)
        add_gradients(slot.pairs)
        if j > 0:
            st.outputs[("g", j, m)] = self.msg.pack(x.grad, everything)
        self.st.computed.add("backward", start, "FB", j)

    def _backward(self, a: Action) -> None:
        """Recompute the stage's forward from its saved input (or take its kept graph), then backpropagate."""
        j, m, st = a.stage, a.micro, self.st
        slot = self._on_device(j, grads=True)
        self._inputs_back(j)
        saved = st.saved.pop((j, m))
        g = self._take("g", j, m)
        everything = st.choices.pop(("g", j, m), None)  # an MoE's router choices of all the micro-batch's layers
        start = self.st.computed.mark()
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
            with autocast(self.device, self.opt.precision):
                y, log = self._run(j, x, m)
        roots, grads = ([y], [g.to(y.dtype)]) if y.requires_grad else ([], [])  # (a stage of frozen weights over
        # token ids, LoRA's embedding, has nothing to do)
        self._aux(roots, grads, log, everything)
        if roots:
            torch.autograd.backward(roots, grads)
        add_gradients(pairs)
        if j > 0:
            st.outputs[("g", j, m)] = self.msg.pack(x.grad, everything)
        self.st.computed.add("backward", start, "B", j)

    def _count_loss(self, loss: torch.Tensor, m: int) -> None:
        """Micro-batch m's summed loss and its target tokens, towards the mean over the step's."""
        self.st.loss_sum = self.st.loss_sum + loss.detach().float()
        self.st.losses += self.st.io.batches[m].target_count

    def _stage_batches(self, sched: Schedule, io: StepIO) -> dict[str, list[torch.Tensor]]:
        """Token ids for stage 0 and targets for the last stage, copied to the device up front."""
        mine = set(self.hosts) | set(self.resident)
        inputs, targets = [b.inputs for b in io.batches], [b.targets for b in io.batches]
        return {"inputs": batches_on(self.device, inputs) if 0 in mine else [],
                "targets": batches_on(self.device, targets) if sched.num_stages - 1 in mine else []}

    # ---- transfers ------------------------------------------------------------------------------
    def _tag(self, kind: str, sender_stage: int, m: int) -> int:
        S, M = self.st.sched.num_stages, self.st.sched.micro_batches
        return ((0 if kind == "a" else 1) * S + sender_stage) * M + m

    def _recv(self, a: Action) -> None:
        kind = "a" if a.kind == Kind.RECV_ACT else "g"
        if (kind, a.stage, a.micro) in self.st.waiting:  # posted when the step began
            return
        sender = a.stage - 1 if kind == "a" else a.stage + 1
        self.st.waiting[(kind, a.stage, a.micro)] = self.links[a.peer].recv(
            self.msg.shape, self.opt.dtype, self._tag(kind, sender, a.micro))

    def _send(self, a: Action) -> None:
        kind = "a" if a.kind == Kind.SEND_ACT else "g"
        t = self.st.outputs.pop((kind, a.stage, a.micro))
        self.links[a.peer].send(t.to(self.opt.dtype), self._tag(kind, a.stage, a.micro))

    def _download(self, a: Action) -> None:
        """Gradients of a finished stage to its host buffer (fp32, or rounded to the half dtype into
        the half copy); the CPU update takes them from there."""
        j, st = a.stage, self.st
        slot, host, n = self.slot_of[j], self.hosts[j], self.layouts[j].trainable_numel  # what trains comes down
        if not host.consumed.is_set():  # delayed: the previous step's AdamW still reads the gradient buffer
            t0 = time.perf_counter()
            host.consumed.wait()
            st.wait_s += st.clock.held_since(t0)
        self.check()
        host.consumed.clear()  # (delayed: `updated` is the compute copy's, cleared at the step's last upload)
        if not host.delayed:
            host.updated.clear()
        src = slot.sums[:n]  # fp32 either way
        summed = st.sched.tie_in and j == 0  # the tied weight's whole gradient: counted here, not at TIE
        st.sumsq.append(self._sumsq(src, None if summed else self.tied.get(j)))  # the exact norm, before any rounding
        if self.opt.half_grads:
            src = slot.grads[:n].copy_(src)  # the slot's half gradients are free once summed
        dst = host.grads_in[:n]
        done = None
        if self.cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.d2h_stream):
                self.d2h_stream.wait_event(ready)
                start = st.trace.mark(self.d2h_stream) if st.trace is not None else None
                dst.copy_(src, non_blocking=True)
                done = torch.cuda.Event()
                done.record(self.d2h_stream)
                if st.trace is not None:
                    st.trace.add("d2h", f"D{j}", start, st.trace.mark(self.d2h_stream))
            slot.released = done  # the slot is reused only after the copy has read it
        else:
            start = time.perf_counter()
            dst.copy_(src)
            if st.trace is not None:
                st.trace.add("d2h", f"D{j}", start, time.perf_counter())
        self.counters.add(d2h=n * src.element_size())
        st.arrived[j] = done
        if j == st.sched.num_stages - 1:
            st.head_down.set()

    @staticmethod
    def _sumsq(g: torch.Tensor, skip: tuple[int, int] | None) -> torch.Tensor:
        """Sum of squared gradients (on the device), leaving out a tied range counted at TIE."""
        if skip is None:
            return torch.dot(g, g)
        a, b = g[:skip[0]], g[skip[0] + skip[1]:]
        return torch.dot(a, a) + torch.dot(b, b)

    # ---- the CPU side ---------------------------------------------------------------------------
    def _update(self, a: Action) -> None:
        """Queue stage j's update on the optimizer thread (it waits for the gradients' download); its end
        sets ``updated`` (the next upload may read the copy) and ``consumed`` (the next download may come),
        one event in sync; delayed: ``consumed`` alone, the copy having been taken before
        (:meth:`_refresh_compute`)."""
        j, st = a.stage, self.st
        host, skip = self.hosts[j], st.skipped or self.opt.skip_updates
        lr, factor, trace = st.io.lr, st.factor, st.trace

        def update() -> int:
            host.update(lr, factor, skip=skip, copy=not host.delayed)
            return 0 if skip else host.own

        timed = (lambda t0, t1: trace.add("cpu", f"O{j}", t0, t1)) if trace is not None else None
        # its end (or failure) releases what waits on it
        host.updates_queued += 1
        self.updater.submit(update, st.arrived.get(j), _UpdateEnd(host), timed)

    def _device_update(self, a: Action) -> None:
        """A resident stage's update on the compute stream, from its fp32 gradient sums (delayed: its
        half copy takes the master first, then AdamW updates the master alone)."""
        j, st = a.stage, self.st
        slot, n = self.slot_of[j], self.layouts[j].trainable_numel
        self.resident[j].update(st.io.lr, st.factor, slot.sums[:n],
                                skip=st.skipped or self.opt.skip_updates)
        slot.grads_live = False  # zeroed before the next backward

    def _tie(self, a: Action) -> None:
        """Sum the two ends' gradients of the tied weight, held by two workers (one worker holding both sums
        them on the device: ``Schedule.tie_in``): each end takes the sum and the same update. Its sum of squares
        is counted once, on the embedding's worker."""
        st = self.st
        (j, (o, n)), = self.tied.items()
        arrived = st.arrived.get(j)
        if arrived is not None:
            arrived.synchronize()
        mine = self.hosts[j].grads_in[o:o + n]
        other_stage = st.sched.num_stages - 1 if j == 0 else 0
        sumsq = add_tied(mine, self.coll.exchange(mine, st.sched.gpu_of[other_stage]), into=(mine,))
        st.tied_sumsq = sumsq if j == 0 else 0.0

    def _reduce(self, a: Action) -> None:
        """End of the dispatch: finish this worker's transfers, then sum the step's statistics over
        workers; in training also the global norm, the fp16 overflow check and the update factor."""
        st, t0 = self.st, time.perf_counter()
        for link in self.links.values():
            link.flush()
        for f in st.uploads + list(st.reloads.values()):
            f.result()
        if self.cuda:
            torch.cuda.synchronize(self.device)
            st.stall_s += sum(x.elapsed_time(y) for x, y in st.stall_events) / 1e3
        st.reduce_wait_s = time.perf_counter() - t0
        if st.sched.train and not st.sched.barrier and self.opt.step_waits_for_updates:
            self.sync()  # without a barrier a (sync) step ends when its updates have
        if st.sched.train:  # resident gradients are still on the device (an update without a factor leaves them)
            for j in self.resident:
                slot, n = self.slot_of[j], self.layouts[j].trainable_numel
                st.sumsq.append(self._sumsq(slot.sums[:n], None))
        self.check()
        stats = self._local_stats(st)
        stats["reduce_s"] = st.tie_s + time.perf_counter() - t0  # before the sum over workers (it waits for the
        # slowest)
        total = self.coll.reduce(stats)
        loss = total["loss_sum"] / max(total["losses"], 1)
        if not st.sched.train:
            st.outcome = StepOutcome(loss, 0.0, False, total)
            return
        norm, st.skipped, st.factor = self.rule.end(total["sumsq"])
        st.outcome = StepOutcome(loss, norm, st.skipped, total)

    def _local_stats(self, st: StepState) -> dict[str, float]:
        moved = self.counters.take()
        update_s, update_params = self.updater.take()
        sumsq = (float(torch.stack(st.sumsq).double().sum()) if st.sumsq else 0.0) + st.tied_sumsq  # one read
        return {**(st.routed.stats() if st.routed is not None else {}),
                "loss_sum": float(st.loss_sum), "losses": float(st.losses), "sumsq": sumsq, "stall_s": st.stall_s,
                "upload_wait_s": st.wait_s, "cpu_adam_s": update_s, "cpu_adam_params": float(update_params),
                **st.computed.stats(self.rank, len(st.sched.actions)), "dispatch_s": st.dispatch_s,
                "reduce_wait_s": st.reduce_wait_s,
                **{f"{kind}_bytes": float(n) for kind, n in moved.items()}}
