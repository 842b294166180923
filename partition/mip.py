"""The partition MIP: which contiguous units form each stage, minimising the step time.

One model per stage count ``S`` (``S`` is enumerated; the stage-to-GPU worker_gpus may depend on it).
The timing and memory constraints are :mod:`partition.timing`'s statements emitted as rows (every
start time is bounded *below* by what it waits for: the paper's constraints 8-11 with the signs
the text implies), so for a fixed partition the MIP's optimum equals
:class:`partition.evaluate.ModelEvaluator`'s step time.

Partition encodings (both give every per-stage quantity as a linear expression):

* **count** (``prefix + identical blocks + suffix``, the normal embed/blocks/head model): an integer
  ``n_j`` blocks per stage, the embedding on stage 0 and the head on stage ``S-1``; two binaries
  say whether the end stages hold any block (their working set and boundary activation depend on it).
* **cut** (any units): binaries ``z[i,j]`` = "unit i lies in stages 0..j", monotone in both indices;
  unit i's membership of stage j is ``z[i,j] - z[i,j-1]``.

Only the first and last micro-batch of each phase need variables: with identical micro-batches the
last one's start is the longest path through the (stage, micro-batch) grid, which the two chains
express exactly (the paper's per-micro-batch constraint 10 is implied).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Literal

from mobius.errors import MobiusError
from partition.costs import ModelProfile, UnitCost, stage_cost
from partition.evaluate import GB, ModelEvaluator, rates_for, slot_gb, stage_exprs, state_gb
from partition.schedule import PipelineOptions
from partition.hardware import Hardware
from partition.heuristic import find_incumbent
from partition.lp import LinearModel, Lin, SolveResult, SolverName, solve
from partition.timing import Rows, PipelineShape, StageExprs, phase_needs, step_model

log = logging.getLogger(__name__)

DEFAULT_REL_GAP = 0.005  # step-time predictions carry errors of several percent; 0.5% keeps large solves short
PROVEN_GAP = 1e-6  # a plan is called optimal when the solver proved nothing is faster by more than this
Encoding = Literal["auto", "count", "cut"]
BandwidthView = Literal["link", "shared"]


@dataclass
class BuiltModel:
    """A model for one stage count plus what is needed to read its solution."""

    lm: LinearModel
    num_stages: int
    encoding: str
    decode: Callable[[list[float]], list[int]]


@dataclass
class StageCountResult:
    """The outcome for one stage count."""

    num_stages: int
    status: str  # optimal | feasible (gap not closed) | cutoff (cannot beat the best) | infeasible | local search | given
    predicted_s: float
    bound: float
    boundaries: list[int] | None
    solver: str
    solve_s: float
    num_vars: int
    num_rows: int
    encoding: str


@dataclass
class MipResult:
    """The best partition over all stage counts tried, with the proof of how good it is."""

    best: StageCountResult | None
    per_stage_count: list[StageCountResult]
    solve_s: float
    lower_bound: float
    stage_counts_skipped: int = 0  # not tried before the time limit
    alternatives: list[StageCountResult] = field(default_factory=list)  # :func:`near_best`, the best first

    @property
    def solver(self) -> str:
        names = sorted({r.solver for r in self.per_stage_count if r.solver})
        return "+".join(names) or "none"

    @property
    def gap(self) -> float:
        """The best plan's distance from the proven lower bound, as a fraction of its time."""
        if self.best is None:
            return math.inf
        return max(0.0, (self.best.predicted_s - self.lower_bound) / self.best.predicted_s)

    @property
    def proven(self) -> bool:
        """True when the solver proved no partition (of the stage counts allowed) is faster."""
        return self.best is not None and self.stage_counts_skipped == 0 and self.gap <= PROVEN_GAP * 1.001

    def status_text(self) -> str:
        """``optimal`` only when proven; otherwise how far from proven (or why unknown)."""
        if self.best is None:
            return "no plan"
        if self.best.status == "given":
            return "given partition (not optimised)"
        if self.proven:
            return "optimal"
        if self.stage_counts_skipped and self.lower_bound > 0:
            return (f"within {100 * self.gap:.2f}% of optimal; {self.stage_counts_skipped} stage count(s) not tried "
                    f"before the time limit, bounded by their compute alone")
        if self.stage_counts_skipped:
            return f"best found; {self.stage_counts_skipped} stage count(s) not tried before the time limit"
        if self.lower_bound <= 0:
            return "best found; the time limit left a stage count without a lower bound"
        return f"within {100 * self.gap:.2f}% of optimal"

    @property
    def max_size(self) -> tuple[int, int]:
        """Largest (variables, constraints) among the models built."""
        if not self.per_stage_count:
            return (0, 0)
        return (max(r.num_vars for r in self.per_stage_count), max(r.num_rows for r in self.per_stage_count))


# ---------------------------------------------------------------------------------- encodings
def _unit_lin(u: UnitCost, half: bool) -> dict[str, float]:
    """A unit's additive quantities in the model's units (its stage's work and boundaries are not)."""
    t = u.trainable_count
    return {"fwd": u.fwd_s, "bwd": u.bwd_s + u.acc_s, "params": t / GB, "pbytes": u.param_bytes / GB,
            "slot": slot_gb(u.param_bytes, u.grad_bytes, t, half),
            "state": state_gb(u.param_bytes, u.grad_bytes, t, half), "saved": u.saved_bytes / GB}


def _count_encoding(lm: LinearModel, profile: ModelProfile, S: int) -> tuple[list[StageExprs], Callable]:
    """Integer block counts per stage; embedding on stage 0, head on stage S-1."""
    units = profile.units
    emb, blk, head = units[0], units[1], units[-1]
    L = len(units) - 2
    n = [lm.var(f"n{j}", 0 if j in (0, S - 1) else 1, L, integer=True) for j in range(S)]
    lm.add(sum(n, Lin()), "==", L)
    has_block = {}  # end stages: 1 when the stage holds at least one block
    for j in {0, S - 1}:
        has_block[j] = lm.var(f"y{j}", 0, 1, integer=True)
        lm.add(n[j], "<=", has_block[j] * L)
        lm.add(n[j], ">=", has_block[j])
    half = profile.precision != "fp32"
    b = _unit_lin(blk, half)
    stages = []
    for j in range(S):
        fixed = [u for u, on in ((emb, j == 0), (head, j == S - 1)) if on]
        sums = {k: sum(_unit_lin(u, half)[k] for u in fixed) + n[j] * b[k] for k in b}
        if fixed:
            fw = max(u.work_bytes for u in fixed) / GB
            work = has_block[j] * max(0.0, blk.work_bytes / GB - fw) + fw
        else:
            work = Lin(const=blk.work_bytes / GB)
        stages.append(StageExprs(fwd=sums["fwd"], bwd=sums["bwd"], params=sums["params"], pbytes=sums["pbytes"],
                                 slot=sums["slot"], state=sums["state"], in_b=Lin(), out_b=Lin(), saved=sums["saved"],
                                 work=work))
    out0 = has_block[0] * ((blk.act_bytes - emb.act_bytes) / GB) + emb.act_bytes / GB
    for j, st in enumerate(stages):
        st.out_b = out0 if j == 0 else Lin(const=(head.act_bytes if j == S - 1 else blk.act_bytes) / GB)
        st.in_b = Lin(const=emb.in_bytes / GB) if j == 0 else stages[j - 1].out_b

    def decode(x: list[float]) -> list[int]:
        bounds = [0]
        for j, nj in enumerate(n):
            bounds.append(bounds[-1] + int(round(nj.value(x))) + (j == 0) + (j == S - 1))
        return bounds

    return stages, decode


def _cut_encoding(lm: LinearModel, profile: ModelProfile, S: int) -> tuple[list[StageExprs], Callable]:
    """Binaries z[i][j] = "unit i lies in stages 0..j" (any units)."""
    units = profile.units
    U = len(units)
    z = _cut_variables(lm, U, S)

    def member(i: int, j: int) -> Lin:
        return z[i][j] - (z[i][j - 1] if j > 0 else Lin())

    stages = []
    for j in range(S):
        half = profile.precision != "fp32"
        sums = {k: Lin() for k in _unit_lin(units[0], half)}
        for i, u in enumerate(units):
            m = member(i, j)
            if m.terms or m.const:
                for k, v in _unit_lin(u, half).items():
                    if v:
                        sums[k] = sums[k] + m * v
        stages.append(StageExprs(fwd=sums["fwd"], bwd=sums["bwd"], params=sums["params"], pbytes=sums["pbytes"],
                                 slot=sums["slot"], state=sums["state"], in_b=Lin(), out_b=Lin(), saved=sums["saved"],
                                 work=_cut_work(lm, units, z, j)))
    for j, st in enumerate(stages):
        if j == 0:
            st.in_b = Lin(const=units[0].in_bytes / GB)
        else:  # unit i opens stage j  <=>  z[i-1][j-1] - z[i][j-1] == 1
            st.in_b = sum(((z[i - 1][j - 1] - z[i][j - 1]) * (units[i].in_bytes / GB) for i in range(1, U)), Lin())
    for j, st in enumerate(stages):
        st.out_b = stages[j + 1].in_b if j + 1 < S else Lin(const=units[-1].act_bytes / GB)

    def decode(x: list[float]) -> list[int]:
        return [0] + [sum(1 for i in range(U) if z[i][j].value(x) > 0.5) for j in range(S - 1)] + [U]

    return stages, decode


def _cut_variables(lm: LinearModel, U: int, S: int) -> list[list[Lin]]:
    """z[i][j] for U units and S stages. Every stage holds at least one unit, so z is fixed to 1
    for i <= j and to 0 for i > U - S + j; only the units in between are variables. Rows: z is a
    prefix in i, and each stage's prefix is longer than the previous one (non-empty stages, which
    also makes z non-decreasing in j)."""
    z: list[list[Lin]] = [[Lin()] * S for _ in range(U)]
    for i in range(U):
        for j in range(S):
            if i <= j or j == S - 1:
                z[i][j] = Lin(const=1.0)
            elif i <= U - S + j:
                z[i][j] = lm.var(f"z{i}_{j}", 0, 1, integer=True)
    for j in range(S - 1):
        for i in range(1, U - 1):
            if z[i][j].terms and z[i + 1][j].terms:
                lm.add(z[i][j], ">=", z[i + 1][j])
    prefix = [sum((z[i][j] for i in range(U)), Lin()) for j in range(S)]
    for j in range(1, S):
        lm.add(prefix[j], ">=", prefix[j - 1] + 1)
    return z


def _cut_work(lm: LinearModel, units: list[UnitCost], z: list[list[Lin]], j: int) -> Lin:
    """The stage's working set: a variable at least the value of every run of equal-work units the
    stage touches (stage j touches run [a, b] iff z[a][j] = 1 and z[b][j-1] = 0)."""
    floor = min(u.work_bytes for u in units) / GB
    runs: list[list[int]] = []
    for i, u in enumerate(units):
        if runs and units[runs[-1][0]].work_bytes == u.work_bytes:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    rows = []
    for a, b in runs:
        w = units[a].work_bytes / GB
        touch = z[a][j] - (z[b][j - 1] if j > 0 else Lin())
        if w > floor and (touch.terms or touch.const > 0):
            rows.append((w, touch))
    if not rows:
        return Lin(const=floor)
    if all(not t.terms for _, t in rows):
        return Lin(const=max([floor] + [w for w, t in rows if t.const > 0]))
    var = lm.var(f"work{j}", floor)
    for w, touch in rows:
        lm.add(var, ">=", touch * w)
    return var


# ---------------------------------------------------------------------------------- the model
def build_model(profile: ModelProfile, hw: Hardware, worker_gpus: list[int], micro_batches: int, num_stages: int,
                encoding: Encoding = "auto", bandwidth: BandwidthView = "link",
                options: PipelineOptions = PipelineOptions()) -> BuiltModel:
    """The MIP for ``num_stages`` stages. ``bandwidth="link"`` gives each GPU its uncontended link
    rate (transfers under one root complex do not slow each other); ``"shared"`` divides each root
    complex's capacity among its GPUs (every GPU uploading at once)."""
    if encoding == "auto":
        encoding = "count" if profile.identical_blocks() else "cut"
    lm = LinearModel()
    S = num_stages
    if encoding == "count":
        st, decode = _count_encoding(lm, profile, S)
    else:
        st, decode = _cut_encoding(lm, profile, S)
    assert not options.resident and not options.kept, "residency is chosen after the partition (plan.py)"
    shape = PipelineShape(S, len(worker_gpus), micro_batches, options, profile.tied_params / GB)
    rates = rates_for(profile, hw, worker_gpus, S, bandwidth, options.grad_dtype == "half")
    times = step_model(Rows(lm), st, rates, shape, hw.gpu_memory_bytes / GB)
    lm.objective = times.step if isinstance(times.step, Lin) else Lin(const=times.step)
    return BuiltModel(lm, S, encoding, decode)


# ---------------------------------------------------------------------------------- search
def solve_stage_count(profile: ModelProfile, hw: Hardware, worker_gpus: list[int], micro_batches: int, num_stages: int,
                      solver: SolverName = "auto", time_limit_s: float = 30.0, cutoff: float | None = None,
                      encoding: Encoding = "auto", bandwidth: BandwidthView = "link",
                      rel_gap: float = 1e-4, options: PipelineOptions = PipelineOptions()) -> StageCountResult:
    """Build and solve the model for one stage count (to ``rel_gap`` relative optimality gap). With a
    ``cutoff``, only a partition faster than it counts; status ``cutoff`` proves none exists."""
    built = build_model(profile, hw, worker_gpus, micro_batches, num_stages, encoding, bandwidth, options)
    lm = built.lm
    out = StageCountResult(num_stages, "infeasible", math.inf, math.inf, None, "", 0.0, lm.num_vars, lm.num_rows,
                           built.encoding)
    if lm.trivially_infeasible():
        return out
    chosen = solver
    if solver == "auto" and not lm.fits_free_gurobi():
        log.debug("S=%d: %d variables, %d constraints exceed the free gurobipy licence; using HiGHS",
                  num_stages, lm.num_vars, lm.num_rows)
        chosen = "highs"
    res: SolveResult = solve(lm, chosen, time_limit_s, cutoff, rel_gap)
    out.status, out.solver, out.solve_s = res.status, res.solver, res.solve_s
    out.predicted_s, out.bound = res.objective, res.bound
    worse = cutoff is not None and res.objective >= cutoff * (1 - 1e-9)
    if cutoff is not None and (res.status in ("infeasible", "cutoff") or res.status == "optimal" and worse):
        out.status, out.predicted_s, out.bound = "cutoff", math.inf, cutoff  # proven: nothing here beats the cutoff
        return out
    if not res.has_solution or worse:  # stopped by the time limit: nothing proven beyond the solver's bound
        out.status, out.bound = "time limit", min(res.bound, cutoff if cutoff is not None else math.inf)
        return out
    if res.has_solution:
        out.boundaries = built.decode(res.values)
        if res.status == "optimal" and res.bound < res.objective * (1 - PROVEN_GAP):
            out.status = f"within {100 * (1 - res.bound / res.objective):.2f}%"
    return out


OWED_MARGIN = 1.5  # the owed time's margin: solves overrun unevenly (one of 69 short solves of a 70B model: 0.17 s)
FIRST_PASS_SHARE = 0.25  # of the time left (less what the counts after it are owed): the most a first solve takes
FIRST_PASS_MIN_S = 0.01  # what every stage count's first solve is owed (a root relaxation: on OPT-13B's 33-stage
# model its bound after 0.01 s is within 1.1% of its bound after 0.05 s), beside the time a solve takes beyond that
# (building its model, the solver overrunning its limit), measured as the pass goes


def solve_partition(profile: ModelProfile, hw: Hardware, gpus_for: Callable[[int], list[int]], micro_batches: int,
                    solver: SolverName = "auto", time_limit_s: float = 30.0, stage_counts: list[int] | None = None,
                    encoding: Encoding = "auto", bandwidth: BandwidthView = "link",
                    seed: bool = True, rel_gap: float = DEFAULT_REL_GAP,
                    options: PipelineOptions = PipelineOptions(), beat: float = math.inf) -> MipResult:
    """The fastest partition over every stage count (``1..units`` unless given), proven by the MIP
    to within ``rel_gap`` where the time limit allows; the achieved gap is reported.

    With ``seed`` a local search on the same timing model (:mod:`partition.heuristic`) first finds
    a strong incumbent; the MIPs then run with the best time so far as a cutoff, in two passes: every
    stage count in the order the local search ranks them, each with at most ``FIRST_PASS_SHARE`` of
    the time left beyond what each count after it is owed (``FIRST_PASS_MIN_S`` and the measured time
    beyond it, with ``OWED_MARGIN``; the best-ranked get the most, and every count is tried), which
    settles most and bounds the rest; then the counts still open, the lowest bound first, sharing
    what time is left -- so one hard count cannot leave the others untried. Stage counts below
    :func:`fewest_stages` cannot fit and are not solved. The result's ``alternatives`` are the
    near-best and finest partitions of other stage counts (:func:`near_best`) for the residency pass, those the
    local search found solved again without a cutoff in the time left (:meth:`_CountSearch.polish`). The local
    search stops climbing at the time limit too. ``beat``: a step time found elsewhere (another runtime setting's
    best): the MIPs look only for partitions faster than it (and than the best found here), so a count that cannot
    beat it is settled at once.
    """
    t0 = time.perf_counter()
    counts = stage_counts or list(range(1, profile.num_units + 1))
    ev = ModelEvaluator(profile, hw, gpus_for, micro_batches, bandwidth, options)
    search = _CountSearch(lambda S, cap, cutoff: solve_stage_count(
        profile, hw, gpus_for(S), micro_batches, S, solver, cap, cutoff, encoding, bandwidth, rel_gap, options),
        t0 + time_limit_s, rel_gap, lambda S: compute_bound(profile, S, len(gpus_for(S)), micro_batches, options,
                                                            hw.gpu_memory_bytes), beat=beat)
    ranking: dict[int, float] = {}
    inc = None
    if seed:
        inc = find_incumbent(ev, counts, deadline=t0 + time_limit_s)
        ranking = inc.per_stage_count
        if inc.boundaries is not None:
            search.best = model_result(ev, inc.boundaries, gpus_for)
    order = sorted(counts, key=lambda S: (ranking.get(S, math.inf), S))
    fewest = fewest_stages(profile, hw.gpu_memory_bytes, options)
    search.results = {S: StageCountResult(S, "infeasible", math.inf, math.inf, None, "", 0.0, 0, 0, "memory bound")
                      for S in order if S < fewest}
    search.first_pass([S for S in order if S >= fewest])
    search.second_pass()
    done, best = sorted(search.results.values(), key=lambda r: r.num_stages), search.best
    skipped = len(counts) - len(done)
    if best is not None and best.status == "local search":
        proven = all(r.status in ("cutoff", "infeasible") for r in done) and not skipped
        best.status = "optimal" if proven else best.status
    alternatives = near_best(best, done, inc.partitions if inc else {}, inc.per_stage_count if inc else {})
    return MipResult(best, done, time.perf_counter() - t0, _lower_bound(done, counts, best, search.floor), skipped,
                     search.polish(alternatives))


NEAR_BEST = 0.05  # alternatives: partitions of other stage counts within this fraction of the best's model time
ALTERNATIVES = 4  # at most this many partitions near the best (the best included) go on to the residency pass
FINEST = 2  # and this many of the largest stage counts' partitions


def near_best(best: StageCountResult | None, solved: list[StageCountResult], found: dict[int, list[int]],
              values: dict[int, float]) -> list[StageCountResult]:
    """The best partition, then the ``FINEST`` largest stage counts' (each count's best from the MIP or the local
    search), then the stage counts nearest the best in the timing model (within ``NEAR_BEST``; with the best, up
    to ``ALTERNATIVES``), fastest first. The model leaves out what the residency pass adds (resident stages, kept
    activations), which can reorder partitions this close; the finest come first, as small stages let the
    residency pass fill the memory that the swapped slots leave more closely. The plan simulates each with its
    own choice (the residency passes that fit its time)."""
    if best is None or best.boundaries is None:
        return []
    per: dict[int, StageCountResult] = {
        S: StageCountResult(S, "local search", values[S], 0.0, b, "", 0.0, 0, 0, "local search")
        for S, b in found.items()}
    for r in solved:
        if r.boundaries is not None and r.predicted_s <= per.get(r.num_stages, r).predicted_s:
            per[r.num_stages] = r
    per[best.num_stages] = best
    finest = [S for S in sorted(per, reverse=True) if S != best.num_stages][:FINEST]
    near = sorted((r for S, r in per.items() if S != best.num_stages and S not in finest
                   and r.predicted_s <= best.predicted_s * (1 + NEAR_BEST)), key=lambda r: r.predicted_s)
    return [best] + [per[S] for S in finest] + near[:ALTERNATIVES - 1]


@dataclass
class _CountSearch:
    """The MIP's passes over the stage counts until ``deadline`` (:func:`solve_partition`)."""

    solve: Callable[[int, float, float | None], StageCountResult]  # (count, seconds, cutoff) -> its result
    deadline: float  # time.perf_counter() at which the search stops
    rel_gap: float
    floor: Callable[[int], float] = lambda S: 0.0  # a bound on every partition of a count, known without solving
    beat: float = math.inf  # a step time found elsewhere that a partition must beat to count (solve_partition)
    best: StageCountResult | None = None
    results: dict[int, StageCountResult] = field(default_factory=dict)
    overheads: list[float] = field(default_factory=list)  # each solve's seconds beyond its solver's within its cap

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def bar(self) -> float:
        """What a partition must beat: the best found here, or ``beat``, the faster."""
        return min(self.best.predicted_s if self.best is not None else math.inf, self.beat)

    def count(self, S: int, cap: float) -> None:
        """Solve stage count ``S`` for at most ``cap`` seconds against the best plan so far."""
        cutoff = self.bar() * (1 - self.rel_gap) if math.isfinite(self.bar()) else None  # a real improvement
        start = time.perf_counter()
        r = self.solve(S, cap, cutoff)
        self.overheads.append(max(0.0, time.perf_counter() - start - min(cap, r.solve_s)))  # model build, overrun
        if r.status not in ("cutoff", "infeasible") and math.isfinite(r.bound):
            r.bound = max(r.bound, self.floor(S))  # (a quick root bound can be weaker)
        self.results[S] = r
        if r.boundaries is not None and (self.best is None or r.predicted_s < self.best.predicted_s):
            self.best = r

    def first_pass(self, todo: list[int]) -> None:
        """Every count in ``todo``'s order, each with at most ``FIRST_PASS_SHARE`` of the time left
        beyond what the counts after it are owed (``FIRST_PASS_MIN_S`` plus the measured overhead)."""
        for i, S in enumerate(todo):
            left = self.left()
            if left <= 0:
                log.warning("partition time limit reached before trying %d stages", S)
                return
            each = FIRST_PASS_MIN_S + (sum(self.overheads) / len(self.overheads) if self.overheads else 0.0)
            owed = OWED_MARGIN * each * (len(todo) - i)  # this count's and those after it
            self.count(S, min(left, FIRST_PASS_MIN_S + FIRST_PASS_SHARE * max(0.0, left - owed)))

    def polish(self, alternatives: list[StageCountResult]) -> list[StageCountResult]:
        """``alternatives`` with those the local search found solved again by the MIP in the time left, without a
        cutoff (its count's best partition, where the cutoff of a better count's left the local search's); the
        best stays first."""
        todo = [i for i, r in enumerate(alternatives) if i > 0 and r.status == "local search"]
        out = list(alternatives)
        for n, i in enumerate(todo):
            left = self.left()
            if left <= 0.01:
                break
            r = self.solve(out[i].num_stages, left / (len(todo) - n), None)
            if r.boundaries is not None and r.predicted_s < out[i].predicted_s:
                out[i] = r
        return out

    def second_pass(self) -> None:
        """The counts still open, the lowest bound first, sharing the time left."""
        todo = sorted((r.num_stages for r in self.results.values() if _open(r, self.best, self.bar(), self.rel_gap)),
                      key=lambda S: self.results[S].bound)
        for i, S in enumerate(todo):
            left = self.left()
            if left <= 0.01:
                return
            if _open(self.results[S], self.best, self.bar(), self.rel_gap):  # (a better plan found since may
                # have settled it)
                self.count(S, left / (len(todo) - i))


def _open(r: StageCountResult, best: StageCountResult | None, bar: float, rel_gap: float) -> bool:
    """Whether a stage count's solve left room below what a partition must beat (``bar``: the best plan's time, or
    less; more than ``rel_gap``)."""
    if r.status in ("cutoff", "infeasible") or r is best and r.status == "optimal":
        return False
    return r.bound < bar * (1 - rel_gap)


def fewest_stages(profile: ModelProfile, budget_bytes: int, options: PipelineOptions) -> int:
    """A stage count below which no partition fits: every stage's ``K`` slots and working set must
    fit a GPU (its worker holds at least that: :func:`_fits`), and contiguous stages under that cap need at
    least the count the greedy packing finds. ``num_units + 1`` when a unit alone does not fit."""
    parts, slot, work = 0, 0.0, 0.0
    for s, w in _unit_needs(profile):
        if parts and _fits(slot + s, max(work, w), budget_bytes, options):
            slot, work = slot + s, max(work, w)
            continue
        if not _fits(s, w, budget_bytes, options):
            return profile.num_units + 1
        parts, slot, work = parts + 1, s, w
    return parts


def _unit_needs(profile: ModelProfile) -> list[tuple[float, float]]:
    """Each unit's device slot and working set, in GB."""
    half = profile.precision != "fp32"
    return [(slot_gb(u.param_bytes, u.grad_bytes, u.trainable_count, half), u.work_bytes / GB) for u in profile.units]


def _fits(slot: float, work: float, budget_bytes: int, options: PipelineOptions) -> bool:
    """Whether a stage of ``slot`` GB per slot and a ``work`` GB working set fits a GPU in its ``K`` slots (numbers
    summed in another order must not cut a stage that fits)."""
    return slot * options.num_slots + work <= budget_bytes / GB * (1 + 1e-9)


def given_partition(profile: ModelProfile, hw: Hardware, gpus_for: Callable[[int], list[int]], micro_batches: int,
                    boundaries: list[int], bandwidth: BandwidthView = "link",
                    options: PipelineOptions = PipelineOptions()) -> MipResult:
    """A result for a partition chosen by the user (``parallel.stages``), scored by the timing model."""
    t0 = time.perf_counter()
    ev = ModelEvaluator(profile, hw, gpus_for, micro_batches, bandwidth, options)
    res = model_result(ev, list(boundaries), gpus_for)
    res.status, res.encoding = "given", "given"
    return MipResult(res, [res], time.perf_counter() - t0, res.predicted_s)


def model_result(ev: ModelEvaluator, bounds: list[int], gpus_for: Callable[[int], list[int]]) -> StageCountResult:
    """A result for a partition the local search (or the user) chose; its time is the model's."""
    return StageCountResult(len(bounds) - 1, "local search", ev.step_time(bounds), 0.0, bounds, "", 0.0, 0, 0,
                            "local search")


def _lower_bound(results: list[StageCountResult], counts: list[int], best: StageCountResult | None,
                 floor: Callable[[int], float] = lambda S: 0.0) -> float:
    """The smallest step time that no stage count has been proven unable to beat: the lowest bound of
    the counts solved (one proven unable to beat the best plan is bounded by it) and of the counts not tried
    (their ``floor``: :func:`compute_bound`, 0 where it says nothing)."""
    tried = {r.num_stages for r in results}
    bounds = [r.bound if math.isfinite(r.bound) else 0.0 for r in results if r.status != "infeasible"]
    bounds += [floor(S) for S in counts if S not in tried]
    if best is not None and math.isfinite(best.predicted_s):
        bounds = [min(b, best.predicted_s) for b in bounds]
    return min(bounds) if bounds else math.inf


def compute_bound(profile: ModelProfile, num_stages: int, num_workers: int, micro_batches: int,
                  options: PipelineOptions, budget_bytes: int) -> float:
    """A lower bound on the timing model's step for every partition into ``num_stages`` stages, without solving.

    Each worker's compute lies on one chain of the model (its stages' forwards in order, then their backwards:
    :func:`partition.timing.step_model`), and the step ends after the last of it, so the step is at least the
    compute of every worker together over ``num_workers``. Every stage but the last recomputes its forward in its
    backward, so that compute is every unit's forward and backward (fp32 sums included) less the forward of the
    units in the last stage: at most the longest suffix of units that fits one stage's ``num_slots`` slots and
    working set (:func:`fewest_stages`' rule) and leaves a unit for each stage before it. 0 where the options fix
    kept or resident stages (their compute or memory differs)."""
    if options.kept or options.resident:
        return 0.0
    units, needs = profile.units, _unit_needs(profile)
    slot, work, first = 0.0, 0.0, len(units)
    while first > num_stages - 1:
        s, w = slot + needs[first - 1][0], max(work, needs[first - 1][1])
        if first < len(units) and not _fits(s, w, budget_bytes, options):
            break
        first, slot, work = first - 1, s, w
    compute = sum(u.fwd_s + u.bwd_s + u.acc_s for u in units) - sum(u.fwd_s for u in units[first:])
    return micro_batches * compute / num_workers


def explain_infeasible(profile: ModelProfile, hw: Hardware, micro_batches: int,
                       options: PipelineOptions = PipelineOptions()) -> MobiusError:
    """An error naming the unit that cannot fit (alone on a GPU, as the first stage of its worker)
    and the shortfall in bytes."""
    budget = hw.gpu_memory_bytes
    half = profile.precision != "fp32"
    worst: tuple[float, str, str, float] | None = None
    for i, u in enumerate(profile.units):
        s = stage_exprs(stage_cost(profile, i, i + 1), half)
        fwd, bwd = phase_needs(s, s.slot * options.num_slots, 0.0, micro_batches)
        for need, what in ((fwd * GB, "forward"), (bwd * GB, "backward")):
            if need > budget and (worst is None or need - budget > worst[0]):
                worst = (need - budget, u.name, what, need)
    setting = (f"{micro_batches} micro-batches of {profile.micro_batch_size} x {profile.seq_len} tokens, "
               f"{profile.precision}, {options.num_slots} device slot(s)")
    if worst is not None:
        short, name, what, need = worst
        return MobiusError(f"the model cannot fit: unit {name!r} alone needs {int(need):,} bytes for its {what} "
                           f"({setting}) but a GPU has {budget:,} usable bytes: short by {int(short):,} bytes")
    return MobiusError(f"no partition of the {profile.num_units} units fits {budget:,} usable bytes per GPU ({setting}): "
                       f"every unit fits alone, but a worker also keeps its stages' boundary inputs and a slot "
                       f"sized for its largest stage; use more GPUs or fewer micro-batches")
