"""What makes the planner fast without changing its answers: batched evaluation of the timing model,
the bound a free worker gives, the pruned residency pass against the plain greedy, the stage counts
memory rules out; and a guard on how many evaluations and simulations a plan costs."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from fixtures.partition.profiles import random_case
from partition import Hardware, ModelEvaluator, PipelineOptions, PlanRequest, plan_model, residency
from partition.baselines import all_partitions, is_valid
from partition.evaluate import GB
from partition.mip import fewest_stages
from partition.residency import MIN_GAIN, Move, _bytes, _moves
from partition.timing import VariantNumbers, Numbers, PipelineShape, Variant, step_model

OPTIONS = [PipelineOptions(), PipelineOptions(barrier=True), PipelineOptions(offload_inputs=True),
           PipelineOptions(num_slots=1), PipelineOptions(offload_inputs=True, barrier=True)]


def _cases(seeds: range):
    """(profile, machine, micro-batches, options, partition, rng) over the three machine kinds."""
    for seed in seeds:
        for machine in ("separate", "asymmetric", "shared"):
            prof, hw, M = random_case(seed, machine)
            if seed % 3 == 0:
                prof.tied_params = prof.units[0].param_count // 2
            rng = random.Random(seed)
            for bounds in rng.sample(all_partitions(prof.num_units), 3):
                yield prof, hw, M, OPTIONS[seed % len(OPTIONS)], bounds, rng


def _random_choice(rng: random.Random, S: int, tied: bool, options: PipelineOptions) -> PipelineOptions:
    ends = {0, S - 1} if tied and S > 1 else set()
    return dataclasses.replace(options, resident=frozenset(j for j in range(S) if j not in ends and rng.random() < 0.2),
                               kept=frozenset(j for j in range(S - 1) if rng.random() < 0.3))


def test_a_batch_gives_every_variant_the_numbers_of_its_own_evaluation() -> None:
    """One batched evaluation of kept variants equals each variant evaluated alone, to the bit,
    memory rules included (offloaded inputs, barriers, tied weights, resident stages)."""
    checked = 0
    for prof, hw, M, options, bounds, rng in _cases(range(10)):
        N, S = hw.num_gpus, len(bounds) - 1
        ev = ModelEvaluator(prof, hw, lambda _: list(range(N)), M, options=options)
        base = _random_choice(rng, S, prof.tied_params > 0, options)
        trials = [j for j in range(S - 1) if j not in base.kept] + [-1]
        variants = tuple(Variant(kept=frozenset([j]) if j >= 0 else frozenset()) for j in trials)
        alg = VariantNumbers(len(variants))
        shape = PipelineShape(S, N, M, base, prof.tied_params / 1e9, variants)
        step = np.broadcast_to(step_model(alg, ev.exprs(bounds), ev.rates(S), shape, hw.gpu_memory_bytes / GB).step,
                               (len(variants),))
        for b, j in enumerate(trials):
            alone = ev.evaluate(bounds, dataclasses.replace(base, kept=base.kept | ({j} if j >= 0 else set()))).T
            assert (np.inf if alg.broken[b] else float(step[b])) == alone, (bounds, base, j)
            checked += 1
    assert checked > 300


def test_a_free_worker_bounds_every_resident_or_kept_move_on_it() -> None:
    """The step with a worker's transfers and CPU updates free (and, for moves that keep
    activations, all its stages kept) is never longer than the step of any move on that worker."""
    checked = 0
    for prof, hw, M, options, bounds, rng in _cases(range(10)):
        N, S = hw.num_gpus, len(bounds) - 1
        ev = ModelEvaluator(prof, hw, lambda _: list(range(N)), M, options=options)
        base = _random_choice(rng, S, prof.tied_params > 0, options)
        ends = {0, S - 1} if prof.tied_params > 0 and S > 1 else set()
        for j in range(S):
            w = j % N
            for add_res, add_kept in (({j}, set()), ({j}, {j}), (set(), {j})):
                if add_res & (ends | base.resident) or add_kept & (base.kept | {S - 1}):
                    continue
                keeps = frozenset(range(w, S - 1, N)) - base.kept if add_kept else frozenset()
                low = step_model(Numbers(), ev.exprs(bounds), ev.rates(S),
                                 PipelineShape(S, N, M, base, prof.tied_params / 1e9, (Variant(keeps, frozenset([w])),)),
                                 1e9).step
                move = dataclasses.replace(base, resident=base.resident | add_res, kept=base.kept | add_kept)
                assert ev.evaluate(bounds, move).T >= float(np.asarray(low).item()) * (1 - 1e-12)
                checked += 1
    assert checked > 300


def _plain_greedy(ev: ModelEvaluator, bounds: list[int], resident, kept):
    """The residency pass as it was before it was made fast: every move evaluated in every round."""
    S = len(bounds) - 1
    cur = Move(frozenset(resident or ()), frozenset(kept or ()), "start")
    best_t = ev.evaluate(bounds, dataclasses.replace(ev.options, resident=cur.resident, kept=cur.kept)).T
    while True:
        found = None
        for move in _moves(ev, S, cur, resident is None, kept is None):
            t = ev.evaluate(bounds, dataclasses.replace(ev.options, resident=move.resident, kept=move.kept)).T
            if t < best_t * (1 - MIN_GAIN):
                score = (best_t - t) / _bytes(ev.exprs(bounds), ev.M, cur, move)
                if found is None or score > found[0]:
                    found = (score, t, move)
        if found is None:
            return cur.resident, cur.kept, best_t
        _, best_t, cur = found


@pytest.mark.parametrize("room", [1.0, 3.0])
def test_the_pruned_residency_pass_chooses_what_the_plain_greedy_chooses(room: float) -> None:
    """Batches, worker-local memory checks and the free-worker bounds change nothing: the same
    resident and kept stages and the same time, on random cases with little and much free memory."""
    cases = 0
    for prof, hw, M, options, bounds, rng in _cases(range(6)):
        hw = dataclasses.replace(hw, gpu_memory_bytes=int(hw.gpu_memory_bytes * room))
        ev = ModelEvaluator(prof, hw, lambda _: list(range(hw.num_gpus)), M, options=options)
        given = [(None, None), (frozenset(), None), (None, frozenset())][cases % 3]
        assert residency.choose(ev, bounds, *given) == _plain_greedy(ev, bounds, *given), (bounds, options, given)
        cases += 1


def test_no_partition_with_fewer_stages_than_fewest_stages_fits() -> None:
    """The memory bound that spares the MIP hopeless stage counts never rules out a partition that fits."""
    tight = 0
    for seed in range(16):
        prof, hw, M = random_case(seed, ("separate", "shared")[seed % 2])
        if prof.num_units > 8:
            continue
        for options in (PipelineOptions(), PipelineOptions(num_slots=1)):
            fewest = fewest_stages(prof, hw.gpu_memory_bytes, options)
            fitting = [len(b) - 1 for b in all_partitions(prof.num_units)
                       if is_valid(prof, b, hw, hw.num_gpus, M, options)]
            assert all(S >= fewest for S in fitting), (seed, fewest, min(fitting))
            tight += bool(fitting) and min(fitting) == fewest
    assert tight >= 4, "the bound should often be the smallest count that fits"


def test_a_plan_costs_a_bounded_number_of_evaluations_and_simulations(monkeypatch: pytest.MonkeyPatch) -> None:
    """A guard against the planner slowing down again: OPT-1.3B on the 8-GPU box (4 + 4 GPUs per
    root complex) with the residency and kept passes and the baselines, counted in evaluations of
    the timing model (a batch counts once) and simulator runs. Before the passes were made fast the
    same plan (the same stages, resident and kept ones) took 3,528 evaluations and 8 simulations; then 954.
    The residency pass on the search's three near-best alternatives adds up to two simulations each."""
    import partition.evaluate as evaluate
    import partition.plan as plan_module
    import partition.residency as residency_module
    from mobius.models import get_preset, unit_specs
    from partition.estimate import estimate_units

    counts = {"evaluations": 0, "simulations": 0}

    def counted(fn, key):
        def wrapper(*args, **kwargs):
            counts[key] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(evaluate, "step_model", counted(evaluate.step_model, "evaluations"))
    monkeypatch.setattr(residency_module, "step_model", counted(residency_module.step_model, "evaluations"))
    monkeypatch.setattr(plan_module, "simulate", counted(plan_module.simulate, "simulations"))
    prof = estimate_units(unit_specs(get_preset("opt-1.3b")), 1, 1024, "bf16", "rtx3090")
    hw = Hardware.uniform(8, 22 * 2**30, 26e9, groups=[[0, 1, 2, 3], [4, 5, 6, 7]])
    plan = plan_model(prof, hw, PlanRequest(micro_batches=4, barrier=True, min_stages=8))
    print(f"\nOPT-1.3B on 4+4: {counts['evaluations']} evaluations, {counts['simulations']} simulations, "
          f"{plan.solve_s:.2f} s, {plan.status}")
    assert counts["simulations"] <= 8 + 2 * 3
    assert counts["evaluations"] <= 1500
    assert plan.solve_s < 60  # minutes would be a regression whatever the machine's load


def test_the_local_search_batches_partitions_with_the_evaluators_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Partitions of one stage count evaluated in one batch get, to the bit, the step times the
    evaluator gives each alone (memory rules included), and the local search finds what it found
    evaluating them one by one, with the same evaluation count."""
    from partition import heuristic

    checked = 0
    for seed in range(12):
        prof, hw, M = random_case(seed, ("separate", "asymmetric", "shared")[seed % 3])
        options = OPTIONS[seed % len(OPTIONS)]

        def evaluator() -> ModelEvaluator:
            return ModelEvaluator(prof, hw, lambda _: list(range(hw.num_gpus)), M, options=options)

        by_count: dict[int, list[list[int]]] = {}
        for b in all_partitions(prof.num_units):
            by_count.setdefault(len(b) - 1, []).append(b)
        ev = evaluator()
        for parts in by_count.values():
            if len(parts) > 1:
                assert heuristic._Scores(ev)._batch(parts) == [ev.step_time(b) for b in parts]
                checked += len(parts)
        counts = list(range(1, prof.num_units + 1))
        ev_b, ev_p = evaluator(), evaluator()
        batched = heuristic.find_incumbent(ev_b, counts)
        monkeypatch.setattr(heuristic, "AHEAD", 1)
        plain = heuristic.find_incumbent(ev_p, counts)
        monkeypatch.undo()
        assert (batched.boundaries, batched.step_s, batched.per_stage_count, ev_b.evaluations) == \
            (plain.boundaries, plain.step_s, plain.per_stage_count, ev_p.evaluations)
    assert checked > 2000
