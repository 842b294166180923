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
  once the stage's earlier AdamWs have run; :class:`~scheduler.stage_store.StageStore`).

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

import logging
from typing import Callable

import torch

from mobius import routing
from mobius.models import ModelConfig
from mobius.models.experts import balance_of
from mobius.models.params import build_units
from mobius.optim import UpdateRule
from partition.schedule import Action, Kind, Schedule
from scheduler.arbiter import UploadArbiter
from scheduler.counters import Counters
from scheduler.dispatch_thread import Background, dispatch_action
from scheduler.executor_state import Collectives, ExecutorOptions, StepIO, StepOutcome, StepState
from scheduler.links import post_early
from scheduler.messages import StageMessages
from scheduler.stage_compute import StageCompute
from scheduler.stage_swaps import StageSwaps
from scheduler.stage_updates import StageUpdates
from scheduler.stages import StageLayout
from scheduler.stage_store import StageStore
from scheduler.trace import ComputeSpans, DispatchTime, StepTrace

log = logging.getLogger(__name__)
ORDER_STRIDE = 1 << 20  # upload orders of consecutive steps never interleave


class Executor:
    """Runs schedules for one worker (``rank``) over its swapped stages' host stores (``hosts``) and
    its resident stages' device stores (``resident``): its slots and copies (:class:`StageSwaps`), its compute
    and messages (:class:`StageCompute`), its gradients, updates and step end (:class:`StageUpdates`), each
    action handed to the one that runs it."""

    def __init__(self, rank: int, device: torch.device, model_cfg: ModelConfig, layouts: list[StageLayout],
                 hosts: dict[int, StageStore], links: dict, arbiter: UploadArbiter, counters: Counters,
                 collectives: Collectives, rule: UpdateRule, options: ExecutorOptions,
                 resident: dict[int, StageStore] | None = None):
        self.rank, self.device, self.links = rank, device, links
        resident = resident or {}
        mine = sorted(set(hosts) | set(resident))
        self.units = {j: build_units(model_cfg, layouts[j].first_unit, layouts[j].end_unit) for j in mine}
        self.bg = Background(device, threads=("upload",), streams=("copy", "d2h"))
        self.swaps = StageSwaps(device, layouts, hosts, resident, self.units, options, arbiter, counters, self.bg)
        self.mail = StageMessages(links, options.messages, balance_of(model_cfg))  # (an MoE's load-balancing loss)
        self.moe_layers = getattr(model_cfg, "moe_layers", ())
        self.compute = StageCompute(device, layouts, self.units, set(resident), options, self.swaps, self.mail)
        self.updates = StageUpdates(rank, layouts, hosts, resident, links, self.swaps, counters, collectives, rule,
                                    options, self.bg)
        self._runs = 0
        sw, co, up, mail = self.swaps, self.compute, self.updates, self.mail
        self.handlers: dict[Kind, Callable[[StepState, Action], None]] = {
            Kind.UPLOAD: sw.upload, Kind.PREFETCH: sw.prefetch, Kind.FREE: sw.free, Kind.OFFLOAD: sw.offload,
            Kind.RELOAD: sw.reload, Kind.FORWARD: co.forward, Kind.FB: co.fb, Kind.BACKWARD: co.backward,
            Kind.RECV_ACT: mail.recv, Kind.RECV_GRAD: mail.recv, Kind.SEND_ACT: mail.send, Kind.SEND_GRAD: mail.send,
            Kind.DOWNLOAD: up.download, Kind.UPDATE: up.update, Kind.DEVICE_UPDATE: up.device_update, Kind.TIE: up.tie,
            Kind.REDUCE: up.reduce}

    def run(self, sched: Schedule, io: StepIO, trace: StepTrace | None = None) -> StepOutcome:
        """Dispatch this worker's actions of ``sched``; returns after its REDUCE (updates that
        follow a barrier keep running on the optimizer thread)."""
        self._runs += 1
        for units in self.units.values():
            units.train(io.training)
        st = StepState(io, sched, self.compute.stage_batches(sched, io), trace, self._runs * ORDER_STRIDE,
                       computed=ComputeSpans(self.device))
        if self.mail.balance is not None and sched.train:
            st.routed = routing.StepRouting(self.mail.balance, self.moe_layers)
        st.clock = DispatchTime(st.computed)
        post_early(sched.actions[self.rank], self.links, lambda a: self.mail.recv(st, a))
        try:
            for action in sched.actions[self.rank]:
                self._dispatch(st, action)
        finally:
            st.head_down.set()  # an upload waiting for the head's download goes on (and fails, if it never came)
        assert st.outcome is not None
        return st.outcome

    def _dispatch(self, st: StepState, action: Action) -> None:
        handler = self.handlers[action.kind]
        t0, t1, own = dispatch_action(lambda a: handler(st, a), action, st.computed, st.clock, st.trace)
        if action.kind == Kind.TIE:  # the step's end apart (the tied ends' sum and the reduce: reduce_s)
            st.tie_s += t1 - t0
        elif action.kind != Kind.REDUCE:  # messages, uploads issued, downloads, binding a stage to its slot
            st.dispatch_s += own

    def sync(self) -> None:
        """Wait for every queued CPU update, all of it (under delayed the AdamW after the copy too),
        and surface a failure of one."""
        self.updates.sync()

    def close(self) -> None:
        self.bg.close()
