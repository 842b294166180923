"""The round-robin step (the schedule class of RoundPipe, arXiv 2604.27085) as data.

No stage is bound to a GPU. The model is cut twice: forward stages cover units ``[0, c)``, backward
stages cover the same units with their own cuts, and one fused stage runs units ``[c, U)`` forward,
loss and backward at once (the head, without recompute). A round is one op per stage, in the order
forward stages, fused stage, backward stages (the highest units first), each op computing the
round's micro-batches (at most one per worker) one after the other. Op ``k`` of global round ``q``
runs on worker ``(first + q * K + k) mod N`` (``K`` ops per round): the rotation continues from
round to round and from step to step, so the next round starts on the worker that finished its
part of the round before first (with equal op times, the one free first).

Each op occurrence uploads its stage's weights; forward ops send activations to the next op and keep
the inputs of the units where backward stages start in host memory (``OFFLOAD`` at that unit); a
backward op brings each micro-batch's input back (``RELOAD``, once its upload is done and the input is
in host memory), recomputes and backs up,
sends the gradient on and downloads its weight gradient (``DOWNLOAD``, summed in host memory across
the rounds). A stage's CPU ``UPDATE`` follows its last round's download (or, with a barrier, the
step's ``REDUCE``). The lists hold ``steps`` consecutive steps (micro-batch ``s * M + m`` is step
``s``'s ``m``); the simulator interprets them as it interprets :mod:`partition.schedule.pipeline`'s.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from functools import cached_property

from partition.costs import HOST_SUM_BYTES, UPDATE_BYTES
from partition.schedule.pipeline import COMPUTE, Action, Kind, PipelineOptions, ScheduleError


@dataclass(frozen=True)
class Cuts:
    """The two partitions of a round-robin plan: forward boundaries ``[0, .., c]``, backward boundaries
    ``[0, .., c]``; the fused stage runs units ``[c, num_units)``."""

    forward: tuple[int, ...]
    backward: tuple[int, ...]
    num_units: int

    def __post_init__(self) -> None:
        for name in ("forward", "backward"):
            b = tuple(int(x) for x in getattr(self, name))
            object.__setattr__(self, name, b)
            if len(b) < 2 or b[0] != 0 or any(x >= y for x, y in zip(b, b[1:])):
                raise ScheduleError(f"round-robin {name} cuts {list(b)} must start at 0 and increase")
        if self.forward[-1] != self.backward[-1] or not 0 < self.forward[-1] < self.num_units:
            raise ScheduleError(f"round-robin cuts must both end at the fused stage's first unit (0 < c < "
                                f"{self.num_units}), got forward {list(self.forward)}, backward {list(self.backward)}")

    @property
    def fused_from(self) -> int:
        return self.forward[-1]

    @cached_property  # (the simulator asks for these at every event)
    def num_forward(self) -> int:
        return len(self.forward) - 1

    @cached_property
    def num_backward(self) -> int:
        return len(self.backward) - 1

    @cached_property
    def num_ops(self) -> int:
        """Ops per round: the forward stages, the fused stage, the backward stages."""
        return self.num_forward + 1 + self.num_backward

    def kind(self, op: int) -> Kind:
        return Kind.FORWARD if op < self.num_forward else Kind.FB if op == self.num_forward else Kind.BACKWARD

    def units(self, op: int) -> tuple[int, int]:
        """Units ``[first, end)`` of op ``op``."""
        F = self.num_forward
        if op < F:
            return self.forward[op], self.forward[op + 1]
        if op == F:
            return self.fused_from, self.num_units
        i = self.num_backward - (op - F)  # backward ops run the highest units first
        return self.backward[i], self.backward[i + 1]

    def to_json(self) -> dict:
        return {"forward": list(self.forward), "backward": list(self.backward), "fused": [self.fused_from,
                                                                                           self.num_units]}


@dataclass(frozen=True)
class RoundRobinSchedule:
    """Per-worker action lists of ``steps`` consecutive round-robin training steps."""

    cuts: Cuts
    num_workers: int
    micro_batches: int  # per step
    steps: int
    actions: tuple[tuple[Action, ...], ...]
    options: PipelineOptions
    tied: bool = False
    first: int = 0  # the worker of the first op of the first round
    train = True
    compute_copies = 2  # train.update: delayed: two host copies of the weights (each update writes one) and of
    # the gradient sums alternate by step
    resident = frozenset()
    kept = frozenset()
    offloaded = frozenset()
    tie_in = False  # the tied ends' gradients are summed on the host (their ops run on changing workers)

    def download_work(self, round: int) -> float:
        """Host memory work of a gradient download of round ``round`` of its step once it is down, in updates of
        its parameters (the CPU AdamW's measure): the worker's summing thread adds a middle round's fp32 sums
        into the host sum, on the memory the updates use. The first round's come down into the host sum and the
        last round's are the step's total (:meth:`sums_up`), whose norm the GPU reads."""
        r = round % self.rounds
        return (0 < r < self.rounds - 1) * HOST_SUM_BYTES / UPDATE_BYTES

    def sums_up(self, stage: int, round: int) -> bool:
        """Whether the upload of ``stage`` for round ``round`` also brings the host sum of its step's earlier
        rounds (fp32) into its slot, once they are down: a gradient op's in a step's last round, after the first,
        so that its download is the step's total and the host adds nothing."""
        return self.rounds > 1 and round % self.rounds == self.rounds - 1 and self.cuts.kind(stage) != Kind.FORWARD

    num_slots = property(lambda self: self.options.num_slots)
    barrier = property(lambda self: self.options.barrier)
    num_stages = cached_property(lambda self: self.cuts.num_ops)
    rounds = cached_property(lambda self: rounds_per_step(self.micro_batches, self.num_workers))
    tie_ends = cached_property(lambda self: (self.cuts.num_ops - 1, self.cuts.num_forward))  # unit 0's backward, the
    # head; the op whose update reads both ends' gradients: unit 0's, which runs the tied weight's AdamW and copies the
    # result into the head's end (master and compute copy); the head's update leaves the tied weight out
    tie_readers = cached_property(lambda self: self.tie_ends[:1])
    tie_held = cached_property(lambda self: self.tie_ends[1])  # the end that takes no AdamW of its own
    tie_copies = True

    def round_of(self, micro: int) -> int:
        """The global round of micro-batch ``micro`` (counted over the steps)."""
        return (micro // self.micro_batches) * self.rounds + (micro % self.micro_batches) // self.num_workers

    def micros(self, round: int) -> range:
        step, r = divmod(round, self.rounds)
        lo = step * self.micro_batches + r * self.num_workers
        return range(lo, min(lo + self.num_workers, (step + 1) * self.micro_batches))

    def worker_of(self, op: int, round: int) -> int:
        return (self.first + round * self.cuts.num_ops + op) % self.num_workers

    def worker_for(self, stage: int, micro: int) -> int:
        return self.worker_of(stage, self.round_of(micro))

    def consumer(self, stage: int, backward: bool) -> int:
        """Ops form one chain per micro-batch: forward ops, the fused op, the backward ops."""
        return stage + 1

    def producer(self, stage: int, backward: bool) -> int:
        return stage - 1

    @cached_property
    def _owners(self) -> dict[int, tuple[int, ...]]:
        """op -> the ops that update its units (the fused op and the backward ops own the gradients); the head's
        tied end is written by unit 0's update (:attr:`tie_readers`), so the op holding the head waits for it too."""
        own = [k for k in range(self.cuts.num_forward, self.cuts.num_ops)]
        spans = {k: self.cuts.units(k) for k in range(self.cuts.num_ops)}

        def owners(lo: int, hi: int) -> tuple[int, ...]:
            return tuple(o for o in own if spans[o][0] < hi and lo < spans[o][1])

        U = self.cuts.num_units
        return {k: owners(*spans[k]) + (owners(0, 1) if self.tied and spans[k][1] == U else ())
                for k in range(self.cuts.num_ops)}

    def update_deps(self, stage: int) -> tuple[int, ...]:
        return self._owners[stage]

    def upload_rank(self, stage: int, phase: str, round: int) -> int:
        return round * self.cuts.num_ops + stage

    def reload_micros(self, stage: int, round: int) -> range:
        return self.micros(round)

    def ops_of(self, worker: int) -> list[tuple[int, int]]:
        """(round, op) occurrences of ``worker``, in the order it runs them."""
        K = self.cuts.num_ops
        return [(q, k) for q in range(self.steps * self.rounds) for k in range(K) if self.worker_of(k, q) == worker]


def rounds_per_step(micro_batches: int, num_workers: int) -> int:
    """Rounds of one step: one micro-batch per worker in each, the last one short."""
    return math.ceil(micro_batches / num_workers)


def rotation_start(cuts: Cuts, num_workers: int, micro_batches: int, step: int) -> int:
    """The worker of step ``step``'s first op when the rotation goes on from step to step (``first`` of a list
    that holds that step alone)."""
    return step * rounds_per_step(micro_batches, num_workers) * cuts.num_ops % num_workers


def build_round_robin(cuts: Cuts, num_workers: int, micro_batches: int, steps: int = 1,
                      options: PipelineOptions = PipelineOptions(), tied: bool = False,
                      first: int = 0) -> RoundRobinSchedule:
    """The per-worker action lists of ``steps`` training steps of the round-robin schedule."""
    if options.resident or options.kept or options.prefetch_bytes or options.offload_inputs:
        raise ScheduleError("the round-robin schedule has no resident or kept stages, no prefetch buffer and keeps "
                            "its backward inputs in host memory by construction")
    if steps < 1 or micro_batches < 1 or num_workers < 1:
        raise ScheduleError(f"steps {steps}, micro-batches {micro_batches} and workers {num_workers} must be >= 1")
    skeleton = RoundRobinSchedule(cuts, num_workers, micro_batches, steps, (), options, tied, first % num_workers)
    lists = tuple(tuple(_worker_actions(skeleton, w)) for w in range(num_workers))
    sched = RoundRobinSchedule(cuts, num_workers, micro_batches, steps, lists, options, tied, first % num_workers)
    check_round_robin(sched)
    return sched


def _worker_actions(s: RoundRobinSchedule, w: int) -> list[Action]:
    """Uploads (issued when the occurrence before starts computing, with two slots), the compute with its
    receives, sends and offloads, the free, the download and the updates of one worker."""
    occ = s.ops_of(w)
    out: list[Action] = []
    done = 0  # steps whose REDUCE this list holds
    for i, (q, k) in enumerate(occ):
        while done < q // s.rounds:
            out += _step_end(s, w, done)
            done += 1
        if i == 0:
            out += _upload(s, q, k)
        if s.num_slots >= 2 and i + 1 < len(occ):
            out += _upload(s, *occ[i + 1])
        out += _compute(s, q, k)
        out.append(Action(Kind.FREE, k, phase=_phase(s, k), round=q))
        if s.cuts.kind(k) != Kind.FORWARD:
            out.append(Action(Kind.DOWNLOAD, k, round=q))
            if not s.barrier and q % s.rounds == s.rounds - 1:
                out.append(Action(Kind.UPDATE, k))
        if s.num_slots < 2 and i + 1 < len(occ):
            out += _upload(s, *occ[i + 1])
    while done < s.steps:
        out += _step_end(s, w, done)
        done += 1
    return out


def _phase(s: RoundRobinSchedule, k: int) -> str:
    return "b" if s.cuts.kind(k) == Kind.BACKWARD else "f"


def _upload(s: RoundRobinSchedule, q: int, k: int) -> list[Action]:
    return [Action(Kind.UPLOAD, k, phase=_phase(s, k), round=q)]


def _compute(s: RoundRobinSchedule, q: int, k: int) -> list[Action]:
    kind, (first, end) = s.cuts.kind(k), s.cuts.units(k)
    last = s.cuts.num_ops - 1
    keep = [u for u in s.cuts.backward[1:-1] if first < u <= end] if kind == Kind.FORWARD else []
    out: list[Action] = []
    for m in s.micros(q):
        if k > 0 and kind != Kind.BACKWARD:
            out.append(Action(Kind.RECV_ACT, k, m, peer=s.worker_for(k - 1, m)))
        if kind == Kind.BACKWARD and first > 0:  # its input, kept in host memory by a forward
            out.append(Action(Kind.RELOAD, k, m, unit=first))
        if kind == Kind.BACKWARD:  # the recompute needs the input only; the backward then waits for the gradient
            out += [Action(Kind.RECOMPUTE, k, m), Action(Kind.RECV_GRAD, k, m, peer=s.worker_for(k - 1, m))]
        out.append(Action(kind, k, m))
        out += [Action(Kind.OFFLOAD, k, m, unit=u) for u in keep]
        if k < last:
            send = Kind.SEND_ACT if kind == Kind.FORWARD else Kind.SEND_GRAD
            out.append(Action(send, k, m, peer=s.worker_for(k + 1, m)))
    return out


def _step_end(s: RoundRobinSchedule, w: int, step: int) -> list[Action]:
    """The step's REDUCE (loss, global norm); with a barrier, the updates this worker ran the last round of,
    after it, the lowest units first."""
    out = [Action(Kind.REDUCE)]
    if s.barrier:
        q = (step + 1) * s.rounds - 1
        mine = [k for k in range(s.cuts.num_forward, s.cuts.num_ops) if s.worker_of(k, q) == w]
        out += [Action(Kind.UPDATE, k) for k in sorted(mine, key=lambda k: s.cuts.units(k)[0])]
    return out


def check_round_robin(s: RoundRobinSchedule) -> None:
    """Every op computes each of its micro-batches once, on its round's worker, while uploaded; at most
    ``num_slots`` occurrences are on a worker at once; each stage with gradients downloads once per round
    and updates once per step; one REDUCE per step on every worker."""
    seen: dict[tuple[int, int], int] = {}
    for w, acts in enumerate(s.actions):
        on: set[tuple[int, int]] = set()
        for a in acts:
            if a.kind == Kind.UPLOAD:
                if len(on) >= s.num_slots:
                    raise ScheduleError(f"worker {w}: {a} while {sorted(on)} hold the {s.num_slots} slot(s)")
                on.add((a.stage, a.round))
            elif a.kind == Kind.FREE:
                on.remove((a.stage, a.round))
            elif a.kind in COMPUTE:
                if (a.stage, s.round_of(a.micro)) not in on or s.worker_for(a.stage, a.micro) != w:
                    raise ScheduleError(f"worker {w}: {a} computes an op that is not uploaded here")
                if a.kind != Kind.RECOMPUTE:
                    seen[(a.stage, a.micro)] = seen.get((a.stage, a.micro), 0) + 1
        if on or sum(a.kind == Kind.REDUCE for a in acts) != s.steps:
            raise ScheduleError(f"worker {w}: occurrences {sorted(on)} never freed, or not one REDUCE per step")
    want = {(k, m) for k in range(s.num_stages) for m in range(s.steps * s.micro_batches)}
    if set(seen) != want or any(n != 1 for n in seen.values()):
        raise ScheduleError("round-robin lists do not compute every (op, micro-batch) exactly once")
    every = [a for acts in s.actions for a in acts]
    downloads = Counter(a.stage for a in every if a.kind == Kind.DOWNLOAD)
    updates = Counter(a.stage for a in every if a.kind == Kind.UPDATE)
    for k in range(s.cuts.num_forward, s.num_stages):
        if downloads[k] != s.steps * s.rounds or updates[k] != s.steps:
            raise ScheduleError(f"op {k}: {downloads[k]} downloads and {updates[k]} updates over {s.steps} step(s)")


def round_robin_timeline(s: RoundRobinSchedule, width: int = 8) -> str:
    """The lists as a grid (one row per worker, issue order) and the cuts."""
    rows = [f"gpu{w} | " + "".join(str(a).ljust(width) for a in acts) for w, acts in enumerate(s.actions)]
    c = s.cuts
    head = (f"forward cuts {list(c.forward)}, fused units [{c.fused_from}, {c.num_units}), backward cuts "
            f"{list(c.backward)}; op k of round q on gpu (first + q*{c.num_ops} + k) mod {s.num_workers}")
    legend = ("U=upload L@u=reload (a micro-batch's kept input of unit u) F=forward FB=fused forward+loss+backward "
              "C=recompute B=backward H@u=input of unit u to host memory ra/sa rg/sg=recv/send activation/gradient "
              "X=free D=download O=CPU update R=step reduce; rN: round N; stage[,micro-batch]")
    return "\n".join([head] + rows + [legend])
