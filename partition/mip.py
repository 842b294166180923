"""The partition MIP: which contiguous units form each stage, minimising the step time.

One model per stage count ``S`` (``S`` is enumerated; the stage-to-GPU slots may depend on it).
The pipeline is modelled as :mod:`partition.pipeline` describes it, with every start time bounded
*below* by its predecessors (the paper's constraints 8-11 with the signs the text implies).

Partition encodings (both give every per-stage quantity as a linear expression):

* **count** (``prefix + identical blocks + suffix``, the normal embed/blocks/head model): an integer
  ``n_j`` blocks per stage, the embedding on stage 0 and the head on stage ``S-1``; two binaries
  say whether the end stages hold any block (their working set and boundary activation depend on it).
* **cut** (any units): binaries ``z[i,j]`` = "unit i lies in stages 0..j", monotone in both indices;
  unit i's membership of stage j is ``z[i,j] - z[i,j-1]``.

Pipeline variables per stage ``j`` (``g`` its GPU, ``N`` slots, ``M`` micro-batches):
``sf0, sfl`` start of the first/last micro-batch's forward, ``sb0, sbl`` the same for backward,
``uf, ub`` upload complete, ``pf, pb`` bytes prefetched, ``rb`` start of the backward prefetch
window it offers the next stage, ``d`` gradients downloaded, ``o`` optimizer done; and ``T``.
Only the first and last micro-batch need variables: with identical micro-batches the last one's
start is ``max_k(first-job chain to k + (M-1) * T_k + last-job chain from k)``, which the two
chains below express exactly (the paper's per-micro-batch constraint 10 is implied).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Literal

from mobius.errors import MobiusError
from partition.costs import ModelProfile, UnitCost, stage_cost
from partition.evaluate import ModelEvaluator
from partition.hardware import Hardware
from partition.heuristic import find_incumbent
from partition.lp import LinearModel, Lin, SolveResult, SolverName, solve
from partition.pipeline import PipelineShape, activation_latency

log = logging.getLogger(__name__)

GB = 1e9  # the model measures bytes in GB so that its coefficients stay near 1
DEFAULT_REL_GAP = 0.005  # step-time predictions carry errors of several percent; 0.5% keeps large solves short
Encoding = Literal["auto", "count", "cut"]
BandwidthView = Literal["link", "shared"]


@dataclass
class StageExprs:
    """Per-stage linear expressions (bytes in GB, times in seconds)."""

    fwd: Lin
    bwd: Lin
    params: Lin  # parameter count / 1e9
    pbytes: Lin
    gbytes: Lin
    in_b: Lin
    out_b: Lin
    saved: Lin
    work: Lin


@dataclass
class BuiltModel:
    """A model for one stage count plus what is needed to read its solution."""

    lm: LinearModel
    num_stages: int
    encoding: str
    decode: Callable[[list[float]], list[int]]
    prefetch: dict[str, list[Lin]] = field(default_factory=dict)


@dataclass
class StageCountResult:
    """The outcome for one stage count."""

    num_stages: int
    status: str
    predicted_s: float
    bound: float
    boundaries: list[int] | None
    solver: str
    solve_s: float
    num_vars: int
    num_rows: int
    encoding: str
    prefetch_f: list[float] = field(default_factory=list)
    prefetch_b: list[float] = field(default_factory=list)


@dataclass
class MipResult:
    """The best partition over all stage counts tried, with the proof of how good it is."""

    best: StageCountResult | None
    per_stage_count: list[StageCountResult]
    solve_s: float
    lower_bound: float

    @property
    def solver(self) -> str:
        names = sorted({r.solver for r in self.per_stage_count if r.solver})
        return "+".join(names) or "none"

    @property
    def gap(self) -> float:
        if self.best is None:
            return math.inf
        return max(0.0, (self.best.predicted_s - self.lower_bound) / self.best.predicted_s)

    @property
    def max_size(self) -> tuple[int, int]:
        """Largest (variables, constraints) among the models built."""
        if not self.per_stage_count:
            return (0, 0)
        return (max(r.num_vars for r in self.per_stage_count), max(r.num_rows for r in self.per_stage_count))


# ---------------------------------------------------------------------------------- encodings
def _unit_lin(u: UnitCost) -> dict[str, float]:
    return {"fwd": u.fwd_s, "bwd": u.bwd_s, "params": u.param_count / GB, "pbytes": u.param_bytes / GB,
            "gbytes": u.grad_bytes / GB, "saved": u.saved_bytes / GB}


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
    b = _unit_lin(blk)
    stages = []
    for j in range(S):
        fixed = [u for u, on in ((emb, j == 0), (head, j == S - 1)) if on]
        sums = {k: sum(_unit_lin(u)[k] for u in fixed) + n[j] * b[k] for k in b}
        if fixed:
            fw = max(u.work_bytes for u in fixed) / GB
            work = has_block[j] * max(0.0, blk.work_bytes / GB - fw) + fw
        else:
            work = Lin(const=blk.work_bytes / GB)
        stages.append(StageExprs(fwd=sums["fwd"], bwd=sums["bwd"], params=sums["params"], pbytes=sums["pbytes"],
                                 gbytes=sums["gbytes"], in_b=Lin(), out_b=Lin(), saved=sums["saved"], work=work))
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
        sums = {k: Lin() for k in _unit_lin(units[0])}
        for i, u in enumerate(units):
            m = member(i, j)
            if m.terms or m.const:
                for k, v in _unit_lin(u).items():
                    if v:
                        sums[k] = sums[k] + m * v
        stages.append(StageExprs(fwd=sums["fwd"], bwd=sums["bwd"], params=sums["params"], pbytes=sums["pbytes"],
                                 gbytes=sums["gbytes"], in_b=Lin(), out_b=Lin(), saved=sums["saved"],
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


# ---------------------------------------------------------------------------------- pipeline
@dataclass
class _Ctx:
    lm: LinearModel
    shape: PipelineShape
    hw: Hardware
    slots: list[int]
    st: list[StageExprs]
    budget: float
    bh: list[float]  # per stage: host->GPU GB/s of its GPU
    bd: list[float]
    prefetch: bool = True


def build_model(profile: ModelProfile, hw: Hardware, slots: list[int], micro_batches: int, num_stages: int,
                encoding: Encoding = "auto", bandwidth: BandwidthView = "link", prefetch: bool = True) -> BuiltModel:
    """The MIP for ``num_stages`` stages (``prefetch=False``: every upload waits for the previous stage). ``bandwidth="link"`` gives each GPU its uncontended link
    rate (transfers under one root complex do not slow each other); ``"shared"`` divides each root
    complex's capacity among its GPUs (every GPU uploading at once)."""
    if encoding == "auto":
        encoding = "count" if profile.identical_blocks() else "cut"
    lm = LinearModel()
    S, N = num_stages, len(slots)
    if encoding == "count":
        st, decode = _count_encoding(lm, profile, S)
    else:
        st, decode = _cut_encoding(lm, profile, S)
    shape = PipelineShape(S, N, micro_batches)
    up = hw.uncontended_h2d if bandwidth == "link" else hw.shared_h2d
    down = hw.uncontended_d2h if bandwidth == "link" else hw.shared_d2h
    gpu = [slots[shape.slot_of(j)] for j in range(S)]
    ctx = _Ctx(lm, shape, hw, slots, st, hw.gpu_memory_bytes / GB, [up(g) / GB for g in gpu],
               [down(g) / GB for g in gpu], prefetch)
    prefetch = _pipeline(ctx)
    return BuiltModel(lm, S, encoding, decode, prefetch)


def _peaks(c: _Ctx, j: int) -> tuple[Lin, Lin]:
    """Stage j's forward and backward memory peaks (GB), as in :class:`partition.costs.StageCost`."""
    s, M, S = c.st[j], c.shape.micro_batches, c.shape.num_stages
    fwd = s.pbytes + s.in_b * M + s.work
    bwd = s.pbytes + s.gbytes + s.in_b * M + s.saved + s.work
    if c.shape.same_gpu_neighbours:
        fwd = fwd + (s.out_b * M if j < S - 1 else Lin())
        bwd = bwd + (s.in_b * M if j > 0 else Lin())
    return fwd, bwd


def _latency(c: _Ctx, src: int, dst: int, nbytes: Lin) -> Lin:
    """Activation (gradient) transfer time from stage src to dst, linear in the bytes."""
    per_gb = activation_latency(c.hw, c.slots, c.shape, src, dst, GB)
    return nbytes * per_gb


def _pipeline(c: _Ctx) -> dict[str, list[Lin]]:
    """Memory, forward, backward, download and optimizer constraints; sets the objective."""
    lm, S, N = c.lm, c.shape.num_stages, c.shape.num_slots
    peaks = [_peaks(c, j) for j in range(S)]
    for j in range(S):
        lm.add(peaks[j][0], "<=", c.budget)
        lm.add(peaks[j][1], "<=", c.budget)
        if not c.shape.is_resident(j):
            lm.add(peaks[j][1] + c.st[j + N].gbytes, "<=", c.budget)
    v = {k: [lm.var(f"{k}{j}") for j in range(S)] for k in ("sf0", "sfl", "sb0", "sbl", "uf", "d", "o")}
    pf = [lm.var(f"pf{j}") if j >= N else Lin() for j in range(S)]
    ub = [lm.var(f"ub{j}") if not c.shape.is_resident(j) else None for j in range(S)]
    pb = [lm.var(f"pb{j}") if not c.shape.is_resident(j) else Lin() for j in range(S)]
    ef = [v["sfl"][j] + c.st[j].fwd for j in range(S)]
    eb = [v["sbl"][j] + c.st[j].bwd for j in range(S)]
    _forward(c, v, pf, ef, peaks)
    _backward(c, v, ub, pb, ef, eb, peaks)
    _finish(c, v, eb)
    return {"pf": pf, "pb": pb}


def _forward(c: _Ctx, v: dict, pf: list, ef: list, peaks: list) -> None:
    """Uploads, prefetch and start times of the forward phases."""
    lm, S, N, M, st = c.lm, c.shape.num_stages, c.shape.num_slots, c.shape.micro_batches, c.st
    for j in range(S):
        uf, sf0, sfl = v["uf"][j], v["sf0"][j], v["sfl"][j]
        if j < N:
            lm.add(uf, ">=", st[j].pbytes / c.bh[j])
        else:  # upload rest after the previous stage on the GPU; prefetch bounded by memory and window
            lm.add(uf, ">=", ef[j - N] + (st[j].pbytes - pf[j]) / c.bh[j])
            lm.add(pf[j], "<=", st[j].pbytes if c.prefetch else Lin())
            lm.add(pf[j] + peaks[j - N][0], "<=", c.budget)
            lm.add(pf[j], "<=", (ef[j - N] - v["uf"][j - N]) * c.bh[j])
        lm.add(sf0, ">=", uf)
        lm.add(sfl, ">=", sf0 + st[j].fwd * (M - 1))
        if j > 0:
            lat = _latency(c, j - 1, j, st[j - 1].out_b)
            lm.add(sf0, ">=", v["sf0"][j - 1] + st[j - 1].fwd + lat)
            lm.add(sfl, ">=", v["sfl"][j - 1] + st[j - 1].fwd + lat)


def _backward(c: _Ctx, v: dict, ub: list, pb: list, ef: list, eb: list, peaks: list) -> None:
    """Uploads, prefetch and start times of the backward phases (stages in reverse)."""
    lm, S, N, M, st = c.lm, c.shape.num_stages, c.shape.num_slots, c.shape.micro_batches, c.st
    rb: dict[int, Lin] = {}  # start of the prefetch window stage j's backward offers stage j - N
    for j in reversed(range(S)):
        sb0, sbl = v["sb0"][j], v["sbl"][j]
        if c.shape.is_resident(j):
            lm.add(sb0, ">=", ef[j])
            rb[j] = ef[j]
        else:
            upload = st[j].pbytes + st[j].in_b * M
            lm.add(ub[j], ">=", eb[j + N] + (upload - pb[j]) / c.bh[j])
            lm.add(pb[j], "<=", upload if c.prefetch else Lin())
            lm.add(pb[j] + peaks[j + N][1], "<=", c.budget)
            lm.add(pb[j], "<=", (eb[j + N] - rb[j + N]) * c.bh[j])
            lm.add(sb0, ">=", ub[j])
            if j - N >= 0:
                r = lm.var(f"rb{j}")
                lm.add(r, ">=", ub[j])
                lm.add(r, ">=", v["d"][j + N])
                rb[j] = r
        lm.add(sbl, ">=", sb0 + st[j].bwd * (M - 1))
        if j < S - 1:
            lat = _latency(c, j + 1, j, st[j + 1].in_b)
            lm.add(sb0, ">=", v["sb0"][j + 1] + st[j + 1].bwd + lat)
            lm.add(sbl, ">=", v["sbl"][j + 1] + st[j + 1].bwd + lat)


def _finish(c: _Ctx, v: dict, eb: list) -> None:
    """Gradient downloads (serial per GPU link), CPU optimizer in backward order, objective."""
    lm, S, N, st = c.lm, c.shape.num_stages, c.shape.num_slots, c.st
    rate = c.hw.cpu_adam_params_per_s / GB
    for j in reversed(range(S)):
        down = st[j].gbytes / c.bd[j]
        lm.add(v["d"][j], ">=", eb[j] + down)
        if j + N < S:
            lm.add(v["d"][j], ">=", v["d"][j + N] + down)
        adam = st[j].params / rate
        lm.add(v["o"][j], ">=", v["d"][j] + adam)
        if j + 1 < S:
            lm.add(v["o"][j], ">=", v["o"][j + 1] + adam)
    T = lm.var("T")
    lm.add(T, ">=", v["o"][0])
    lm.objective = T


# ---------------------------------------------------------------------------------- search
def solve_stage_count(profile: ModelProfile, hw: Hardware, slots: list[int], micro_batches: int, num_stages: int,
                      solver: SolverName = "auto", time_limit_s: float = 30.0, cutoff: float | None = None,
                      encoding: Encoding = "auto", bandwidth: BandwidthView = "link",
                      rel_gap: float = 1e-4, prefetch: bool = True) -> StageCountResult:
    """Build and solve the model for one stage count (to ``rel_gap`` relative optimality gap). With a
    ``cutoff``, only a partition faster than it counts; status ``cutoff`` proves none exists."""
    built = build_model(profile, hw, slots, micro_batches, num_stages, encoding, bandwidth, prefetch)
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
    if cutoff is not None and (res.status in ("infeasible", "cutoff") or res.objective >= cutoff * (1 - 1e-9)):
        out.status, out.predicted_s, out.bound = "cutoff", math.inf, max(cutoff, res.bound if res.has_solution else 0)
        return out
    if res.has_solution:
        out.boundaries = built.decode(res.values)
        out.prefetch_f = [p.value(res.values) * GB for p in built.prefetch["pf"]]
        out.prefetch_b = [p.value(res.values) * GB for p in built.prefetch["pb"]]
    return out


def solve_partition(profile: ModelProfile, hw: Hardware, slots_for: Callable[[int], list[int]], micro_batches: int,
                    solver: SolverName = "auto", time_limit_s: float = 30.0, stage_counts: list[int] | None = None,
                    encoding: Encoding = "auto", bandwidth: BandwidthView = "link",
                    seed: bool = True, rel_gap: float = DEFAULT_REL_GAP, prefetch: bool = True) -> MipResult:
    """The fastest partition over every stage count (``1..units`` unless given), proven by the MIP
    to within ``rel_gap`` (each stage count's solve stops there; the achieved gap is reported).

    With ``seed`` a local search on the same timing model (:mod:`partition.heuristic`) first finds
    a strong incumbent; each stage count's MIP then runs with the best time so far as a cutoff, in
    the order the local search ranks them, so counts that cannot win stop early.
    """
    t0 = time.perf_counter()
    counts = stage_counts or list(range(1, profile.num_units + 1))
    ev = ModelEvaluator(profile, hw, slots_for, micro_batches, bandwidth, prefetch)
    best: StageCountResult | None = None
    ranking: dict[int, float] = {}
    if seed:
        inc = find_incumbent(ev, counts)
        ranking = inc.per_stage_count
        if inc.boundaries is not None:
            best = _from_schedule(ev, inc.boundaries, slots_for)
    order = sorted(counts, key=lambda S: (ranking.get(S, math.inf), S))
    results: list[StageCountResult] = []
    for S in order:
        left = time_limit_s - (time.perf_counter() - t0)
        if left <= 0:
            log.warning("partition time limit reached before trying %d stages", S)
            break
        cutoff = best.predicted_s * (1 - rel_gap) if best is not None else None  # only a real improvement counts
        r = solve_stage_count(profile, hw, slots_for(S), micro_batches, S, solver, left, cutoff, encoding, bandwidth,
                              rel_gap, prefetch)
        results.append(r)
        if r.boundaries is not None and (best is None or r.predicted_s < best.predicted_s):
            best = r
    results.sort(key=lambda r: r.num_stages)
    if best is not None and best.status == "local search":
        proven = all(r.status in ("cutoff", "infeasible") for r in results) and len(results) == len(counts)
        best.status = "optimal" if proven else best.status
    return MipResult(best, results, time.perf_counter() - t0, _lower_bound(results, counts))


def given_partition(profile: ModelProfile, hw: Hardware, slots_for: Callable[[int], list[int]], micro_batches: int,
                    boundaries: list[int], bandwidth: BandwidthView = "link", prefetch: bool = True) -> MipResult:
    """A result for a partition chosen by the user (``parallel.stages``), scored by the timing model."""
    t0 = time.perf_counter()
    ev = ModelEvaluator(profile, hw, slots_for, micro_batches, bandwidth, prefetch)
    res = _from_schedule(ev, list(boundaries), slots_for)
    res.status, res.encoding = "given", "given"
    return MipResult(res, [res], time.perf_counter() - t0, res.predicted_s)


def _from_schedule(ev: ModelEvaluator, bounds: list[int], slots_for: Callable[[int], list[int]]) -> StageCountResult:
    """A result for a partition the local search found (its time is the MIP model's)."""
    sch = ev.schedule(bounds)
    S = len(bounds) - 1
    return StageCountResult(S, "local search", sch.T, 0.0, bounds, "", 0.0, 0, 0, "local search",
                            prefetch_f=list(sch.pf), prefetch_b=list(sch.pb))


def _lower_bound(results: list[StageCountResult], counts: list[int]) -> float:
    """The smallest step time that no stage count has been proven unable to beat."""
    if len(results) < len(counts):
        return 0.0
    bounds = [r.bound if math.isfinite(r.bound) else 0.0 for r in results if r.status != "infeasible"]
    return min(bounds) if bounds else math.inf


def explain_infeasible(profile: ModelProfile, hw: Hardware, micro_batches: int) -> MobiusError:
    """An error naming the unit that cannot fit and the shortfall in bytes."""
    budget = hw.gpu_memory_bytes
    shape = PipelineShape(3, 2, micro_batches)  # a unit alone as a middle stage
    worst: tuple[int, str, str, int] | None = None
    for i, u in enumerate(profile.units):
        sc = stage_cost(profile, i, i + 1)
        for need, what in ((shape.fwd_peak(sc, 1), "forward"), (shape.bwd_peak(sc, 1), "backward")):
            if need > budget and (worst is None or need - budget > worst[0]):
                worst = (need - budget, u.name, what, need)
    if worst is not None:
        short, name, what, need = worst
        return MobiusError(f"the model cannot fit: unit {name!r} alone needs {need:,} bytes for its {what} "
                           f"({micro_batches} micro-batches of {profile.micro_batch_size} x {profile.seq_len} tokens, "
                           f"{profile.precision}) but a GPU has {budget:,} usable bytes: short by {short:,} bytes")
    need = max(shape.bwd_peak(stage_cost(profile, i, i + 1), 1) for i in range(profile.num_units))
    return MobiusError(f"no partition of the {profile.num_units} units fits {budget:,} usable bytes per GPU with "
                       f"{micro_batches} micro-batches (the largest unit's backward needs {need:,} bytes, and a "
                       f"stage must also fit beside the previous stage's gradients)")
