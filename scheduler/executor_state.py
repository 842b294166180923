"""What the swapped pipeline's executor is given and keeps: its settings for the whole run
(:class:`ExecutorOptions`), a step's inputs (:class:`StepIO`), what lives for one step (:class:`StepState`, a fresh
one for every :meth:`~scheduler.executor.Executor.run`) and what the step reports (:class:`StepOutcome`)."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

import torch

from mobius import routing
from mobius.batch import MicroBatch
from partition.schedule import PipelineOptions, Schedule
from scheduler.messages import Messages
from scheduler.trace import ComputeSpans, DispatchTime, StepTrace


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
class StepState:
    """Per-step state of the dispatch thread (a fresh one for every :meth:`~scheduler.executor.Executor.run`)."""

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
