"""The swapped pipeline's planner: its partition into stages, their GPUs, the runtime's memory settings,
predicted time and memory, and how it was found (:class:`partition.swapped_plan.SwappedPlan`).

:func:`plan_model` is the one entry point: given the units' profile, the machine and what is asked
(:class:`partition.request.PlanRequest`), solve the MIP over every stage count under each memory
setting the request allows (two device slots or one; boundary inputs kept on the GPU or in host
memory), choose the resident and kept stages of its partition (:mod:`partition.residency`),
simulate the plan's schedule on the real topology (root-complex contention included) -- and, where
the simulated step shows contention the MIP's rates did not, plan again at the rates the simulated
step reached, keeping the faster -- then choose the gradient download dtype and simulate the
baselines beside it. The runtime takes :meth:`SwappedPlan.runtime_settings` from the plan and builds the
same schedule the simulator ran.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Sequence

from partition.baselines import BASELINES
from partition.costs import (PRECISION_BYTES, STATES_ORDER, ModelProfile, compute_copy_work, host_bytes_per_param,
                             stage_costs, states_advice, tied_end_bytes_per_param, tied_end_held)
from mobius.errors import ConfigError, MobiusError
from partition import residency
from partition.evaluate import ModelEvaluator, stage_exprs
from partition.gpus import GB, GiB
from partition.hardware import Hardware
from partition.schedule import PipelineOptions
from partition.mapping import GpusFor, as_gpus_function
from partition.mip import (MipResult, StageCountResult, model_result, explain_infeasible, given_partition,
                           solve_partition)
from partition.request import PlanRequest
from partition.sim.result import SimResult
from partition.simulate import simulate, with_spread
from partition.swapped_plan import BaselineAdopted, LinkRates, MipReport, OtherUpdate, StagePlan, SwappedPlan
from partition.timing import Numbers, PipelineShape, worker_needs

log = logging.getLogger(__name__)


CONTENTION_GAP = 0.03  # re-plan when the simulated step exceeds the MIP's model of it by more than this
CONTENTION_REL_GAP = 0.02  # the re-plan's optimality gap: its rates are one simulated step's estimates
MIN_SEARCH_S = 0.05  # the least time a search gets, whatever the limit left (its local search runs whole)
SEARCH_SHARE = 0.8  # of a planning round's time: its searches; its residency passes (and a re-plan) the rest
FIRST_SETTING_SHARE = 0.7  # of a search's time: its first runtime setting's (inputs on the GPU), where a second
# (inputs in host memory) follows and looks only for what beats the first's best
PASSES_SHARE = 0.5  # of what a round's searches leave: its residency passes where a re-plan follows (it gets the
# rest)


@dataclass
class PlanMemo:
    """What one planning computed once: each partition's simulations under each settings (recorded or not) and its
    residency choices per settings and rates (:func:`_residency_choice`; the rates' :class:`Hardware` kept beside
    the choice, since the key holds its ``id``)."""

    sims: dict[tuple[tuple[int, ...], PipelineOptions, bool], SimResult] = field(default_factory=dict)
    choices: dict[tuple, tuple[Hardware, tuple[PipelineOptions, float]]] = field(default_factory=dict)


@dataclass(frozen=True)
class PlanContext:
    """What the helpers of one planning share: the request, the profile, the machine the plan runs
    on (the MIP may see it at other rates: their ``model_hw``), the stage-to-GPU slot orders, and
    when the planning started (the request's time limit counts from then: it bounds the searches, their
    residency passes and the re-plan's together)."""

    req: PlanRequest
    prof: ModelProfile
    hw: Hardware
    gpus_for: GpusFor
    started: float = field(default_factory=time.perf_counter)
    ranks_as_sync: bool = False  # the timing model ranks partitions and residency as under train.update: sync (a
    # delayed plan's second search, :func:`_plan_at`); the simulator always runs the request's rule
    memo: PlanMemo = field(default_factory=PlanMemo, compare=False, repr=False)  # shared by the contexts
    # replaced from this one: a partition the search and a baseline share is simulated once

    @classmethod
    def of(cls, prof: ModelProfile, hw: Hardware, req: PlanRequest) -> PlanContext:
        """The context of planning ``req`` for ``prof`` on ``hw``; stops where the request asks what
        the profile cannot give."""
        if req.grad_download == "half" and prof.precision != "bf16":
            raise ConfigError(f"parallel.grad_download=half needs train.precision bf16, got {prof.precision} (fp32 has "
                              f"no half copy to land in; fp16 sums of loss-scaled gradients can overflow)")
        if req.grad_download == "half" and req.delayed:
            raise ConfigError("parallel.grad_download=half cannot go with train.update=delayed: the half copy holds "
                              "the weights the next step computes with; set parallel.grad_download=fp32 or auto")
        if req.boundaries is not None and req.boundaries[-1] != prof.num_units:
            raise ConfigError(f"PlanRequest.boundaries {list(req.boundaries)} must end at the model's "
                              f"{prof.num_units} units")
        return cls(req, prof, hw, as_gpus_function(req.mapping, hw.groups))

    @property
    def deadline(self) -> float:
        """When the request's time limit ends (``time.perf_counter()``)."""
        return self.started + self.req.time_limit_s

    def time_left(self, until: float | None = None) -> float:
        """Seconds until ``until`` (by default the end of the request's time limit); none below 0."""
        return max(0.0, (self.deadline if until is None else until) - time.perf_counter())

    def model_options(self, options: PipelineOptions) -> PipelineOptions:
        """``options`` as the timing model ranks with them (:attr:`ranks_as_sync`)."""
        return dataclasses.replace(options, delayed=False) if self.ranks_as_sync else options

    def evaluator(self, model_hw: Hardware, options: PipelineOptions) -> ModelEvaluator:
        """The timing model of the request's step at ``model_hw``'s rates under ``options``."""
        return ModelEvaluator(self.prof, model_hw, self.gpus_for, self.req.micro_batches, self.req.bandwidth_view,
                              self.model_options(options))

    def simulate(self, bounds: Sequence[int], options: PipelineOptions, record: bool = True) -> SimResult:
        """The partition ``bounds`` under ``options`` simulated on the machine (every worker at its profile's
        speed: the searches compare partitions so); each once (a recorded simulation also answers for an unrecorded
        one: they differ in the events alone)."""
        key = (tuple(bounds), options)
        sim = self.memo.sims.get((*key, True)) or (None if record else self.memo.sims.get((*key, False)))
        if sim is None:
            sim = simulate(self.prof, bounds, self.hw, self.gpus_for(len(bounds) - 1), self.req.micro_batches, options,
                           self.req.sharing, record=record)
            self.memo.sims[(*key, record)] = sim
        return sim

    def with_spread(self, bounds: Sequence[int], options: PipelineOptions, nominal: SimResult) -> SimResult:
        """``nominal`` (:meth:`simulate`'s of ``bounds`` under ``options``) with the step the plan reports: the
        profile's spreads drawn (:func:`with_spread`)."""
        gpus = self.gpus_for(len(bounds) - 1)
        return with_spread(nominal, self.prof, lambda steps, draw: simulate(
            self.prof, bounds, self.hw, gpus, self.req.micro_batches, options, self.req.sharing, record=False,
            steps=steps, draw=draw))


# ---------------------------------------------------------------------------------- entry point
def plan_model(profile: ModelProfile, hardware: Hardware, request: PlanRequest) -> SwappedPlan:
    """Find the best partition and runtime settings of ``request`` for the unit costs ``profile`` on
    ``hardware``, simulate the plan and (``request.with_baselines``) the baselines.

    The MIP's partition gets its resident and kept stages (:func:`_fastest_residency`); where the
    simulated step shows contention the MIP's rates did not, the planner plans again at the rates
    the simulated step reached (:func:`_replan_under_contention`); then the gradient download dtype
    (:func:`_grad_dtype`). A profile comes from :func:`partition.profile.get_profile` (or
    :func:`partition.estimate.estimate_units`). ``request.schedule`` is for
    :func:`partition.schedule_comparison.plan_schedules`, which plans the round-robin family beside this plan."""
    ctx = PlanContext.of(profile, hardware, request)
    best, tried = _plan_at(ctx, hardware, request.rel_gap), []
    if request.contention_rounds > 0 and request.boundaries is None:
        best, tried = _replan_under_contention(ctx, best)
    res, bounds = best.res, best.res.best.boundaries
    options, sim, choice = _grad_dtype(ctx, bounds, best.options, best.sim)
    _check_host_memory(ctx, bounds, options)
    base, base_bounds, runs = (_baselines(ctx, bounds, options, best.model_hw) if request.with_baselines
                               else ({}, {}, {}))
    adopted, faster = None, _faster_baseline(ctx, runs, base_bounds, sim)
    if faster is not None:
        name, bounds, options, base_sim = faster
        log.warning("the %s baseline's partition simulates faster (%.3f s) than the search's (%.3f s, %s): "
                    "planned with it", name, base_sim.step_s, sim.step_s, res.status_text())
        adopted, sim = BaselineAdopted(name, sim.step_s), base_sim
    res.solve_s = time.perf_counter() - ctx.started
    sim = ctx.with_spread(bounds, options, sim)
    plan = _assemble(ctx, bounds, options, sim, res, base, base_bounds)
    plan.mip.baseline_adopted = adopted
    plan.grad_choice = choice
    plan.model_step_s = ctx.evaluator(best.model_hw, options).step_time(bounds)
    plan.mip.contention_plans = tried
    plan.mip.alternatives = best.alternatives
    plan.mip.ranked_by = best.ranked_by
    plan.compute_scale = {k: v for k, v in profile.notes.get("in_run", {}).items() if k != "key"}
    other = other_update_options(options)
    plan.other_update = OtherUpdate(other.delayed, ctx.simulate(bounds, other, record=False).step_s + sim.spread_s,
                                    _host_bytes(ctx, bounds, other))  # (the spreads as they slow this plan's step)
    if best.model_hw is not hardware:
        plan.mip.simulated_rates_GBps = LinkRates([r / GB for r in best.model_hw.h2d_Bps],
                                                  [r / GB for r in best.model_hw.d2h_Bps])
    return plan


@dataclass
class _Candidate:
    """A partition with its runtime settings, the machine the MIP and the residency pass saw
    (``model_hw``) and the step simulated on the real one."""

    model_hw: Hardware
    res: MipResult
    options: PipelineOptions
    sim: SimResult
    alternatives: list[dict]  # each partition the residency pass tried (:func:`_fastest_residency`)
    ranked_by: str  # the update rule whose timing model ranked the partitions and residency (:func:`_plan_at`)


def _plan_at(ctx: PlanContext, model_hw: Hardware, rel_gap: float, rules: tuple[str, ...] = (),
             carried: Sequence[StageCountResult] = (), settings: PipelineOptions | None = None) -> _Candidate:
    """The MIP's partition (to ``rel_gap``) and the residency pass at ``model_hw``'s rates, simulated
    on the machine. The request's time limit bounds the planning as a whole: the searches get ``SEARCH_SHARE``
    of what it leaves (at least ``MIN_SEARCH_S`` together) and the residency passes the rest (the best partition's
    pass runs whatever is left), ``PASSES_SHARE`` of it where a re-plan under contention follows, which gets
    what this round leaves. ``carried``: partitions an earlier round found (a re-plan's: the first round's), which
    the residency pass tries beside the search's, the first of them whatever the time left (at the re-plan's rates
    it ranks them closer to the simulator); ``settings``: the runtime settings to search under (by default the
    request's).

    Under ``train.update: delayed`` the search runs twice, sharing the time: ranked by the delayed rule's
    timing model, and by the sync rule's; the faster simulated wins. Once the host's CPU work bounds a delayed
    step, the delayed model finds most partitions alike (their CPU work is the model's), and the sync model,
    whose CPU updates lie on the step's path, tells them apart; neither model holds the copies' waits that the
    simulator finds where the two bounds meet, so either can rank the better plan first. Where the host's CPU
    work is small next to the GPUs' compute (:func:`_cpu_weighs`: LoRA) the two models rank alike, and the delayed
    one searches alone. ``rules`` names the rankings to search with instead (a re-plan's: the one whose plan it
    re-plans)."""
    if not rules:
        rules = ("sync",) if not ctx.req.delayed else ("sync", "delayed") if _cpu_weighs(ctx) else ("delayed",)
    searches = [dataclasses.replace(ctx, ranks_as_sync=rule == "sync") for rule in rules]
    searched = time.perf_counter() + SEARCH_SHARE * ctx.time_left()  # when the searches end
    results = [_search(c, model_hw, max(MIN_SEARCH_S, searched - time.perf_counter()) / (len(searches) - i), rel_gap,
                       MIN_SEARCH_S / len(searches), settings)
               for i, c in enumerate(searches)]
    found: list[_Candidate] = []
    replan = model_hw is ctx.hw and ctx.req.contention_rounds > 0 and ctx.req.boundaries is None  # may follow
    for i, (rule, c, (res, options)) in enumerate(zip(rules, searches, results)):
        budget = ctx.time_left() / (len(searches) - i)
        chosen, sim, tried = _fastest_residency(c, res, options, model_hw, budget, carried,
                                                PASSES_SHARE if replan else 1.0)
        if options.num_slots == 1 and ctx.req.prefetch:  # two slots do not fit: prefetch what fits of the next stage
            chosen, sim = _partial_prefetch(c, res.best.boundaries, options, model_hw, (chosen, sim))
        found.append(_Candidate(model_hw, res, chosen, sim, tried, rule))
    return min(found, key=lambda c: c.sim.step_s)


RANK_TWICE_CPU_SHARE = 0.5  # a delayed plan searches under both rules' rankings where the host's CPU work per step
# is at least this share of the GPUs' compute (_cpu_weighs)


def _cpu_weighs(ctx: PlanContext) -> bool:
    """Whether the host's CPU work of a step (every trainable parameter's update and compute copy, at the host's
    rate with every worker updating) is at least ``RANK_TWICE_CPU_SHARE`` of the step's compute spread over the
    GPUs, both from the profile alone (before any partition: the choice of searches comes first)."""
    prof, M = ctx.prof, ctx.req.micro_batches
    workers = max(1, min(ctx.hw.num_gpus, prof.num_units))
    params = sum(u.trainable_count for u in prof.units)
    cpu_s = params * (1 + compute_copy_work(prof.precision)) / ctx.hw.host_update_total(workers=workers)
    compute_s = sum(u.fwd_s + u.bwd_s + u.acc_s for u in prof.units) * M / workers
    return cpu_s >= RANK_TWICE_CPU_SHARE * compute_s


def _replan_under_contention(ctx: PlanContext, best: _Candidate) -> tuple[_Candidate, list[dict]]:
    """The outer loop of MIP and simulator, ``ctx.req.contention_rounds`` rounds at most: while the
    simulated step exceeds the model's by more than ``CONTENTION_GAP`` (uploads and downloads slowed
    by the root complex they share, or by activations on their links), plan again at the rates the
    simulated step reached (:func:`simulated_rates`, the MIP to the request's gap or
    ``CONTENTION_REL_GAP``, the larger; its residency pass also tries the partitions the first round found, at
    these rates) in the time the first round left, and keep
    the new plan if it simulates faster. Also returns each plan tried: its rates, partition, resident and kept
    stages, model and simulated step."""
    def row(c: _Candidate, model_s: float) -> dict:
        return {"rates": "link" if c.model_hw is ctx.hw else "simulated", "boundaries": c.res.best.boundaries,
                "resident": sorted(c.options.resident), "kept": sorted(c.options.kept), "model_step_s": model_s,
                "simulated_step_s": c.sim.step_s}

    def model_of(c: _Candidate) -> float:
        return ctx.evaluator(c.model_hw, c.options).step_time(c.res.best.boundaries)

    gap = max(ctx.req.rel_gap, CONTENTION_REL_GAP)
    tried = [row(best, model_of(best))]
    for _ in range(ctx.req.contention_rounds):
        if best.sim.step_s <= tried[-1]["model_step_s"] * (1 + CONTENTION_GAP):
            break
        again = _plan_at(ctx, simulated_rates(ctx.hw, best.sim), gap, (best.ranked_by,), best.res.alternatives)
        tried.append(row(again, model_of(again)))
        log.info("contention: the simulated step %.3f s exceeds the model's %.3f s; re-planned at the simulated rates: "
                 "%.3f s simulated (%d stages)", best.sim.step_s, tried[-2]["model_step_s"], again.sim.step_s,
                 again.res.best.num_stages)
        if again.sim.step_s >= best.sim.step_s:
            break
        best = again
    return best, tried


def simulated_rates(hw: Hardware, sim: SimResult) -> Hardware:
    """The machine at the rates a simulated step reached: each GPU's host->GPU rate is the bytes its
    uploads moved over the time they were in flight (root-complex contention and the activations
    on its link included), its GPU->host rate the same of its gradient downloads; none faster than
    alone, and no root complex limits them further (their sharing is in the rates)."""
    moved = {(cat, g): [0.0, 0.0] for cat in ("upload", "grad") for g in range(hw.num_gpus)}
    for e in sim.events:
        if e.cat in ("upload", "grad") and e.end > e.start:
            moved[(e.cat, e.gpu)][0] += e.nbytes
            moved[(e.cat, e.gpu)][1] += e.end - e.start

    def rate(cat: str, g: int, alone: float) -> float:
        nbytes, seconds = moved[(cat, g)]
        return min(alone, nbytes / seconds) if nbytes > 0 else alone

    free = [math.inf] * len(hw.groups)
    return dataclasses.replace(hw, h2d_Bps=[rate("upload", g, hw.uncontended_h2d(g)) for g in range(hw.num_gpus)],
                               d2h_Bps=[rate("grad", g, hw.uncontended_d2h(g)) for g in range(hw.num_gpus)],
                               rc_h2d_Bps=free, rc_d2h_Bps=list(free), rc_h2d_by_streams=None, rc_d2h_by_streams=None,
                               bidir_Bps=None, name=f"{hw.name} at its simulated rates")


RESIDENCY_RESERVE = 0.06  # of the usable GPU memory, kept free by the automatic residency choice: the memory
# model's error and the allocator's fragmentation (an H100 capped at 24 GiB ran out with 23.9 GiB planned)


def _residency(ctx: PlanContext, bounds: list[int], options: PipelineOptions, model_hw: Hardware | None = None,
               against_none: bool = True) -> tuple[PipelineOptions, SimResult]:
    """The partition's resident and kept stages (the request's, or chosen by the second pass at
    ``model_hw``'s rates, by default the machine's: :func:`_residency_choice`) and its simulation on the machine; an
    automatic choice the simulator finds slower than none is dropped (unless ``against_none`` is off: the
    caller checks)."""
    resident, kept = ctx.req.resident, ctx.req.kept
    chosen = _residency_choice(ctx, bounds, options, model_hw or ctx.hw)[0]
    sim = ctx.simulate(bounds, chosen)
    if (chosen.resident or chosen.kept) and (resident is None or kept is None) and not (resident or kept) \
            and against_none:
        return _unless_none_is_faster(ctx, bounds, options, chosen, sim)
    return chosen, sim


def _residency_choice(ctx: PlanContext, bounds: list[int], options: PipelineOptions,
                      model_hw: Hardware) -> tuple[PipelineOptions, float]:
    """The partition's resident and kept stages (the request's, or chosen by the second pass at ``model_hw``'s
    rates) and the step the timing model gives them; each partition's once per settings and rates."""
    key = (tuple(bounds), options, id(model_hw), ctx.ranks_as_sync, ctx.req.resident, ctx.req.kept)
    known = ctx.memo.choices.get(key)
    if known is not None and known[0] is model_hw:
        return known[1]
    resident, kept = ctx.req.resident, ctx.req.kept
    ev = ctx.evaluator(model_hw, options)
    if resident or kept:
        wrong = residency.check_choice(ev, bounds, resident or frozenset(), kept or frozenset())
        if wrong:
            raise ConfigError(f"parallel.{wrong[0]}_stages: {wrong[1]}")
    res, kp, t = frozenset(), frozenset(), math.inf
    if resident is None or kept is None:  # what the planner adds leaves RESIDENCY_RESERVE of the GPU free
        spare = dataclasses.replace(model_hw, gpu_memory_bytes=int(ctx.hw.gpu_memory_bytes * (1 - RESIDENCY_RESERVE)))
        res, kp, t = residency.choose(ctx.evaluator(spare, options), bounds, resident, kept)
    if not math.isfinite(t):  # or what the config forces does not fit that way
        res, kp, t = residency.choose(ev, bounds, resident, kept)
    chosen = dataclasses.replace(options, resident=res, kept=kp)
    if not math.isfinite(t):
        broken = ev.evaluate(bounds, chosen).violations[0]
        raise MobiusError(f"resident stages {sorted(res)} and kept stages {sorted(kp)} do not fit: {broken[0]} needs "
                          f"{broken[1]:.2f} GB of the {broken[2]:.2f} GB usable per GPU")
    ctx.memo.choices[key] = (model_hw, (chosen, t))
    return chosen, t


def _unless_none_is_faster(ctx: PlanContext, bounds: list[int], options: PipelineOptions, chosen: PipelineOptions,
                           sim: SimResult) -> tuple[PipelineOptions, SimResult]:
    """The automatic resident/kept choice (``chosen``, simulated as ``sim``), or none (``options``) where
    the simulator finds none faster."""
    plain = ctx.simulate(bounds, options)
    if plain.step_s <= sim.step_s:
        log.info("the resident/kept choice %s/%s simulates slower (%.3f s) than none (%.3f s): dropped",
                 sorted(chosen.resident), sorted(chosen.kept), sim.step_s, plain.step_s)
        return options, plain
    return chosen, sim


def _fastest_residency(ctx: PlanContext, res: MipResult, options: PipelineOptions, model_hw: Hardware,
                       budget_s: float, carried: Sequence[StageCountResult] = (), contended_share: float = 1.0
                       ) -> tuple[PipelineOptions, SimResult, list[dict]]:
    """The residency pass on the search's best partition and, when the pass chooses both lists, on the
    ``carried`` partitions (an earlier round's, scored at ``model_hw``'s rates; the first whatever the time left)
    and the search's near-best and finest alternatives (:func:`partition.mip.near_best`) that fit in ``budget_s``
    (their cost estimated from the first choice's, as the cube of the stage count) get their resident and kept
    stages, and are simulated while the time lasts, the fastest in the timing model first (that one whatever the
    time left where the model puts it ahead of the best's); the fastest simulated becomes ``res.best`` (resident stages and kept activations can reorder
    partitions the timing model puts within a few percent of each other). Where the best's simulated step exceeds
    the model's by more than ``CONTENTION_GAP`` (a re-plan at the simulated rates follows,
    :func:`_replan_under_contention`) the passes take ``contended_share`` of the budget, leaving the rest to the
    re-plan; otherwise at least as long as the best's pass took (the model can rank the partitions apart from the
    simulator: on full fine-tuning, whose step the host's CPU work bounds, by 10%). Also returns a row per partition
    simulated."""
    start = time.perf_counter()
    first_t = _residency_choice(ctx, res.best.boundaries, options, model_hw)[1]  # (the pass's choice alone)
    choice_s = time.perf_counter() - start
    chosen, sim = _residency(ctx, res.best.boundaries, options, model_hw=model_hw)
    tried = [_alternative_row(res.best, chosen, sim)]
    if (ctx.req.resident, ctx.req.kept) != (None, None):
        return chosen, sim, tried
    if contended_share < 1 and sim.step_s > ctx.evaluator(model_hw, chosen).step_time(res.best.boundaries) * (
            1 + CONTENTION_GAP):
        budget_s *= contended_share
    else:  # (no re-plan follows) the others get at least the time the best's pass took: the timing model can rank
        budget_s = max(budget_s, 2 * (time.perf_counter() - start))  # them apart from the simulator
    first, seen = res.best, {tuple(res.best.boundaries)}
    ev = ctx.evaluator(model_hw, options)
    others = [model_result(ev, list(r.boundaries), ctx.gpus_for) for r in carried] + list(res.alternatives[1:])
    scored: list[tuple[float, int, StageCountResult, PipelineOptions]] = []
    for k, alt in enumerate(others):
        if tuple(alt.boundaries) in seen or len(alt.boundaries) - 1 < ctx.req.min_stages:
            continue
        seen.add(tuple(alt.boundaries))
        expected = choice_s * (alt.num_stages / first.num_stages) ** 3  # (rounds x moves x stages)
        if k > 0 and time.perf_counter() - start + expected > budget_s:
            continue
        try:
            alt_chosen, t = _residency_choice(ctx, alt.boundaries, options, model_hw)
        except MobiusError:
            continue
        scored.append((t, k, alt, alt_chosen))
    for n, (t, _, alt, alt_chosen) in enumerate(sorted(scored, key=lambda x: x[:2])):
        if (n > 0 or t >= first_t) and time.perf_counter() - start > budget_s:
            break
        alt_sim = ctx.simulate(alt.boundaries, alt_chosen)  # (checked against no residency only if it wins)
        tried.append(_alternative_row(alt, alt_chosen, alt_sim))
        if alt_sim.step_s < sim.step_s:
            chosen, sim, res.best = alt_chosen, alt_sim, alt
    if res.best is not first and (chosen.resident or chosen.kept):
        chosen, sim = _unless_none_is_faster(ctx, res.best.boundaries, options, chosen, sim)
    return chosen, sim, tried


def _alternative_row(r: StageCountResult, chosen: PipelineOptions, sim: SimResult) -> dict:
    return {"num_stages": r.num_stages, "model_step_s": r.predicted_s, "simulated_step_s": sim.step_s,
            "resident": len(chosen.resident), "kept": len(chosen.kept)}


def _partial_prefetch(ctx: PlanContext, bounds: list[int], options: PipelineOptions, model_hw: Hardware,
                      plain: tuple[PipelineOptions, SimResult]) -> tuple[PipelineOptions, SimResult]:
    """One device slot: a prefetch buffer for the next stage's first bytes in the memory that remains
    (the Mobius paper's eqs. 5-6). The memory goes either to the residency pass first and the buffer
    to what it leaves, or to the largest buffer first and the residency pass to the rest; the fastest
    simulated of those and ``plain`` (no buffer) wins."""
    largest = max((c.param_bytes for j, c in enumerate(stage_costs(ctx.prof, bounds)) if j not in plain[0].resident),
                  default=0)
    found = [plain]
    after = _buffer_bytes(ctx.hw, plain[1], largest)
    if after > 0:
        opts = dataclasses.replace(plain[0], prefetch_bytes=after)
        found.append((opts, ctx.simulate(bounds, opts)))
    first = _buffer_bytes(ctx.hw, ctx.simulate(bounds, options, record=False), largest)
    if first > 0 and first != after:
        with contextlib.suppress(MobiusError):
            found.append(_residency(ctx, bounds, dataclasses.replace(options, prefetch_bytes=first), model_hw=model_hw))
    return min(found, key=lambda c: c[1].step_s)


PREFETCH_ALIGN = 1 << 20  # the prefetch buffer's size is a whole number of MiB


def _buffer_bytes(hw: Hardware, sim: SimResult, largest: float) -> int:
    """The prefetch buffer the simulated plan's memory leaves room for on every GPU (keeping
    ``RESIDENCY_RESERVE`` free), at most the largest swapped stage's weights."""
    room = hw.gpu_memory_bytes * (1 - RESIDENCY_RESERVE) - max(sim.peak_bytes, default=0)
    size = int(min(room, largest)) // PREFETCH_ALIGN * PREFETCH_ALIGN
    return max(size, 0)


GRAD_HALF_GAIN = 0.05  # what auto's gradient download dtype must gain in simulated step time to be chosen


def _grad_dtype(ctx: PlanContext, bounds: list[int], options: PipelineOptions,
                sim: SimResult) -> tuple[PipelineOptions, SimResult, str]:
    """The gradient download dtype: as asked, or (auto) half when the host memory needs it or the
    simulator finds it at least ``GRAD_HALF_GAIN`` faster. Otherwise fp32 (the reference's numbers,
    4 more host bytes per parameter) where the host memory is known to hold it; where it is not
    known (a saved topology), fp32 only when it is at least ``GRAD_HALF_GAIN`` faster than half."""
    prof, host_memory = ctx.prof, ctx.hw.host_memory_bytes
    if ctx.req.grad_download != "auto":
        return options, sim, "as configured"
    if prof.precision != "bf16":
        return options, sim, f"{prof.precision} training"
    if options.delayed:
        return options, sim, "train.update=delayed: the half copy holds the weights the next step computes with"
    half = dataclasses.replace(options, grad_dtype="half")
    need = _host_bytes(ctx, bounds, options)
    if host_memory is not None and need > host_memory:
        return half, ctx.simulate(bounds, half), (
            f"fp32 gradient buffers would need {need / GiB:.1f} GiB of host memory, {host_memory / GiB:.1f} "
            f"GiB is available")
    if not sim.bytes_by_kind.get("grad"):
        return options, sim, "no gradient downloads"
    fast = ctx.simulate(bounds, half)
    gain = 1 - fast.step_s / sim.step_s
    if gain >= GRAD_HALF_GAIN:
        return half, fast, f"simulated {100 * gain:.1f}% faster than fp32"
    if host_memory is None and sim.step_s > fast.step_s * (1 - GRAD_HALF_GAIN):
        extra = need - _host_bytes(ctx, bounds, half)
        return half, fast, (f"host memory not known: fp32 would take {extra / GiB:.1f} GiB more for "
                            f"{100 * max(0.0, 1 - sim.step_s / fast.step_s):.1f}% of the step (< "
                            f"{100 * GRAD_HALF_GAIN:.0f}%)")
    if gain < 0:
        return options, sim, f"half would take {100 * (fast.step_s / sim.step_s - 1):.1f}% longer"
    return options, sim, f"half would save {100 * gain:.1f}% of the step (< {100 * GRAD_HALF_GAIN:.0f}%)"


def _check_host_memory(ctx: PlanContext, bounds: list[int], options: PipelineOptions) -> None:
    """Stop when the chosen plan's host stores exceed the host memory (when it is known), naming the
    ``train.optimizer_states`` rules whose moments would fit."""
    prof, host_memory = ctx.prof, ctx.hw.host_memory_bytes
    need = _host_bytes(ctx, bounds, options)
    if host_memory is not None and need > host_memory:
        per = host_bytes_per_param(prof.precision, options.grad_dtype == "half", options.delayed, options.states)
        frozen = (f" ({PRECISION_BYTES[prof.precision]} per frozen one)" if any(u.frozen_count for u in prof.units)
                  else "")
        raise MobiusError(f"host memory does not suffice: the swapped stages need {need / GiB:.1f} GiB ({per:g} "
                          f"bytes per parameter{frozen}, train.optimizer_states={options.states}, "
                          f"{options.grad_dtype} gradient downloads), {host_memory / GiB:.1f} GiB is available "
                          f"(partition.host_memory_gib, or 85% of the free memory of this machine)"
                          + states_advice(_host_bytes_by_states(ctx, bounds, options), options.states, host_memory))


def _host_bytes_by_states(ctx: PlanContext, bounds: list[int], options: PipelineOptions) -> dict[str, int]:
    """:func:`_host_bytes` with each rule's moments."""
    return {r: _host_bytes(ctx, bounds, dataclasses.replace(options, states=r)) for r in STATES_ORDER}


def _host_bytes(ctx: PlanContext, bounds: list[int], options: PipelineOptions) -> int:
    """Host memory of the swapped stages' stores (:func:`partition.costs.host_bytes_per_param`; a tied head's
    end that the embedding's store updates at :func:`partition.costs.tied_end_bytes_per_param`)."""
    prof, S = ctx.prof, len(bounds) - 1
    half_grads = options.grad_dtype == "half"
    per = host_bytes_per_param(prof.precision, half_grads, options.delayed, options.states)
    frozen = PRECISION_BYTES[prof.precision]  # LoRA's base weights: one copy in the training dtype
    held = tied_end_held(prof, S, len(ctx.gpus_for(S))) * (per - tied_end_bytes_per_param(prof.precision, half_grads))
    return round(sum(sc.trainable_count * per + sc.frozen_count * frozen
                     for j, sc in enumerate(stage_costs(prof, bounds)) if j not in options.resident) - held)


_BaselineRun = tuple[PipelineOptions, SimResult] | None  # a baseline's settings and simulated step (None: no fit)


def _baselines(ctx: PlanContext, bounds: list[int], options: PipelineOptions, model_hw: Hardware
               ) -> tuple[dict[str, float | None], dict[str, list[int] | None], dict[str, _BaselineRun]]:
    """Each baseline's partition on the GPUs of the plan's partition ``bounds`` and its step
    simulated the same way (None: it does not fit; inf: its residency does not fit), and its run."""
    workers = len(ctx.gpus_for(len(bounds) - 1))
    swapped = dataclasses.replace(options, resident=frozenset(), kept=frozenset(), prefetch_bytes=0)
    base, base_bounds, runs = {}, {}, {}
    done: dict[tuple[int, ...], _BaselineRun] = {}  # baselines that land on one partition (large models) share it
    for name, fn in BASELINES.items():
        b = fn(ctx.prof, ctx.hw, workers, ctx.req.micro_batches, swapped)
        base_bounds[name] = b
        if b and tuple(b) not in done:
            done[tuple(b)] = _baseline_run(ctx, b, swapped, model_hw)
        runs[name] = done[tuple(b)] if b else None
        base[name] = None if not b else math.inf if runs[name] is None else runs[name][1].step_s
    return base, base_bounds, runs


def _baseline_run(ctx: PlanContext, bounds: list[int], swapped: PipelineOptions, model_hw: Hardware) -> _BaselineRun:
    """A baseline partition simulated the same way: under ``swapped`` (the plan's settings, no stage
    resident or kept) with its own residency choice where the request's is automatic, none where the
    request forces stages (at the rates the plan's was made at); None where that does not fit."""
    req = ctx.req
    auto = dataclasses.replace(req, resident=None if req.resident is None else frozenset(),
                               kept=None if req.kept is None else frozenset())
    try:
        return _residency(dataclasses.replace(ctx, req=auto), bounds, swapped, model_hw=model_hw)
    except MobiusError:
        return None


def _faster_baseline(ctx: PlanContext, runs: dict[str, _BaselineRun], base_bounds: dict[str, list[int] | None],
                     sim: SimResult) -> tuple[str, list[int], PipelineOptions, SimResult] | None:
    """The fastest baseline where it simulates faster than the search's plan (``sim``), its host stores fit and the
    request leaves the partition and the resident and kept stages to the planner: a search cut short by its time
    limit (a loaded machine) can end on a worse partition than a baseline's."""
    req = ctx.req
    if (req.boundaries, req.resident, req.kept) != (None, None, None):
        return None
    fits = {name: run for name, run in runs.items() if run is not None and run[1].step_s < sim.step_s
            and len(base_bounds[name]) - 1 >= req.min_stages}
    for name in sorted(fits, key=lambda n: fits[n][1].step_s):
        options, faster = fits[name]
        try:
            _check_host_memory(ctx, base_bounds[name], options)
        except MobiusError:
            continue
        return name, list(base_bounds[name]), options, faster
    return None


def _option_sets(req: PlanRequest) -> list[list[PipelineOptions]]:
    """The runtime settings to try, in tiers: one slot is tried only when no two-slot plan fits."""
    offloads = {"on": [True], "off": [False]}.get(req.offload_inputs, [False, True])
    grad_dtype = "half" if req.grad_download == "half" else "fp32"
    return [[PipelineOptions(k, o, req.barrier, grad_dtype=grad_dtype, delayed=req.delayed, states=req.states)
             for o in offloads]
            for k in ((2, 1) if req.prefetch else (1,))]


def _search(ctx: PlanContext, model_hw: Hardware, time_limit_s: float, rel_gap: float,
            least_s: float = MIN_SEARCH_S, settings: PipelineOptions | None = None
            ) -> tuple[MipResult, PipelineOptions]:
    """The best partition (the request's, or the MIP's to ``rel_gap`` within ``time_limit_s``, each setting at
    least ``least_s``) under the best runtime settings at ``model_hw``'s rates (the MIP's model decides; or under
    ``settings`` alone); the result's lower bound is the lowest of its tier's settings (what no setting tried can
    beat) and its untried stage counts are theirs together."""
    req, t0 = ctx.req, time.perf_counter()
    counts = list(range(req.min_stages, ctx.prof.num_units + 1))
    best: tuple[MipResult, PipelineOptions] | None = None
    for tier in _option_sets(req) if settings is None else [[settings]]:
        bounds, skipped = [], 0
        for i, options in enumerate(tier):
            if req.boundaries is not None:
                res = given_partition(ctx.prof, model_hw, ctx.gpus_for, req.micro_batches, list(req.boundaries),
                                      req.bandwidth_view, ctx.model_options(options))
            else:  # the tier's settings share the time left, the first the most: a later one looks only for
                # what beats the best found so far, which settles most stage counts at once
                share = FIRST_SETTING_SHARE if i == 0 and len(tier) > 1 else 1 / (len(tier) - i)
                left = max(least_s, (time_limit_s - (time.perf_counter() - t0)) * share)
                beat = best[0].best.predicted_s if best is not None else math.inf
                res = solve_partition(ctx.prof, model_hw, ctx.gpus_for, req.micro_batches, req.solver, left,
                                      stage_counts=counts, bandwidth=req.bandwidth_view, rel_gap=rel_gap,
                                      options=ctx.model_options(options), beat=beat)
            bounds.append(res.lower_bound)
            skipped += res.stage_counts_skipped
            if res.best is not None and res.best.boundaries is not None and math.isfinite(res.best.predicted_s):
                if best is None or res.best.predicted_s < best[0].best.predicted_s:
                    best = (res, options)
        if best is not None:
            best[0].lower_bound, best[0].stage_counts_skipped = min(bounds), skipped
            return best
    raise explain_infeasible(ctx.prof, model_hw, req.micro_batches, _option_sets(req)[-1][-1])


def other_update_options(options: PipelineOptions) -> PipelineOptions:
    """``options`` under the other ``train.update`` rule: delayed downloads fp32 gradients (the half copy holds the
    weights the next step computes with)."""
    if options.delayed:
        return dataclasses.replace(options, delayed=False)
    return dataclasses.replace(options, delayed=True, grad_dtype="fp32")


def _assemble(ctx: PlanContext, bounds: list[int], options: PipelineOptions, sim: SimResult, res: MipResult,
              base: dict, base_bounds: dict) -> SwappedPlan:
    """The plan of the partition ``bounds`` under ``options``, simulated as ``sim``, found as ``res``."""
    prof, hw, worker_gpus = ctx.prof, ctx.hw, ctx.gpus_for(len(bounds) - 1)
    total = sim.total_bytes()
    traffic = {"total_bytes": total, "h2d_bytes": sum(sim.h2d_bytes), "d2h_bytes": sum(sim.d2h_bytes),
               "p2p_bytes": sum(sim.p2p_bytes), "x_param_bytes": total / max(prof.param_bytes(), 1),
               "x_fp32_param_bytes": total / max(4 * prof.param_count(), 1),
               **{f"{k}_bytes": v for k, v in sim.bytes_by_kind.items()}}
    best = res.best
    per_count = [{"num_stages": r.num_stages, "status": r.status, "predicted_s": r.predicted_s, "bound": r.bound}
                 for r in res.per_stage_count]
    mip = MipReport(best.num_stages, best.status, best.encoding, len(res.per_stage_count), res.stage_counts_skipped,
                    res.max_size[0], res.max_size[1], res.lower_bound, per_count)
    mapping = ctx.req.mapping if isinstance(ctx.req.mapping, str) else "given"
    return SwappedPlan(boundaries=bounds, worker_gpus=worker_gpus, num_gpus=hw.num_gpus,
                       micro_batches=ctx.req.micro_batches, micro_batch_size=prof.micro_batch_size,
                       seq_len=prof.seq_len, precision=prof.precision, options=options, predicted_step_s=sim.step_s,
                       model_step_s=best.predicted_s, solver=res.solver, solve_s=res.solve_s, gap=res.gap,
                       status=res.status_text(), baselines=base, baseline_boundaries=base_bounds,
                       profile_source=prof.source, device_name=prof.device_name,
                       stages=_stage_plans(ctx, bounds, options, sim), peak_bytes=list(sim.peak_bytes),
                       traffic=traffic, unit_names=[u.name for u in prof.units], mapping_kind=mapping,
                       hardware=hw.describe(), gpu_memory_bytes=hw.gpu_memory_bytes, param_count=prof.param_count(),
                       cpu_adam_params_per_s=hw.cpu_update_rate(options.grad_dtype == "half", len(worker_gpus)),
                       mip=mip, host_bytes=_host_bytes(ctx, bounds, options), host_memory_bytes=hw.host_memory_bytes,
                       host_bytes_by_states=_host_bytes_by_states(ctx, bounds, options), time_split=sim.time_split())


def _stage_plans(ctx: PlanContext, bounds: list[int], options: PipelineOptions, sim: SimResult) -> list[StagePlan]:
    """Each stage of the partition: its units, GPU, costs and memory peaks under ``options``."""
    costs = stage_costs(ctx.prof, bounds)
    worker_gpus, half = ctx.gpus_for(len(bounds) - 1), ctx.prof.precision != "fp32"
    shape = PipelineShape(len(costs), len(worker_gpus), ctx.req.micro_batches, options,
                  ctx.prof.tied_params / GB if len(costs) > 1 else 0.0)
    needs = {what: float(n) for per in worker_needs(Numbers(), [stage_exprs(c, half) for c in costs], shape).values()
             for what, n in per}
    names = [u.name for u in ctx.prof.units]
    out = []
    for j, sc in enumerate(costs):
        units = names[sc.first] if sc.end - sc.first == 1 else f"{names[sc.first]}..{names[sc.end - 1]}"
        out.append(StagePlan(index=j, first_unit=sc.first, end_unit=sc.end, units=units,
                             gpu=worker_gpus[j % len(worker_gpus)], param_bytes=sc.param_bytes, fwd_s=sc.fwd_s,
                             bwd_s=sc.bwd_s + sc.acc_s - (sc.fwd_s if j in options.kept else 0.0),
                             fwd_peak_bytes=int(needs[f"stage {j} forward"] * GB),
                             bwd_peak_bytes=int(needs[f"stage {j} backward"] * GB),
                             backward_in_place=shape.turns(j), upload_wait_s=sim.stages[j].upload_wait_s))
    return out
