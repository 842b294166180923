"""The partition MIP against exhaustive search, the simulator and itself (both solvers, both encodings)."""

from __future__ import annotations

import math
import random
import time
from dataclasses import replace

import pytest

from fixtures.partition.profiles import random_case, random_profile, toy_profile
from mobius.errors import MobiusError
from partition import (Hardware, ModelEvaluator, build_model, exhaustive_search, model_schedule, plan_model,
                       simulate, solve_partition, solve_stage_count)
from partition.baselines import all_partitions, is_valid
from partition.lp import solve

GiB = 1 << 30
SEEDS = range(12)


def _sequential(n: int):
    return lambda num_stages: list(range(n))


@pytest.mark.parametrize("seed", SEEDS)
def test_mip_is_optimal_against_exhaustive_search_scored_by_the_simulator(seed: int) -> None:
    prof, hw, M = random_case(seed)
    N = hw.num_gpus
    res = solve_partition(prof, hw, _sequential(N), M, solver="auto", time_limit_s=30, rel_gap=1e-4)
    assert res.best is not None and res.gap <= 1e-3
    mip_sim = simulate(prof, res.best.boundaries, hw, micro_batches=M, record=False).step_s
    best = exhaustive_search(prof, hw, N, M, lambda b: simulate(prof, b, hw, micro_batches=M, record=False).step_s)
    assert best.evaluated >= 20, "the case should leave the search a real choice"
    assert mip_sim <= best.step_s * 1.01, (res.best.boundaries, best.boundaries)
    # the MIP's own prediction of its plan matches the simulator (no contention in these cases)
    assert res.best.predicted_s == pytest.approx(mip_sim, rel=0.02)


@pytest.mark.parametrize("seed", [0, 5, 7])
def test_mip_alone_finds_the_same_optimum_as_with_the_local_search_seed(seed: int) -> None:
    prof, hw, M = random_case(seed)
    seeded = solve_partition(prof, hw, _sequential(hw.num_gpus), M, rel_gap=1e-4)
    alone = solve_partition(prof, hw, _sequential(hw.num_gpus), M, seed=False, rel_gap=1e-4)
    assert alone.best.predicted_s == pytest.approx(seeded.best.predicted_s, rel=1e-6)
    assert alone.best.status == "optimal"


def test_mip_objective_equals_the_timing_model_for_a_fixed_partition() -> None:
    """For every partition of a small model, fixing the cut variables gives the evaluator's time."""
    rng = random.Random(3)
    prof = random_profile(rng, 6, identical=False)
    hw = Hardware.uniform(3, 3 * GiB, 12e9, groups=[[0], [1], [2]])
    for bounds in all_partitions(prof.num_units)[::3]:
        S = len(bounds) - 1
        built = build_model(prof, hw, [0, 1, 2], 3, S, encoding="cut")
        lm = built.lm
        for k, name in enumerate(lm.names):
            if name.startswith("z"):
                i, j = map(int, name[1:].split("_"))
                lm.lb[k] = lm.ub[k] = 1.0 if i < bounds[j + 1] else 0.0
        expected = model_schedule(prof, hw, [0, 1, 2], 3, bounds).T
        if lm.trivially_infeasible() or not math.isfinite(expected):
            assert not is_valid(prof, bounds, hw, 3, 3)
            continue
        assert solve(lm, "highs").objective == pytest.approx(expected, rel=1e-6), bounds


def test_count_and_cut_encodings_agree_on_identical_blocks() -> None:
    prof = toy_profile(blocks=8)
    hw = Hardware.uniform(4, int(1.5 * GiB), 10e9, groups=[[0], [1], [2], [3]])
    for S in (3, 6, 10):
        count = solve_stage_count(prof, hw, [0, 1, 2, 3], 4, S, encoding="count")
        cut = solve_stage_count(prof, hw, [0, 1, 2, 3], 4, S, encoding="cut")
        assert count.predicted_s == pytest.approx(cut.predicted_s, rel=1e-6)


def test_gurobi_and_highs_find_the_same_optimum() -> None:
    pytest.importorskip("gurobipy")
    prof, hw, M = random_case(5)
    slots = _sequential(hw.num_gpus)
    g = solve_partition(prof, hw, slots, M, solver="gurobi", seed=False, rel_gap=1e-6)
    h = solve_partition(prof, hw, slots, M, solver="highs", seed=False, rel_gap=1e-6)
    assert g.solver == "gurobi" and h.solver == "highs"
    assert g.best.predicted_s == pytest.approx(h.best.predicted_s, rel=1e-4)


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


def test_48_block_plan_solves_in_under_10_seconds() -> None:
    prof = toy_profile(blocks=48, fwd_s=0.015, param_bytes=630e6, act_bytes=5e6)
    hw = Hardware.paper_3090ti()
    t0 = time.perf_counter()
    res = solve_partition(prof, hw, lambda S: [0, 2, 1, 3], 4, solver="auto", time_limit_s=60)
    elapsed = time.perf_counter() - t0
    print(f"\n48-block plan: {elapsed:.2f} s, {res.best.num_stages} stages, solver {res.solver}, gap {res.gap:.2e}, "
          f"largest model {res.max_size[0]} variables / {res.max_size[1]} constraints")
    assert elapsed < 10.0
    assert res.gap <= 0.005
    assert res.max_size[0] <= 2000 and res.max_size[1] <= 2000  # fits the free gurobipy licence


def test_a_model_that_cannot_fit_names_the_unit_and_the_shortfall() -> None:
    prof = toy_profile(blocks=4)
    big = replace(prof.units[2], signature="big", param_bytes=3 * GiB, grad_bytes=3 * GiB)
    prof.units[2] = big
    hw = Hardware.uniform(2, 4 * GiB, 10e9)
    with pytest.raises(MobiusError) as err:
        plan_model(prof, hw, micro_batches=2, mapping=[0, 1], with_baselines=False)
    msg = str(err.value)
    need = 6 * GiB + 2 * big.in_bytes + big.saved_bytes + big.work_bytes
    assert "'block.1'" in msg and f"{need - 4 * GiB:,} bytes" in msg


def test_local_search_seed_is_never_worse_than_its_starting_split() -> None:
    prof = toy_profile(blocks=12)
    hw = Hardware.uniform(4, 2 * GiB, 10e9, groups=[[0], [1], [2], [3]])
    ev = ModelEvaluator(prof, hw, _sequential(4), 4)
    res = solve_partition(prof, hw, _sequential(4), 4)
    assert ev.step_time(res.best.boundaries) == pytest.approx(res.best.predicted_s, rel=1e-9)
