"""The timing and memory model of one pipeline step, written once for numbers and MIP rows.

It states, stage by stage, when every event of the runtime's schedule (:mod:`partition.schedule`)
can happen at the earliest: each time is the maximum of the times it waits for, plus a duration.
With :class:`Numbers` the model evaluates one partition; with :class:`Rows` it emits the MIP's
constraints (a variable ``>=`` each term of its maximum), so for a fixed partition the MIP's optimum
*is* the evaluated step time. :class:`VariantNumbers` evaluates many variants of one structure at once, each
with the numbers :class:`Numbers` gives it (partitions of one stage count; kept stages or free
workers added, :class:`Variant`). Units: seconds, GB (10^9 bytes), G parameters (10^9).

What it models (one worker per slot ``s = j mod N``; ``M`` micro-batches; ``K`` device slots):

* **Occupancies.** Each worker holds its stages one after another: the forward of each of its
  stages (ascending), then the backwards (descending). Its last forward stage stays for its
  backward (one occupancy), and the pipeline's last stage runs forward, loss and backward together
  (``FB``, no recompute). Every occupancy is uploaded first (its parameters; a backward also its
  ``M`` boundary inputs when they wait in host memory).
* **Uploads** run one at a time per worker (one copy thread); occupancy ``i`` may start uploading
  once occupancy ``i - K`` has released its slot: at the end of its last compute, or, when it ends
  in a backward, when its gradients have been downloaded. With one slot and a prefetch buffer of
  ``P`` (partial prefetch), its first ``P`` bytes upload into the buffer as soon as the copy thread is
  free, and only the rest waits for the slot. With clipping or fp16 (``barrier``) the
  stages are updated after the step's global norm, in ascending order, overlapping the next
  step's forward: a stage's next upload waits for its update, ``C_j`` seconds after the step starts
  (the worker's updates up to ``j``).
* **Compute** of a micro-batch starts when its input (activation, or gradient) has arrived, the
  occupancy is uploaded and the worker's previous phase has ended; per micro-batch a forward takes
  ``fwd``, a backward ``bwd`` (recompute, backward and the fp32 gradient accumulation), each plus
  ``message_s`` per message its dispatch thread posts to another worker (:func:`_posts`) and
  ``action_s`` (its own time per compute action on CPU workers, learnt from the runs). Only the
  first and the last micro-batch need a time: with identical micro-batches the last one's start is
  the longest path through the (stage, micro-batch) grid, which the two chains state exactly.
* **Gradients** (fp32 sums, 4 bytes per parameter) download after a stage's last backward, one at
  a time per worker; the worker's CPU AdamW then updates each stage (``A_j`` = its parameters over
  the CPU rate), in download order, as they arrive -- or, with a barrier, after the step's REDUCE.
  A tied weight's two ends first exchange gradients (``TIE``) and update last; when one worker holds
  both, stage 0's backward upload brings the head's end's gradient (its download is then the sum).
* **The step** ends at REDUCE: every worker's downloads done and (without a barrier) its updates
  done. The next step starts there; the model's objective is that period.
* **A delayed update** (``train.update: delayed``): the CPU updates run beside the next step, whose
  uploads wait only for the compute copies (no update offsets); the step ends when the downloads are
  done, and lasts at least each worker's CPU work, its updates and compute copies at its share of the
  host. The copies' waits across steps (a copy follows the stage's update of the step before) are the
  simulator's: where the two bounds meet they make its step longer than the model's.
* **Resident stages** live on their GPU for good (half and fp32 weights, AdamW moments, gradients):
  no upload, no download, a device AdamW right after their backward (with a barrier: at the start of
  the next step, before the worker's first forward). They take no slot.
* **Kept activations**: any stage but the last (whose FB never recomputes) may keep its forward's
  autograd graph instead of recomputing it, swapped stages too (the runtime's graph saves their
  weights by position in the slot, read back from the backward's upload): its backward then costs
  ``bwd - fwd`` per micro-batch, and the graph (``M`` micro-batches of ``saved`` plus their inputs)
  stays on the GPU until its backward.
* **Memory** per worker: ``K`` slots of its largest swapped stage (parameters, gradients, fp32 sums)
  and the prefetch buffer,
  its resident stages' states, the boundary inputs (or kept activations) its pending backwards hold
  (none for inputs waiting in host memory) and the phase's working set; must fit the usable memory
  ``G``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property, lru_cache, reduce
from typing import Any, Callable, Protocol, Union

import numpy as np

from partition.lp import Lin, LinearModel
from partition.schedule import PipelineOptions, offloaded_stages

Expr = Union[float, Lin, np.ndarray]  # a number, a MIP expression, or one number per variant of a batch
Flag = Union[bool, np.ndarray]  # a yes/no of the structure, or one per variant of a batch


@dataclass
class StageExprs:
    """Per-stage quantities (numbers, or linear expressions of the MIP's partition variables)."""

    fwd: Expr  # forward seconds per micro-batch
    bwd: Expr  # backward seconds per micro-batch (recompute, or FB for the last stage; fp32 sums included)
    params: Expr  # G parameters (CPU update, fp32 gradient download)
    pbytes: Expr  # GB of half-precision parameters (an upload)
    slot: Expr  # GB of a device slot holding the stage (parameters, gradients, fp32 sums)
    state: Expr  # GB of the stage kept resident: its slot plus fp32 master and AdamW moments
    in_b: Expr  # GB of one micro-batch's input
    out_b: Expr  # GB of one micro-batch's output
    saved: Expr  # GB autograd keeps during one micro-batch's recompute
    work: Expr  # GB of transient working memory


@dataclass(frozen=True)
class PipelineShape:
    """What the model assumes besides the stages: their placement (stage j on worker j mod N) and
    the runtime's settings (the one :class:`~partition.schedule.PipelineOptions` value)."""

    num_stages: int
    num_workers: int  # N: stage j runs on worker j mod N
    micro_batches: int
    options: PipelineOptions = PipelineOptions()
    tied_gp: float = 0.0  # G parameters of a weight whose two ends stage 0 and the last stage hold (0: none)
    variants: tuple["Variant", ...] = ()  # a batch (:class:`VariantNumbers`): what each variant adds to ``options``

    tied = property(lambda self: self.tied_gp > 0)
    # one worker holds both ends: they are summed on the device, the head's end's gradient coming up with stage 0's
    # backward upload (Schedule.tie_in)
    tie_in = property(lambda self: self.tied and self.num_stages > 1
                      and self.worker(0) == self.worker(self.num_stages - 1))
    num_slots = property(lambda self: self.options.num_slots)  # K
    prefetch_gb = property(lambda self: self.options.prefetch_bytes / 1e9)  # P: the prefetch buffer (one slot)
    barrier = property(lambda self: self.options.barrier)
    resident = property(lambda self: self.options.resident)
    kept = property(lambda self: self.options.kept)
    grad_bytes = property(lambda self: self.options.grad_bytes)

    @cached_property
    def offloaded(self) -> frozenset[int]:
        """Stages whose boundary inputs wait in host memory (the schedule's rule, not a second one)."""
        return offloaded_stages(tuple(j % self.num_workers for j in range(self.num_stages)), self.options)

    def keeps(self, j: int) -> Flag:
        """Whether stage j keeps its forward's activations (per variant in a batch)."""
        return True if j in self.options.kept else self._masks.get(("kept", j), False)

    def offloads(self, j: int) -> Flag:
        """Whether stage j's boundary inputs wait in host memory (per variant: a kept graph holds them)."""
        if j not in self.offloaded:
            return False
        kept = self._masks.get(("kept", j))
        return True if kept is None else ~kept

    def frees(self, w: int) -> Flag:
        """Whether worker w's transfers and CPU updates cost nothing (per variant; see :class:`Variant`)."""
        return self._masks.get(("free", w), False)

    def worker(self, j: int) -> int:
        return j % self.num_workers

    def stages_of(self, w: int) -> list[int]:
        return self._stages[w]

    def swapped(self, w: int) -> list[int]:
        """The worker's stages that move between host and GPU."""
        return self._swapped[w]

    def last_forward(self, j: int) -> bool:
        """The worker's last forward stage: its backward is the worker's next phase."""
        return j + self.num_workers >= self.num_stages

    def turns(self, j: int) -> bool:
        """The stage's backward needs no upload: it is resident, or the worker's last swapped stage
        (only resident stages compute between its forward and its backward)."""
        return j in self._turning

    def occupancies(self, w: int) -> list[tuple[str, int]]:
        """Uploads in the worker's order, as (kind, stage): F (forward), R (forward + backward), FB, B."""
        mine, last = self.swapped(w), self.num_stages - 1
        kinds = [("FB" if j == last else "R" if self.turns(j) else "F", j) for j in mine]
        return kinds + [("B", j) for j in reversed(mine) if not self.turns(j)]

    # the structure, computed once per shape (the timing model asks for it per stage, many times)
    @cached_property
    def _stages(self) -> list[list[int]]:
        return [list(range(w, self.num_stages, self.num_workers)) for w in range(self.num_workers)]

    @cached_property
    def _swapped(self) -> list[list[int]]:
        resident = self.options.resident
        return [[j for j in mine if j not in resident] for mine in self._stages]

    @cached_property
    def _turning(self) -> frozenset[int]:
        return self.options.resident | frozenset(mine[-1] for mine in self._swapped if mine)

    @cached_property
    def posts(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Each stage's messages per micro-batch of its forward (``[0]``) and backward (``[1]``): :func:`_posts`."""
        return _posts_table(self.num_stages, self.num_workers)

    @cached_property
    def _masks(self) -> dict[tuple[str, int], np.ndarray]:
        """("kept", stage) / ("free", worker) -> which variants add it."""
        out: dict[tuple[str, int], np.ndarray] = {}
        for b, v in enumerate(self.variants):
            for key in [("kept", j) for j in v.kept] + [("free", w) for w in v.free]:
                out.setdefault(key, np.zeros(len(self.variants), dtype=bool))[b] = True
        return out

    def bwd_time(self, st: "StageExprs", j: int) -> Expr:
        """Backward seconds per micro-batch: no recompute when the stage kept its activations (the
        last stage's FB never recomputes: it is never in ``kept``)."""
        return either(self.keeps(j), lambda keeps: st.bwd - st.fwd if keeps else st.bwd)

    def __post_init__(self) -> None:
        last = self.num_stages - 1
        assert all(last not in v.kept for v in (self.options, *self.variants)), "the last stage's FB never recomputes"


@dataclass(frozen=True)
class Variant:
    """One variant of a batch: stages it keeps besides ``options.kept``, and workers it frees. A
    free worker's uploads, downloads and CPU updates cost nothing and wait for nothing (its compute
    and activations stay): a relaxation, whose step no resident or kept choice on that worker can
    beat (:mod:`partition.residency` bounds its moves with it)."""

    kept: frozenset[int] = frozenset()
    free: frozenset[int] = frozenset()


def either(flag: Flag, value: Callable[[bool], Any]) -> Any:
    """``value(flag)``; for a flag per variant, each variant's value (both computed as for one variant,
    so that a batch gives every variant the very numbers of its own evaluation)."""
    if isinstance(flag, bool):
        return value(flag)
    yes, no = value(True), value(False)
    if isinstance(yes, tuple):
        return tuple(np.where(flag, a, b) for a, b in zip(yes, no))
    return np.where(flag, yes, no)


@dataclass
class Rates:
    """Per stage: host link rates of its GPU (GB/s), activation seconds per GB from its neighbours,
    the CPU update rate (G parameters/s) and the seconds to exchange a tied weight's gradients."""

    up: list[float]
    down: list[float]
    lat_in: list[float]  # stage j-1 -> j
    lat_back: list[float]  # stage j+1 -> j
    cpu: float
    tie_s: float = 0.0  # exchange of the tied gradients between two workers (0 on one worker)
    device: float = 1e12  # G parameters/s of the AdamW of a resident stage, on its device
    message_s: float = 0.0  # the dispatch thread per message posted to another worker (Hardware.message_s)
    action_s: float = 0.0  # the dispatch thread per compute action beyond its messages (ModelProfile.action_s)
    copy_work: float = 0.0  # train.update: delayed: a stage's compute copy, in CPU updates of its parameters
    # (:func:`partition.costs.compute_copy_work`)


Name = tuple[str, int]  # a variable's name in the MIP: (what, stage or worker)


class Algebra(Protocol):
    def max(self, name: Name, terms: list[Expr]) -> Expr: ...
    def require(self, need: Expr, budget: float, what: str) -> None: ...


class Numbers:
    """Evaluate the model for one partition: a maximum is a number; a broken memory rule is recorded."""

    def __init__(self) -> None:
        self.violations: list[tuple[str, float, float]] = []

    def max(self, name: Name, terms: list[Expr]) -> float:
        return max(terms, default=0.0)

    def require(self, need: Expr, budget: float, what: str) -> None:
        if need > budget * (1 + 1e-12):
            self.violations.append((what, need, budget))


class VariantNumbers:
    """Evaluate the model for many variants at once (partitions of one stage count, or kept
    choices, see :attr:`PipelineShape.variants`): every quantity is a vector over the variants and each
    variant gets the same arithmetic :class:`Numbers` does; ``broken`` marks those that break a
    memory rule."""

    def __init__(self, size: int) -> None:
        self.broken = np.zeros(size, dtype=bool)

    def max(self, name: Name, terms: list[Expr]) -> Expr:
        return reduce(np.maximum, terms) if terms else 0.0

    def require(self, need: Expr, budget: float, what: str) -> None:
        self.broken |= need > budget * (1 + 1e-12)


class Rows:
    """Emit the model into a MIP: a maximum is a variable bounded below by each term."""

    def __init__(self, lm: LinearModel):
        self.lm = lm

    def max(self, name: Name, terms: list[Expr]) -> Lin:
        lins = [t if isinstance(t, Lin) else Lin(const=t) for t in terms]
        var_terms = [t for t in lins if t.terms]
        consts = [t.const for t in lins if not t.terms]
        if not var_terms:
            return Lin(const=max(consts, default=0.0))
        if len(var_terms) == 1 and not consts:
            return var_terms[0]
        v = self.lm.var(f"{name[0]}{name[1]}")
        for t in var_terms:
            self.lm.add(v, ">=", t)
        if consts:
            self.lm.add(v, ">=", max(consts))
        return v

    def require(self, need: Expr, budget: float, what: str) -> None:
        self.lm.add(need, "<=", budget)


@dataclass
class StepTimes:
    """Event times of one step (per stage) and the period; entries are numbers or expressions."""

    fwd_start: dict[int, Expr] = field(default_factory=dict)  # first micro-batch of the forward / FB
    fwd_last: dict[int, Expr] = field(default_factory=dict)
    fwd_end: dict[int, Expr] = field(default_factory=dict)
    bwd_start: dict[int, Expr] = field(default_factory=dict)
    bwd_last: dict[int, Expr] = field(default_factory=dict)
    bwd_end: dict[int, Expr] = field(default_factory=dict)
    upload_done: dict[tuple[str, int], Expr] = field(default_factory=dict)  # ("f"|"b", stage)
    download_done: dict[int, Expr] = field(default_factory=dict)
    update_done: dict[int, Expr] = field(default_factory=dict)
    step: Expr = 0.0


def step_model(alg: Algebra, st: list[StageExprs], r: Rates, shape: PipelineShape, budget: float) -> StepTimes:
    """State the whole step in ``alg``; returns its event times (``step`` is the objective)."""
    t = StepTimes()
    upload = _Uploads(alg, st, r, shape, t)
    per = _PerMicroBatch(st, r, shape)
    _memory(alg, st, shape, budget)
    for j in range(shape.num_stages):
        _forward(alg, st, r, shape, t, upload, per, j)
    for j in reversed(range(shape.num_stages)):
        if j < shape.num_stages - 1:
            _backward(alg, st, r, shape, t, upload, per, j)
        if j not in shape.resident:
            _download(alg, st, r, shape, t, j)
    _updates(alg, st, r, shape, t)
    return t


class _Uploads:
    """Upload completion of each worker's occupancies (serial copy thread, K slots)."""

    def __init__(self, alg: Algebra, st: list[StageExprs], r: Rates, shape: PipelineShape, t: StepTimes):
        self.alg, self.st, self.r, self.shape, self.t = alg, st, r, shape, t
        self.order = {w: shape.occupancies(w) for w in range(shape.num_workers)}
        self.position = {occ: i for w in self.order for i, occ in enumerate(self.order[w])}
        self.ready = _update_offsets(st, r, shape) if shape.barrier and not shape.options.delayed else {}
        # the shape's settings, read once (done() asks for them at every occupancy)
        self.N, self.K, self.P, self.tie_in = shape.num_workers, shape.num_slots, shape.prefetch_gb, shape.tie_in

    def done(self, kind: str, j: int) -> Expr:
        """Upload completion of occupancy (kind, j), defining the worker's earlier ones first."""
        key = ("b" if kind == "B" else "f", j)
        known = self.t.upload_done.get(key)
        if known is not None:
            return known
        shape, w = self.shape, j % self.N
        occ = self.order[w]
        i = self.position[(kind, j)]
        terms: list[Expr] = []
        if i > 0:
            terms.append(self.done(*occ[i - 1]))
        if i >= self.K:
            terms.append(self._released(*occ[i - self.K]))
        if kind != "B" and j in self.ready:
            terms.append(self.ready[j])
        s, M = self.st[j], shape.micro_batches
        # a backward's offloaded inputs come back right after its weights
        back = kind == "B" and shape.offloads(j)
        nbytes = (s.pbytes + s.in_b * M if back else s.pbytes) if isinstance(back, bool) else either(
            back, lambda back: s.pbytes + s.in_b * M if back else s.pbytes)
        if i > 0 and self.P > 0:
            upload = self._partly_prefetched(key, j, terms, nbytes, occ[i - 1])
        else:
            upload = self.alg.max(("u" + key[0], j), terms) + nbytes * (1.0 / self.r.up[j])
        if kind == "B" and j == 0 and self.tie_in:  # then the head's end's gradient, once it is down
            head = self.t.download_done[shape.num_stages - 1]
            upload = (self.alg.max(("ut", j), [upload, head])
                      + shape.tied_gp * shape.grad_bytes * (1.0 / self.r.up[j]))
        free = shape.frees(w)
        value = (0.0 if free else upload) if isinstance(free, bool) else either(
            free, lambda free: 0.0 if free else upload)
        self.t.upload_done[key] = value
        return value

    def _partly_prefetched(self, key: tuple[str, int], j: int, terms: list[Expr], nbytes: Expr,
                           before: tuple[str, int]) -> Expr:
        """One slot and a prefetch buffer of ``P`` GB: the first ``min(P, pbytes)`` of the weights upload
        once the copy thread is free (and the stage updated), the rest once the slot is released too:
        done = max(prefix start + nbytes / up, rest start + max(nbytes - P, inputs reloaded) / up)."""
        inv, P = 1.0 / self.r.up[j], self.shape.prefetch_gb
        early = [self.done(*before)] + ([self.ready[j]] if key[0] == "f" and j in self.ready else [])
        prefix = self.alg.max(("p" + key[0], j), early)
        rest = self.alg.max(("u" + key[0], j), terms)
        return self.alg.max(("v" + key[0], j), [prefix + nbytes * inv, rest + (nbytes - P) * inv,
                                                rest + (nbytes - self.st[j].pbytes) * inv])

    def _released(self, kind: str, j: int) -> Expr:
        """When occupancy (kind, j) frees its slot: after its forward, or its gradient download."""
        return self.t.fwd_end[j] if kind == "F" else self.t.download_done[j]


def _update_offsets(st: list[StageExprs], r: Rates, shape: PipelineShape) -> dict[int, Expr]:
    """With a barrier: when (after the step starts) each swapped stage's CPU update of the previous
    step is done -- the worker updates them in ascending order from the step's start."""
    out: dict[int, Expr] = {}
    for w in range(shape.num_workers):
        total: Expr = 0.0
        for j in shape.swapped(w):
            total = total + cpu_params(st, shape, j) * (1.0 / r.cpu)
            out[j] = total
    return out


def cpu_params(st: list[StageExprs], shape: PipelineShape, j: int) -> Expr:
    """G parameters stage j's CPU update covers: all that train, but a tied head's end when one worker holds
    both ends (the embedding's store updates it: :func:`partition.costs.tied_end_held`)."""
    if j == shape.num_stages - 1 and shape.tie_in:
        return st[j].params - shape.tied_gp
    return st[j].params


def _device_updates(st: list[StageExprs], r: Rates, shape: PipelineShape, w: int) -> Expr:
    """Seconds of the worker's resident stages' device AdamW (with a barrier: before its first forward)."""
    return sum((st[j].params * (1.0 / r.device) for j in shape.stages_of(w) if j in shape.resident), 0.0)


class _PerMicroBatch:
    """Each stage's seconds per micro-batch of its forward (FB for the last stage) and of its backward, dispatch
    included, each stated once (a stage's is also the start of its neighbour's hop)."""

    def __init__(self, st: list[StageExprs], r: Rates, shape: PipelineShape):
        self.st, self.r, self.shape = st, r, shape
        self._fwd: dict[int, Expr] = {}
        self._bwd: dict[int, Expr] = {}

    def forward(self, j: int) -> Expr:
        per = self._fwd.get(j)
        if per is None:
            st, r, shape = self.st, self.r, self.shape
            per = self._fwd[j] = ((st[j].bwd if j == shape.num_stages - 1 else st[j].fwd)
                                  + r.message_s * shape.posts[0][j] + r.action_s)
        return per

    def backward(self, j: int) -> Expr:
        per = self._bwd.get(j)
        if per is None:
            r, shape = self.r, self.shape
            per = self._bwd[j] = shape.bwd_time(self.st[j], j) + r.message_s * shape.posts[1][j] + r.action_s
        return per


def _forward(alg: Algebra, st: list[StageExprs], r: Rates, shape: PipelineShape, t: StepTimes, up: _Uploads,
             pmb: _PerMicroBatch, j: int) -> None:
    """First and last micro-batch of stage j's forward (FB for the last stage)."""
    S, N, M = shape.num_stages, shape.num_workers, shape.micro_batches
    per = pmb.forward(j)
    first: list[Expr] = []
    if j not in shape.resident:
        first.append(up.done("FB" if j == S - 1 else "R" if shape.turns(j) else "F", j))
    last: list[Expr] = []
    if j >= N:
        first.append(t.fwd_end[j - N])
    elif shape.barrier and shape.resident:
        first.append(either(shape.frees(j), lambda free: 0.0 if free else _device_updates(st, r, shape, j)))
    if j > 0:
        hop = pmb.forward(j - 1) + st[j - 1].out_b * r.lat_in[j]  # (stage j - 1 < S - 1 runs a forward)
        first.append(t.fwd_start[j - 1] + hop)
        last.append(t.fwd_last[j - 1] + hop)
    t.fwd_start[j] = alg.max(("sf0_", j), first)
    t.fwd_last[j] = alg.max(("sfl_", j), last + [t.fwd_start[j] + per * (M - 1)])
    t.fwd_end[j] = t.fwd_last[j] + per
    if j == S - 1:
        t.bwd_start[j], t.bwd_last[j], t.bwd_end[j] = t.fwd_start[j], t.fwd_last[j], t.fwd_end[j]
        if j in shape.resident and not shape.barrier:
            t.bwd_end[j] = t.bwd_end[j] + st[j].params * (1.0 / r.device)


def _backward(alg: Algebra, st: list[StageExprs], r: Rates, shape: PipelineShape, t: StepTimes, up: _Uploads,
              pmb: _PerMicroBatch, j: int) -> None:
    """First and last micro-batch of stage j's backward (recompute + backward, or kept activations)."""
    N, M = shape.num_workers, shape.micro_batches
    first: list[Expr] = [t.fwd_end[j] if shape.last_forward(j) else t.bwd_end[j + N]]
    if not shape.turns(j):
        first.append(up.done("B", j))
    per = pmb.backward(j)
    hop = pmb.backward(j + 1) + st[j + 1].in_b * r.lat_back[j]
    first.append(t.bwd_start[j + 1] + hop)
    t.bwd_start[j] = alg.max(("sb0_", j), first)
    t.bwd_last[j] = alg.max(("sbl_", j), [t.bwd_last[j + 1] + hop, t.bwd_start[j] + per * (M - 1)])
    t.bwd_end[j] = t.bwd_last[j] + per
    if j in shape.resident and not shape.barrier:  # its device AdamW follows on the compute stream
        t.bwd_end[j] = t.bwd_end[j] + st[j].params * (1.0 / r.device)


@lru_cache(maxsize=None)
def _posts_table(num_stages: int, num_workers: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """:attr:`PipelineShape.posts` of every shape of ``num_stages`` stages on ``num_workers`` workers."""
    shape = PipelineShape(num_stages, num_workers, 1)
    return tuple(tuple(_posts(shape, j, backward) for j in range(num_stages)) for backward in (False, True))


def _posts(shape: PipelineShape, j: int, backward: bool) -> int:
    """Messages stage j's dispatch thread posts per micro-batch of a phase, where the neighbour is on another
    worker: the receive of its input and the send of its output (the last stage's FB: the activations in, their
    gradients out)."""
    S = shape.num_stages
    ends = (j - 1, j - 1) if j == S - 1 else (j + 1, j - 1) if backward else (j - 1, j + 1)
    return sum(0 <= k < S and shape.worker(k) != shape.worker(j) for k in ends)


def _download(alg: Algebra, st: list[StageExprs], r: Rates, shape: PipelineShape, t: StepTimes, j: int) -> None:
    """Gradients down after the stage's last backward, one download at a time per worker."""
    after = [t.bwd_end[j]]
    w = j % shape.num_workers
    later = [i for i in shape.swapped(w) if i > j]
    if later:
        after.append(t.download_done[min(later)])
    done = alg.max(("d", j), after) + st[j].params * (shape.grad_bytes / r.down[j])
    free = shape.frees(w)
    t.download_done[j] = (t.bwd_end[j] if free else done) if isinstance(free, bool) else either(
        free, lambda free: t.bwd_end[j] if free else done)


def _updates(alg: Algebra, st: list[StageExprs], r: Rates, shape: PipelineShape, t: StepTimes) -> None:
    """CPU updates per worker and the step's end (REDUCE)."""
    S = shape.num_stages
    ends = {0, S - 1} if shape.tied and S > 1 else set()
    assert not ends & shape.resident, "a tied weight's ends are exchanged through host memory"
    tie = None
    if ends:
        tie = alg.max(("tie", 0), [t.download_done[0], t.download_done[S - 1]]) + r.tie_s
    done: list[Expr] = list(t.download_done.values()) + [t.bwd_end[j] for j in shape.resident]
    done += [tie] if tie is not None else []
    if shape.options.delayed:
        done += _delayed_cpu_bounds(st, r, shape)
    if shape.barrier or shape.options.delayed:
        t.step = alg.max(("T", 0), done)
        return
    for w in range(shape.num_workers):
        swapped = shape.swapped(w)
        queue = [j for j in reversed(swapped) if j not in ends] + [j for j in swapped if j in ends]
        prev: Expr | None = None
        for j in queue:
            after = [tie if j in ends else t.download_done[j]] + ([prev] if prev is not None else [])
            t.update_done[j] = alg.max(("o", j), after) + cpu_params(st, shape, j) * (1.0 / r.cpu)
            prev = t.update_done[j]
        if prev is not None:
            done.append(either(shape.frees(w), lambda free: 0.0 if free else prev))
    t.step = alg.max(("T", 0), done)


def _delayed_cpu_bounds(st: list[StageExprs], r: Rates, shape: PipelineShape) -> list[Expr]:
    """Under a delayed update the CPU updates and compute copies run beside the next step, so a step lasts at
    least each worker's CPU work (at its share of the host while all update, as the simulator runs them when
    every worker is behind). (The uploads' wait for the copies, two steps back, is left out.)"""
    out: list[Expr] = []
    for w in range(shape.num_workers):
        work = sum((cpu_params(st, shape, j) * ((1.0 + r.copy_work) / r.cpu) for j in shape.swapped(w)), 0.0)
        out.append(either(shape.frees(w), lambda free: 0.0 if free else work))
    return out


def phase_needs(s: StageExprs, base: Expr, kept: Expr, M: int, keep_out: bool = False,
                keep_in_grad: bool = False, keeps_activations: bool = False) -> tuple[Expr, Expr]:
    """Device memory of a stage's forward and backward phase: the worker's slots and resident
    states (``base``), what earlier stages keep for their backwards, the stage's own ``M`` inputs (or,
    keeping its activations, its ``M`` micro-batches' graph) and the phase's working set (with one
    worker, also the ``M`` outputs kept for the next stage and the input gradients for the one before)."""
    own = (s.saved + s.in_b) * M if keeps_activations else s.in_b * M  # a kept graph holds its input too
    fwd = base + kept + own + s.work + (s.out_b * M if keep_out else 0.0)
    bwd = base + kept + own + s.work + (0.0 if keeps_activations else s.saved) + (s.in_b * M if keep_in_grad else 0.0)
    return fwd, bwd


def worker_needs(alg: Algebra, st: list[StageExprs], shape: PipelineShape,
                 workers: list[int] | None = None) -> dict[int, list[tuple[str, Expr]]]:
    """Per worker (all, or ``workers``), the device memory each of its phases needs: K slots of its
    largest swapped stage, its resident stages' states, what its pending backwards keep (boundary
    inputs or activations) and the phase's working set."""
    M, S = shape.micro_batches, shape.num_stages
    local = shape.num_workers == 1  # neighbours on one worker keep activations and their gradients on it
    out: dict[int, list[tuple[str, Expr]]] = {}
    for w in range(shape.num_workers) if workers is None else workers:
        mine, swapped = shape.stages_of(w), shape.swapped(w)
        if not mine:
            continue
        slots = alg.max(("slot", w), [st[j].slot for j in swapped]) * shape.num_slots + shape.prefetch_gb \
            if swapped else 0.0
        base = slots + sum((st[j].state for j in mine if j in shape.resident), 0.0)
        kept: Expr = 0.0
        out[w] = []
        for j in mine:
            s, held, away = st[j], kept, j in shape.offloaded  # away: its inputs wait in host memory unless kept
            fwd, bwd = either(shape.keeps(j), lambda keeps: phase_needs(s, base, held, M, local and j < S - 1,
                                                                         local and j > 0, keeps))
            out[w] += [(f"stage {j} forward", fwd), (f"stage {j} backward", bwd)]
            kept = either(shape.keeps(j), lambda keeps: held + (s.saved + s.in_b) * M if keeps
                          else held if away else held + s.in_b * M)
    return out


def _memory(alg: Algebra, st: list[StageExprs], shape: PipelineShape, budget: float) -> None:
    for needs in worker_needs(alg, st, shape).values():
        for what, need in needs:
            alg.require(need, budget, what)


def memory_peaks(st: list[StageExprs], shape: PipelineShape) -> list[float]:
    """Each worker's largest need (GB) under the memory model."""
    needs = worker_needs(Numbers(), st, shape)
    return [max((float(n) for _, n in needs.get(w, [])), default=0.0) for w in range(shape.num_workers)]
