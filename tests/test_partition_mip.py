"""The partition MIP against exhaustive search over its own model, the evaluator (the same model,
numbers) and the simulator (the runtime's action lists), on contention-free, asymmetric and
shared-root-complex machines, under every runtime setting (both solvers, both encodings)."""

from __future__ import annotations

import math
import random
import time
import types
from dataclasses import replace

import pytest

from fixtures.partition.profiles import random_case, random_profile, toy_profile
from mobius.errors import MobiusError
from partition import (Hardware, ModelEvaluator, PipelineOptions, PlanRequest, build_model, exhaustive_search,
                       plan_model, simulate, solve_partition, solve_stage_count)
from partition.baselines import all_partitions, is_valid
from partition.lp import solve
from partition.mip import StageCountResult

GiB = 1 << 30
OPTIONS = [PipelineOptions(), PipelineOptions(barrier=True), PipelineOptions(offload_inputs=True),
           PipelineOptions(num_slots=1), PipelineOptions(num_slots=1, prefetch_bytes=1),  # (sized per case)
           PipelineOptions(delayed=True), PipelineOptions(barrier=True, delayed=True)]
MACHINES = ["separate", "asymmetric", "shared"]


def _sequential(n: int):
    return lambda num_stages: list(range(n))


def _case(seed: int, machine: str):
    prof, hw, M = random_case(seed, machine)
    if seed % 3 == 0:
        prof.tied_params = prof.units[0].param_count // 2  # the first and last units share a weight
    options = OPTIONS[seed % len(OPTIONS)]
    if options.prefetch_bytes:  # partial prefetch: a buffer of about two thirds of a unit's weights
        options = replace(options, prefetch_bytes=int(0.7 * sum(u.param_bytes for u in prof.units) / prof.num_units))
    return prof, hw, M, options


@pytest.mark.parametrize("machine", MACHINES)
@pytest.mark.parametrize("seed", range(6))
def test_mip_is_optimal_against_exhaustive_search_of_its_own_model(seed: int, machine: str) -> None:
    """The solver finds the best partition the timing model knows, for both bandwidth views."""
    prof, hw, M, options = _case(seed, machine)
    N = hw.num_gpus
    for view in (("link", "shared") if machine == "shared" else ("link",)):
        res = solve_partition(prof, hw, _sequential(N), M, time_limit_s=60, rel_gap=1e-6, bandwidth=view,
                              options=options)
        ev = ModelEvaluator(prof, hw, _sequential(N), M, view, options)
        best = exhaustive_search(prof, hw, N, M, ev.step_time, options)
        assert best.evaluated >= 10, "the case should leave the search a real choice"
        assert res.best.predicted_s == pytest.approx(best.step_s, rel=1e-6), (view, res.best.boundaries,
                                                                            best.boundaries)
        assert ev.step_time(res.best.boundaries) == pytest.approx(res.best.predicted_s, rel=1e-6)
        assert res.status_text() == "optimal" and res.proven


@pytest.mark.parametrize("machine", MACHINES[:2])
@pytest.mark.parametrize("seed", range(8))
def test_the_simulator_runs_what_the_model_predicts(seed: int, machine: str) -> None:
    """Where the model sees what the runtime does (no root complex shared), the simulator of the
    runtime's action lists agrees with it on every partition tried (activations share links with
    uploads in the simulator only: within 3%)."""
    prof, hw, M, options = _case(seed, machine)
    N = hw.num_gpus
    ev = ModelEvaluator(prof, hw, _sequential(N), M, options=options)
    rng = random.Random(seed)
    parts = [b for b in all_partitions(prof.num_units) if len(b) - 1 >= N]
    rng.shuffle(parts)
    tried = 0
    for bounds in parts:
        model = ev.evaluate(bounds)
        if model.violations:
            continue
        sim = simulate(prof, bounds, hw, list(range(N)), M, options, record=False)
        assert sim.step_s == pytest.approx(model.T, rel=0.03), bounds
        tried += 1
        if tried == 6:
            break
    assert tried >= 3


def test_a_delayed_step_is_the_longer_of_its_gpu_work_and_each_workers_cpu_work() -> None:
    """Under ``train.update: delayed`` the CPU updates leave the step's path: the model's step ends when the
    gradients are down, unless a worker's CPU updates and compute copies take longer (at its share of the host);
    the simulator agrees on both sides of that line. Worker 0 holds stages 0, 2 and 4: 0.5 G parameters."""
    from partition.costs import compute_copy_work

    prof, bounds = toy_profile(), [0, 2, 4, 6, 8, 10]
    delayed = PipelineOptions(delayed=True)
    for rate, cpu_bound in ((0.2e9, True), (1e9, False)):
        hw = Hardware.uniform(2, 8 * GiB, 20e9, cpu_adam_params_per_s=rate)
        model = ModelEvaluator(prof, hw, _sequential(2), 4, options=delayed).evaluate(bounds)
        gpu = max(model.times.download_done.values())
        work = 0.5e9 * (1 + compute_copy_work(prof.precision)) / rate
        assert model.T == pytest.approx(max(gpu, work), rel=1e-9) and (work > gpu) == cpu_bound
        sim = simulate(prof, bounds, hw, [0, 1], 4, delayed, record=False)
        assert sim.step_s == pytest.approx(model.T, rel=0.01), (rate, sim.step_s, model.T)
        if not cpu_bound:  # the sync step waits for the updates
            assert model.T < 0.8 * ModelEvaluator(prof, hw, _sequential(2), 4).step_time(bounds)


@pytest.mark.parametrize("seed", range(4))
def test_on_shared_root_complexes_the_shared_view_plans_close_to_the_simulated_best(seed: int) -> None:
    """The MIP cannot see contention; with the shared view its plan, simulated, is within 10% of the
    best partition found by simulating every one (and never better, which would be a simulator bug)."""
    prof, hw, M, options = _case(seed, "shared")
    N = hw.num_gpus
    res = solve_partition(prof, hw, _sequential(N), M, rel_gap=1e-6, bandwidth="shared", options=options)
    plan_sim = simulate(prof, res.best.boundaries, hw, list(range(N)), M, options, record=False).step_s
    best = exhaustive_search(prof, hw, N, M, lambda b: simulate(prof, b, hw, list(range(N)), M, options,
                                                                 record=False).step_s, options)
    assert best.step_s <= plan_sim * (1 + 1e-9)
    print(f"\nshared seed {seed}: MIP plan simulated {plan_sim:.4f} s, simulated best {best.step_s:.4f} s "
          f"(+{100 * (plan_sim / best.step_s - 1):.2f}%)")
    assert plan_sim <= best.step_s * 1.10


@pytest.mark.parametrize("options", OPTIONS)
def test_mip_objective_equals_the_timing_model_for_a_fixed_partition(options: PipelineOptions) -> None:
    """For every partition of a small model, fixing the cut variables gives the evaluator's time."""
    rng = random.Random(3)
    prof = random_profile(rng, 6, identical=False)
    prof.tied_params = prof.units[0].param_count // 3
    hw = Hardware.uniform(3, 4 * GiB, 12e9, groups=[[0], [1], [2]])
    hw.d2h_Bps = [6e9] * 3
    ev = ModelEvaluator(prof, hw, lambda S: [0, 1, 2], 3, options=options)
    for bounds in all_partitions(prof.num_units)[::3]:
        S = len(bounds) - 1
        built = build_model(prof, hw, [0, 1, 2], 3, S, encoding="cut", options=options)
        lm = built.lm
        for k, name in enumerate(lm.names):
            if name.startswith("z"):
                i, j = map(int, name[1:].split("_"))
                lm.lb[k] = lm.ub[k] = 1.0 if i < bounds[j + 1] else 0.0
        expected = ev.step_time(bounds)
        if lm.trivially_infeasible() or not math.isfinite(expected):
            assert not is_valid(prof, bounds, hw, 3, 3, options)
            continue
        assert solve(lm, "highs").objective == pytest.approx(expected, rel=1e-6), bounds


def test_count_and_cut_encodings_agree_on_identical_blocks() -> None:
    prof = toy_profile(blocks=8)
    hw = Hardware.uniform(4, int(3 * GiB), 10e9, groups=[[0], [1], [2], [3]])
    for S in (4, 6, 10):
        for options in OPTIONS:
            count = solve_stage_count(prof, hw, [0, 1, 2, 3], 4, S, encoding="count", options=options)
            cut = solve_stage_count(prof, hw, [0, 1, 2, 3], 4, S, encoding="cut", options=options)
            assert count.predicted_s == pytest.approx(cut.predicted_s, rel=1e-6), (S, options)


def test_gurobi_and_highs_find_the_same_optimum() -> None:
    pytest.importorskip("gurobipy")
    prof, hw, M = random_case(5)
    worker_gpus = _sequential(hw.num_gpus)
    g = solve_partition(prof, hw, worker_gpus, M, solver="gurobi", seed=False, rel_gap=1e-6)
    h = solve_partition(prof, hw, worker_gpus, M, solver="highs", seed=False, rel_gap=1e-6)
    assert g.solver == "gurobi" and h.solver == "highs"
    assert g.best.predicted_s == pytest.approx(h.best.predicted_s, rel=1e-4)


def test_mip_alone_finds_the_same_optimum_as_with_the_local_search_seed() -> None:
    for seed in (0, 5, 7):
        prof, hw, M = random_case(seed)
        seeded = solve_partition(prof, hw, _sequential(hw.num_gpus), M, rel_gap=1e-6)
        alone = solve_partition(prof, hw, _sequential(hw.num_gpus), M, seed=False, rel_gap=1e-6)
        assert alone.best.predicted_s == pytest.approx(seeded.best.predicted_s, rel=1e-6)
        assert alone.status_text() == "optimal"


def _non_identical(units: int) -> tuple:
    rng = random.Random(11)
    prof = random_profile(rng, units, identical=False)
    hw = Hardware.uniform(4, 40 * GiB, 12e9, groups=[[0], [1], [2], [3]])
    return prof, hw


def test_auto_falls_back_to_highs_when_the_free_gurobi_licence_refuses() -> None:
    pytest.importorskip("gurobipy")
    prof, hw = _non_identical(100)
    built = build_model(prof, hw, [0, 1, 2, 3], 2, 50)
    assert not built.lm.fits_free_gurobi(), (built.lm.num_vars, built.lm.num_rows)
    with pytest.raises(MobiusError, match="size-limited|refused"):  # the real licence error, as NotAvailableError
        solve(built.lm, "gurobi", time_limit_s=5)
    res = solve_partition(prof, hw, _sequential(4), 2, solver="auto", time_limit_s=5, stage_counts=[50])
    assert res.solver == "highs" and res.per_stage_count[0].num_vars > 2000
    assert res.best is not None and is_valid(prof, res.best.boundaries, hw, 4, 2)


@pytest.mark.slow
def test_a_48_block_plan_fits_the_free_licence_and_closes_its_gap() -> None:
    """The paper's 2+2 box, 48 identical blocks: the model stays inside gurobipy's free licence
    (2000 variables and constraints) and the search proves its plan within the default gap; the
    time it takes is printed, not asserted (it depends on the machine)."""
    prof = toy_profile(blocks=48, fwd_s=0.015, param_bytes=630e6, act_bytes=5e6)
    hw = Hardware.paper_3090ti()
    t0 = time.perf_counter()
    res = solve_partition(prof, hw, lambda S: [0, 2, 1, 3], 4, solver="auto", time_limit_s=120)
    print(f"\n48-block plan: {time.perf_counter() - t0:.2f} s, {res.best.num_stages} stages, solver {res.solver}, "
          f"{res.status_text()}, largest model {res.max_size[0]} variables / {res.max_size[1]} constraints")
    assert res.gap <= 0.005 + 1e-12 and not res.stage_counts_skipped  # the gap is a ratio of floats
    assert res.max_size[0] <= 2000 and res.max_size[1] <= 2000


@pytest.mark.parametrize("machine", MACHINES)
@pytest.mark.parametrize("seed", range(7))
def test_the_compute_bound_holds_for_every_partition_of_its_stage_count(seed: int, machine: str) -> None:
    """compute_bound(S) is below the timing model's step of every partition into S stages that fits (exhaustive),
    and a fifth of the best at least on these transfer-bound cases; with kept or resident stages fixed it says nothing."""
    from partition.baselines import all_partitions, is_valid
    from partition.mip import compute_bound

    prof, hw, M, options = _case(seed, machine)
    N = hw.num_gpus
    ev = ModelEvaluator(prof, hw, _sequential(N), M, options=options)
    best: dict[int, float] = {}
    for bounds in all_partitions(prof.num_units):
        if is_valid(prof, bounds, hw, N, M, options):
            S = len(bounds) - 1
            best[S] = min(best.get(S, math.inf), ev.step_time(bounds))
    assert len(best) >= 3
    for S, step in best.items():
        floor = compute_bound(prof, S, N, M, options, hw.gpu_memory_bytes)
        assert 0 < floor <= step * (1 + 1e-9), (S, floor, step)
    assert max(compute_bound(prof, S, N, M, options, hw.gpu_memory_bytes) / t for S, t in best.items()) > 0.2
    assert compute_bound(prof, 3, N, M, replace(options, kept=frozenset({0})), hw.gpu_memory_bytes) == 0.0


def test_the_status_says_optimal_only_when_proven() -> None:
    prof, hw, M = random_case(2)
    loose = solve_partition(prof, hw, _sequential(hw.num_gpus), M, rel_gap=0.2, seed=False)
    tight = solve_partition(prof, hw, _sequential(hw.num_gpus), M, rel_gap=1e-9)
    assert tight.status_text() == "optimal"
    assert loose.status_text() == "optimal" if loose.gap <= 1e-6 else loose.status_text().startswith("within ")
    skipped = replace(tight, stage_counts_skipped=2)
    assert "not tried" in skipped.status_text() and not skipped.proven


def test_a_stage_count_stopped_by_the_time_limit_is_not_a_proof(monkeypatch: pytest.MonkeyPatch) -> None:
    """A solve that ends at its time limit without a solution proves nothing below the cutoff: it is
    'time limit' with the solver's bound (it used to be counted as a proven cutoff, and the plan as
    optimal)."""
    import partition.mip as mip
    from partition.lp import SolveResult

    prof, hw, M = random_case(2)
    monkeypatch.setattr(mip, "solve", lambda *a, **k: SolveResult("time_limit", math.inf, 0.5, [], "gurobi", 0.01))
    r = solve_stage_count(prof, hw, list(range(hw.num_gpus)), M, 3, cutoff=2.0)
    assert (r.status, r.bound, r.boundaries) == ("time limit", 0.5, None)
    monkeypatch.setattr(mip, "solve", lambda *a, **k: SolveResult("cutoff", math.inf, math.inf, [], "gurobi", 0.01))
    assert solve_stage_count(prof, hw, list(range(hw.num_gpus)), M, 3, cutoff=2.0).status == "cutoff"


def test_every_stage_count_is_tried_before_a_hard_one_gets_more_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first pass gives every stage count a brief solve; one the limit stopped is solved again in
    the second pass with the time left, and while it stays open the plan states its gap."""
    import partition.mip as mip

    prof, hw, M = random_case(2)
    real, calls, polished = mip.solve_stage_count, [], []

    def hard_first(profile, hw_, gpus, M_, S, solver, cap, cutoff, *rest):
        if cutoff is None:  # (the alternatives polished last, :meth:`_CountSearch.polish`)
            polished.append(S)
        else:
            calls.append((S, cap))
        if S == hard:
            return mip.StageCountResult(S, "time limit", math.inf, 0.0, None, "gurobi", cap, 1, 1, "count")
        return real(profile, hw_, gpus, M_, S, solver, cap, cutoff, *rest)

    hard = 2
    monkeypatch.setattr(mip, "solve_stage_count", hard_first)
    res = solve_partition(prof, hw, _sequential(hw.num_gpus), M, time_limit_s=5)
    tried = [S for S, _ in calls]
    first = tried[:len(set(tried))]
    assert sorted(first) == sorted(set(tried)) and tried.count(hard) == 2, calls  # all once, then the hard one
    assert calls[-1][0] == hard and calls[-1][1] > calls[tried.index(hard)][1]  # with more time the second time
    floor = mip.compute_bound(prof, hard, hw.num_gpus, M, PipelineOptions(), hw.gpu_memory_bytes)
    assert 0 < res.lower_bound <= floor and not res.proven  # the hard count bounded by its compute alone
    assert res.status_text() == f"within {100 * res.gap:.2f}% of optimal"


def test_a_model_that_cannot_fit_names_the_unit_and_the_shortfall() -> None:
    prof = toy_profile(blocks=4)
    big = replace(prof.units[2], signature="big", param_bytes=3 * GiB, grad_bytes=3 * GiB)
    prof.units[2] = big
    hw = Hardware.uniform(2, 4 * GiB, 10e9)
    with pytest.raises(MobiusError) as err:
        plan_model(prof, hw, PlanRequest(micro_batches=2, mapping=[0, 1], with_baselines=False))
    msg = str(err.value)
    one_slot = 6 * GiB + 4 * big.param_count + 2 * big.in_bytes + big.saved_bytes + big.work_bytes
    assert "'block.1'" in msg and f"{one_slot - 4 * GiB:,} bytes" in msg and "1 device slot" in msg


def test_local_search_seed_is_never_worse_than_its_starting_split() -> None:
    prof = toy_profile(blocks=12)
    hw = Hardware.uniform(4, 4 * GiB, 10e9, groups=[[0], [1], [2], [3]])
    ev = ModelEvaluator(prof, hw, _sequential(4), 4)
    res = solve_partition(prof, hw, _sequential(4), 4)
    assert ev.step_time(res.best.boundaries) == pytest.approx(res.best.predicted_s, rel=1e-9)


def _random_residency(rng: random.Random, ev: ModelEvaluator, bounds: list[int],
                      options: PipelineOptions) -> PipelineOptions:
    """Random resident stages (never a tied end) and random kept stages among those allowed."""
    from partition import residency

    S = len(bounds) - 1
    free = [j for j in range(S) if j not in residency.tied_ends(ev, S)]
    res = frozenset(j for j in free if rng.random() < 0.4)
    kept = frozenset(j for j in range(S) if residency.may_keep(S, j) and rng.random() < 0.6)
    return replace(options, resident=res, kept=kept, grad_dtype=rng.choice(["fp32", "half"]))


@pytest.mark.parametrize("machine", MACHINES[:2])
@pytest.mark.parametrize("seed", range(8))
def test_the_simulator_runs_what_the_model_predicts_with_resident_and_kept_stages(seed: int, machine: str) -> None:
    """Resident stages (device AdamW, no transfers), kept activations (no recompute) and half
    gradient downloads: the simulator of the runtime's action lists agrees with the timing model."""
    prof, hw, M, options = _case(seed, machine)
    hw = replace(hw, gpu_memory_bytes=hw.gpu_memory_bytes * 4, device_adam_params_per_s=hw.cpu_adam_params_per_s * 3,
                 cpu_adam_half_grads_params_per_s=hw.cpu_adam_params_per_s * 0.8)
    N = hw.num_gpus
    rng = random.Random(100 + seed)
    parts = [b for b in all_partitions(prof.num_units) if len(b) - 1 >= N]
    rng.shuffle(parts)
    tried = 0
    for bounds in parts:
        opts = _random_residency(rng, ModelEvaluator(prof, hw, _sequential(N), M, options=options), bounds, options)
        model = ModelEvaluator(prof, hw, _sequential(N), M, options=opts).evaluate(bounds)
        if model.violations or not (opts.resident or opts.kept):
            continue
        sim = simulate(prof, bounds, hw, list(range(N)), M, opts, record=False)
        assert sim.step_s == pytest.approx(model.T, rel=0.03), (bounds, opts)
        tried += 1
        if tried == 6:
            break
    assert tried >= 3


def test_the_residency_pass_uses_free_memory_and_stops_at_the_budget() -> None:
    """With room, the second pass makes stages resident and keeps activations, and the step gets
    shorter; each choice fits the budget; with no room it changes nothing."""
    from partition import residency

    from partition.timing import memory_peaks

    prof = toy_profile(blocks=8)
    bounds = [0, 2, 4, 6, 8, 10]
    probe = ModelEvaluator(prof, Hardware.uniform(2, 64 * GiB, 2e9, groups=[[0], [1]]), _sequential(2), 4)
    tight = int(max(memory_peaks(probe.exprs(bounds), probe.shape(5))) * 1e9) + 1000  # the swapped plan only
    for mem, expect_some in ((64 * GiB, True), (tight, False)):
        hw = Hardware.uniform(2, mem, 2e9, groups=[[0], [1]], cpu_adam_params_per_s=0.5e9)
        ev = ModelEvaluator(prof, hw, _sequential(2), 4)
        base = ev.step_time(bounds)
        res, kept, t = residency.choose(ev, bounds)
        assert bool(res or kept) == expect_some, (mem, res, kept)
        assert t <= base and (t < base) == expect_some
        assert not ev.evaluate(bounds, replace(ev.options, resident=res, kept=kept)).violations


def test_the_residency_pass_keeps_the_activations_of_swapped_stages() -> None:
    """With room on the GPUs the pass keeps the activations of swapped stages whose worker_gpus take other
    stages before their backward (no longer only resident or turning stages); the choice fits."""
    from partition import residency

    prof = toy_profile(blocks=16)
    bounds = [0, 1] + list(range(3, 17, 2)) + [17, 18]  # embed | 2 blocks x 7 + 1 block | head: 10 stages
    hw = Hardware.uniform(4, 64 * GiB, 10e9, groups=[[0], [1], [2], [3]], cpu_adam_params_per_s=20e9)
    ev = ModelEvaluator(prof, hw, _sequential(4), 4)
    res, kept, t = residency.choose(ev, bounds, resident=frozenset())
    assert t < ev.step_time(bounds) * 0.95
    shape = ev.shape(len(bounds) - 1)
    assert {j for j in kept if not shape.turns(j)}, kept
    assert not ev.evaluate(bounds, replace(ev.options, kept=kept)).violations


def test_near_best_keeps_each_counts_fastest_partition_within_the_slack() -> None:
    """The alternatives: the best first, then the ``FINEST`` largest stage counts' partitions, then per stage
    count its fastest partition (the MIP's or the local search's) within ``NEAR_BEST`` of the best, fastest
    first, at most ``ALTERNATIVES`` with the best."""
    import partition.mip as mip

    def result(S: int, t: float, status: str = "optimal") -> StageCountResult:
        return StageCountResult(S, status, t, t, list(range(S)) + [10], "gurobi", 0.0, 0, 0, "count")

    best = result(5, 1.0)
    solved = [best, result(4, 1.02), result(6, 1.5), StageCountResult(7, "cutoff", math.inf, 1.0, None, "", 0, 0, 0, "")]
    found = {4: [0, 1, 2, 3, 9, 10], 6: [0, 1, 2, 3, 4, 5, 10], 8: list(range(8)) + [10], 3: [0, 4, 8, 10],
             9: list(range(9)) + [10]}
    values = {4: 1.03, 6: 1.04, 8: 1.01, 3: 1.2, 9: 1.049}
    alts = mip.near_best(best, solved, found, values)
    assert [(r.num_stages, r.predicted_s) for r in alts] == [(5, 1.0), (9, 1.049), (8, 1.01), (4, 1.02), (6, 1.04)]
    assert alts[0] is best and alts[3] is solved[1]  # the MIP's 4-stage partition beats the local search's
    assert (mip.ALTERNATIVES, mip.FINEST) == (4, 2) and mip.near_best(None, solved, found, values) == []
    values[3] = 1.01  # a third within the slack: the best and three near it
    assert [r.num_stages for r in mip.near_best(best, solved, found, values)] == [5, 9, 8, 3, 4, 6]
    assert [r.num_stages for r in mip.near_best(result(9, 1.0), solved, found, values)] == [9, 8, 6, 5, 3, 4]


def test_the_first_pass_tries_every_count_when_solves_overrun_their_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Solvers overrun short limits (gurobipy by ~5 ms on OPT-13B's models); the first pass measures
    the overrun and still gives every stage count its root bound, so the plan states a gap."""
    import partition.mip as mip

    prof = toy_profile(blocks=30)
    hw = Hardware.uniform(4, 8 * GiB, 10e9, groups=[[0], [1], [2], [3]])
    caps: list[float] = []
    clock = types.SimpleNamespace(now=0.0)  # the search's clock: only the solves take time (a loaded machine's
    # local search and sleeps would take more, and leave less to the counts than the test means)
    clock.perf_counter = lambda: clock.now

    def slow(profile, hw_, gpus, M_, S, solver, cap, cutoff, *rest):
        caps.append(cap)
        clock.now += cap + 0.006  # the overrun, reported as solver time (as gurobipy reports it)
        return mip.StageCountResult(S, "time limit", math.inf, 0.1, None, "gurobi", cap + 0.006, 1, 1, "count")

    monkeypatch.setattr(mip, "solve_stage_count", slow)
    monkeypatch.setattr(mip, "time", clock)
    res = solve_partition(prof, hw, _sequential(4), 4, time_limit_s=1.0)
    floors = [max(0.1, mip.compute_bound(prof, r.num_stages, 4, 4, PipelineOptions(), hw.gpu_memory_bytes))
              for r in res.per_stage_count if r.status != "infeasible"]  # each count's root bound, or its compute's
    assert res.stage_counts_skipped == 0 and res.lower_bound == pytest.approx(min(floors)), (len(caps), caps[-3:])
    assert res.status_text().startswith("within ")


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("action", [0.0, 0.2])
def test_the_model_and_the_simulator_charge_the_same_messages(seed: int, action: float) -> None:
    """``Hardware.message_s`` (a CPU worker's dispatch thread per message it posts) and ``ModelProfile.action_s``
    (its own time per compute action): the timing model, the MIP with its cuts fixed and the simulator all pay
    the first for each micro-batch's receive and send between workers and the second for each compute, and agree
    again; the simulated dispatch is the count of those messages and computes."""
    prof, hw, M, options = _case(seed, "separate")
    N = hw.num_gpus
    unit_s = sum(u.fwd_s for u in prof.units) / prof.num_units
    hw, prof = replace(hw, message_s=0.3 * unit_s), replace(prof, action_s=action * unit_s)
    ev = ModelEvaluator(prof, hw, _sequential(N), M, options=options)
    free = ModelEvaluator(prof, replace(hw, message_s=0.0), _sequential(N), M, options=options)
    parts = [b for b in all_partitions(prof.num_units) if len(b) - 1 >= max(N, 2)]
    random.Random(seed).shuffle(parts)
    tried = 0
    for bounds in parts:
        model = ev.evaluate(bounds)
        if model.violations:
            continue
        S = len(bounds) - 1
        assert model.T > free.evaluate(bounds).T  # S - 1 boundaries between workers
        sim = simulate(prof, bounds, hw, list(range(N)), M, options)
        assert sim.step_s == pytest.approx(model.T, rel=0.03), bounds
        computes = M * (2 * S - 1)  # a forward and a backward per stage and micro-batch, the last stage's fused
        assert sim.time_split()["dispatch"] * N == pytest.approx(hw.message_s * M * 4 * (S - 1) + prof.action_s * computes)
        if tried == 0:
            built = build_model(prof, hw, list(range(N)), M, S, encoding="cut", options=options)
            for k, name in enumerate(built.lm.names):
                if name.startswith("z"):
                    i, j = map(int, name[1:].split("_"))
                    built.lm.lb[k] = built.lm.ub[k] = 1.0 if i < bounds[j + 1] else 0.0
            assert solve(built.lm, "highs").objective == pytest.approx(model.T, rel=1e-6), bounds
        tried += 1
        if tried == 4:
            break
    assert tried >= 2


def test_the_alternatives_the_local_search_found_are_solved_again_in_the_time_left() -> None:
    """A stage count whose solve the best plan cuts off leaves only the local search's partition of it, which can be
    far from its count's best (the time-proportional splits it climbs from); the alternatives handed to the
    residency pass (:func:`near_best`) are solved again without a cutoff in the time the search leaves: each is its
    count's best partition in the model, to the search's gap (24 units of random costs, identical blocks, on a
    2+2 box: before, 7 of the 26 alternatives of these 8 cases were not)."""
    from partition.mip import DEFAULT_REL_GAP, solve_stage_count

    checked = 0
    hw = Hardware.uniform(4, 6 * GiB, 10e9, groups=[[0, 1], [2, 3]])
    for seed in range(8):
        prof = random_profile(random.Random(seed), 24, True)
        res = solve_partition(prof, hw, lambda S: [0, 2, 1, 3], 4, time_limit_s=10)
        for alt in res.alternatives[1:]:
            own = solve_stage_count(prof, hw, [0, 2, 1, 3], 4, alt.num_stages, rel_gap=1e-6)
            assert alt.predicted_s <= own.predicted_s * (1 + DEFAULT_REL_GAP + 1e-9), (seed, alt, own)
            checked += 1
    assert checked >= 20


def test_a_search_given_a_time_to_beat_looks_only_for_faster_partitions() -> None:
    """``beat`` (the best step of the runtime setting searched before: inputs on the GPU before inputs in host
    memory) is the cutoff from the first solve on: where no partition beats it, every stage count the MIP solves
    is settled at once (proven not to beat it, and bounded by it), and the bound stated is at least it."""
    from partition.mip import DEFAULT_REL_GAP

    prof, hw, M = random_case(3)
    free = solve_partition(prof, hw, _sequential(hw.num_gpus), M, time_limit_s=10)
    beat = free.best.predicted_s * 0.98
    res = solve_partition(prof, hw, _sequential(hw.num_gpus), M, time_limit_s=10, beat=beat)
    solved = [r for r in res.per_stage_count if r.solver]
    assert solved and all(r.status in ("cutoff", "infeasible") for r in solved), solved
    assert res.lower_bound >= beat * (1 - DEFAULT_REL_GAP) * (1 - 1e-12)
    assert res.best.predicted_s >= free.best.predicted_s * (1 - DEFAULT_REL_GAP)  # (the local search's, none faster)
