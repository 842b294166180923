"""What one step of the round-robin runtime holds on a worker (:class:`RoundRobinStep`), and its statistics
summed over the workers (:class:`StepReduce`)."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from mobius import routing
from mobius.batch import MicroBatch
from mobius.models.experts import RouterLog
from mobius.optim import UpdateRule
from partition.schedule import Action
from partition.schedule.roundrobin_actions import RoundRobinSchedule
from scheduler.trace import ComputeSpans, DispatchTime, StepTrace


class StepReduce:
    """A step's statistics summed over the workers: the collective is posted at the step's REDUCE and ended
    by the first that needs its result (the step's updates under a barrier, or ``train_step``), which also ends
    the step for the update rule, after the step before."""

    def __init__(self, stats: dict[str, float], rule: UpdateRule, before: StepReduce | None):
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
class RoundRobinStep:
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
    reduce: StepReduce | None = None  # its statistics over the workers (posted at REDUCE)
    seconds: float = 0.0  # this worker's list, from its first action to its REDUCE
    trace: StepTrace | None = None  # parallel.trace_step's: its spans on the simulator's tracks


def ready_version(index: int, delayed: bool) -> int:
    """The updates of an op that its uploads of step ``index`` wait for (sync: the step before's; delayed: the one
    before that, which wrote the compute copy this step reads)."""
    return index - (1 if delayed else 0)
