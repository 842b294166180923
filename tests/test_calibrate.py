"""The compute of a run against its profile: fitted, kept per machine, applied to the next plan."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from fixtures.partition.profiles import toy_profile
from partition import Hardware, PlanRequest, RoundRobinPlan, SwappedPlan, plan_model, plan_schedules
from mobius.app.launch import measured_compute
from partition.calibrate import (KEPT_RUNS, ComputeScale, fit_action, fit_reduce_scatter, fit_scale, learnt_scale,
                                 record_scale, scale_key, scale_path)
from in_process import mobius

ROOT = Path(__file__).resolve().parents[1]
GiB = 1 << 30


def _plan(schedule: str) -> tuple[SwappedPlan | RoundRobinPlan, Hardware]:
    """The plan of ``schedule`` that runs, and its machine."""
    prof, hw = toy_profile(blocks=6), Hardware.uniform(2, 8 * GiB, 10e9)
    return plan_schedules(prof, hw, PlanRequest(micro_batches=4, mapping=[0, 1], schedule=schedule)).runs, hw


@pytest.mark.parametrize("schedule", ["swapped", "round_robin"])
def test_the_fit_finds_the_factors_a_run_computed_at(schedule: str) -> None:
    """A run whose forwards took 1.3x and backwards (apart from their recompute) 0.9x the profile: the fit
    against the phases that step shows gives those factors back, for the schedule that ran."""
    plan, hw = _plan(schedule)
    assert plan.schedule == schedule
    prof = toy_profile(blocks=6)
    assert plan.replay(prof, hw).step_s == pytest.approx(plan.predicted_step_s)
    truth = ComputeScale(1.3, 0.9)
    ran = plan.replay(truth.apply(prof), hw).time_split()
    fit = fit_scale(prof, lambda p: plan.replay(p, hw), {k: ran[k] for k in ("forward", "backward")})
    assert (fit.forward, fit.backward, fit.runs) == (pytest.approx(1.3, rel=1e-3), pytest.approx(0.9, rel=1e-3), 1)
    composed = fit.times(ComputeScale(2.0, 0.5))  # as apply composes
    assert (composed.forward, composed.backward) == (pytest.approx(2.6, rel=1e-3), pytest.approx(0.45, rel=1e-3))
    twice = ComputeScale(2.0, 0.5).apply(truth.apply(prof))
    once = fit.times(ComputeScale(2.0, 0.5)).apply(prof)
    assert [u.bwd_s for u in twice.units] == pytest.approx([u.bwd_s for u in once.units], rel=1e-3)
    assert fit_scale(prof, lambda p: plan.replay(p, hw), {"forward": 0.0, "backward": 1.0}) == ComputeScale()


@pytest.mark.parametrize("schedule", ["swapped", "round_robin"])
def test_the_fit_finds_the_dispatch_time_per_compute_a_run_measured(schedule: str) -> None:
    """A run whose dispatch thread spent 0.4 ms of its own on each compute action beyond its messages (CPU
    workers: binding stages, issuing copies): its dispatch phase gives that time back, which the next plan's
    profile carries (``ModelProfile.action_s``) and the simulated step pays on every compute."""
    plan, hw = _plan(schedule)
    hw.message_s = 0.1e-3
    prof = toy_profile(blocks=6)
    assert prof.action_s == 0.0
    truth = ComputeScale(1.3, 0.9, action_s=0.4e-3)
    ran = plan.replay(truth.apply(prof), hw)
    fast = plan.replay(ComputeScale(1.3, 0.9).apply(prof), hw)
    assert ran.time_split()["dispatch"] > fast.time_split()["dispatch"] > 0 and ran.step_s > fast.step_s
    fit = fit_scale(prof, lambda p: plan.replay(p, hw), {k: ran.time_split()[k] for k in ("forward", "backward")})
    assert fit.action_s == 0.0  # the profile's own (none)
    action_s = fit_action(fit.apply(prof), lambda p: plan.replay(p, hw), ran.time_split()["dispatch"])
    assert action_s == pytest.approx(0.4e-3, rel=1e-6)
    assert fit_action(prof, lambda p: plan.replay(p, hw), 0.0) == 0.0  # the messages alone take longer
    kept = ComputeScale(fit.forward, fit.backward, 1, action_s)
    assert kept.apply(prof).action_s == action_s and kept.times(ComputeScale(2.0, 0.5)).action_s == action_s
    assert plan.replay(kept.apply(prof), hw).step_s == pytest.approx(ran.step_s, rel=1e-3)
    assert "0.40 ms dispatch per compute" in kept.line()


def test_the_workers_spread_is_how_far_each_is_from_its_usual_compute_against_the_others() -> None:
    """``worker_spread`` from each worker's own phases: a worker the plan gave twice the work is not apart from the
    other; one whose compute in a step is 10% over its usual while the other's is 10% under is 10% apart there."""
    even = [{"step": k, "forward_s": 1.0, "backward_s": 2.0, "forward_by_worker": [2.0, 1.0],
             "backward_by_worker": [4.0, 2.0]} for k in range(4)]
    assert measured_compute(even)["worker_spread"] == 0.0
    apart = [{**r, "forward_by_worker": [2.0 * x, 1.0 * y], "backward_by_worker": [4.0 * x, 2.0 * y]}
             for r, (x, y) in zip(even, [(1.1, 0.9), (0.9, 1.1), (1.0, 1.0), (1.0, 1.0)])]
    assert measured_compute(apart)["worker_spread"] == pytest.approx((2 * 0.1 ** 2 / 4) ** 0.5)
    rotating = [{**r, "step": k, "schedule": "round_robin", "forward_by_worker": [2.0, 1.0][::1 - 2 * (k % 2)],
                 "backward_by_worker": [4.0, 2.0][::1 - 2 * (k % 2)]} for k, r in enumerate(even)]
    assert measured_compute(rotating)["worker_spread"] == 0.0  # the round-robin's work moving on from step to step
    assert "worker_spread" not in measured_compute([{"forward_s": 1.0, "backward_s": 2.0}])  # not measured
    assert "worker_spread" not in measured_compute([{**r, "forward_by_worker": [1.0], "backward_by_worker": [2.0]}
                                                    for r in even])  # one worker
    assert measured_compute(even, dispatch=False).keys() == {"forward", "backward", "worker_spread"}
    spreads = [{**r, "compute_spread": x} for r, x in zip(even, (0.1, 0.3, 0.2, 0.5))]
    assert measured_compute(spreads)["compute_spread"] == pytest.approx(0.25)  # the median of the steps
    waits = [{**r, "reduce_scatter_s": x} for r, x in zip(even, (0.1, 0.3, 0.2, 0.5))]  # zero mode's, CPU workers
    assert measured_compute(waits, waits=True)["reduce_scatter"] == pytest.approx(0.25)
    assert "reduce_scatter" not in measured_compute(waits)


@pytest.mark.parametrize("schedule", ["swapped", "round_robin"])
def test_a_plan_whose_workers_speeds_vary_waits_for_the_slower_one(schedule: str) -> None:
    """A profile whose workers' computes are 15% apart from step to step (``worker_spread``): the plan made with it
    and the plan's replay report the mean step over drawn speeds, above the step of workers alike by ``spread_s``,
    which the time split counts as idle (the others wait); the draws are seeded (the same step twice); the fit
    passes the spread a run measured on, and the next plan learns it."""
    prof, hw = toy_profile(blocks=6), Hardware.uniform(2, 8 * GiB, 10e9)
    spread = ComputeScale(worker_spread=0.15).apply(prof)
    assert (spread.worker_spread, prof.worker_spread) == (0.15, 0.0)
    req = PlanRequest(micro_batches=4, mapping=[0, 1], schedule=schedule)
    alike, apart = plan_schedules(prof, hw, req).runs, plan_schedules(spread, hw, req).runs  # (the schedule's plan)
    assert apart.schedule == schedule
    nominal = apart.replay(prof, hw)
    drawn = apart.replay(spread, hw)
    assert drawn.spread_s > 0.01 * nominal.step_s and drawn.step_s == pytest.approx(nominal.step_s + drawn.spread_s)
    assert apart.predicted_step_s == pytest.approx(drawn.step_s) and apart.replay(spread, hw).step_s == drawn.step_s
    assert alike.predicted_step_s == pytest.approx(alike.replay(prof, hw).step_s)
    split, plain = drawn.time_split(), nominal.time_split()
    assert split["idle"] == pytest.approx(plain["idle"] + drawn.spread_s) and split["tail"] == pytest.approx(plain["tail"])
    run = {k: nominal.time_split()[k] for k in ("forward", "backward")}
    fit = fit_scale(prof, lambda p: apart.replay(p, hw), {**run, "worker_spread": 0.15, "compute_spread": 0.2})
    assert (fit.forward, fit.backward, fit.worker_spread, fit.compute_spread) == \
        (pytest.approx(1.0), pytest.approx(1.0), 0.15, 0.2)
    assert "workers ±15% and computes ±20% around their means" in fit.line()
    both = apart.replay(fit.apply(prof), hw)  # each compute drawn too: a hand-over waits for the slow ones
    assert both.spread_s > drawn.spread_s and both.step_s == apart.replay(fit.apply(prof), hw).step_s
    one = Hardware.uniform(1, 8 * GiB, 10e9)  # one worker: nothing to wait for but its own computes
    single = plan_model(spread, one, PlanRequest(micro_batches=4, mapping=[0]))
    assert single.replay(spread, one).spread_s == pytest.approx(0.0, abs=1e-12)
    alone = ComputeScale(compute_spread=0.2).apply(prof)
    assert single.replay(alone, one).spread_s != 0.0


@pytest.mark.parametrize("checkpointing", [True, False])
def test_a_zero_plan_replayed_gives_the_factors_its_run_computed_at_back(checkpointing: bool) -> None:
    """The same for zero mode's plan: replayed with the profile it was made with it predicts what it did, and
    the fit against the forward and backward phases of a run at 1.3x and 0.9x gives those factors back (with
    activation checkpointing every backward recomputes its forward, without it none does)."""
    from mobius.layout import ParamInfo
    from partition.zero import ZeroHardware, replay
    from partition.zero import plan as zero_plan

    prof = toy_profile(blocks=6)
    params = [ParamInfo((f"u{u}.w",), (4096,), (u,), decay=True) for u in range(prof.num_units)]
    hw = ZeroHardware(2, 8 * GiB, 10e9, 10e9, 50e9, 1e12, 2e9, 30e9, name="test")
    zp = zero_plan(params, prof.num_units, prof, hw, micro_batches=4, checkpointing=checkpointing, barrier=True)
    again = lambda p: replay(zp, params, prof.num_units, p, hw)  # noqa: E731
    assert again(prof).step_s == pytest.approx(zp.predicted_step_s)
    ran = again(ComputeScale(1.3, 0.9).apply(prof)).time_split()
    assert ran["forward"] > 0 and ran["backward"] > 0
    fit = fit_scale(prof, again, ran)
    assert (fit.forward, fit.backward, fit.runs) == (pytest.approx(1.3, rel=1e-3), pytest.approx(0.9, rel=1e-3), 1)


def _zero(blocking: bool, spread: ComputeScale = ComputeScale(), ranks: int = 2, **setting: int):
    """A zero plan of the toy model made with ``spread`` applied to its profile, on CPU workers (``blocking``: the
    dispatch thread waits for its gathers' fills and its reduce-scatters) or GPUs; its replay; the profile."""
    from mobius.layout import ParamInfo
    from partition.zero import ZeroHardware, replay
    from partition.zero import plan as zero_plan

    prof = toy_profile(blocks=6)
    params = [ParamInfo((f"u{u}.w",), (1 << 16,), (u,), decay=True) for u in range(prof.num_units)]
    hw = ZeroHardware(ranks, 8 * GiB, 10e9, 10e9, 0.45e9, 40e9, 2e9, 30e9, collective_s=1e-3, name="test",
                      blocking=blocking)
    zp = zero_plan(params, prof.num_units, spread.apply(prof), hw, micro_batches=4, checkpointing=False, barrier=True,
                   **setting)
    return zp, (lambda p: replay(zp, params, prof.num_units, p, hw)), prof


def test_a_zero_plan_whose_ranks_speeds_vary_waits_for_the_slowest_at_every_collective() -> None:
    """Ranks whose computes vary (from step to step 15%, each compute 20%): zero's plan and its replay report the mean
    step over drawn speeds, above the step of ranks alike by ``spread_s`` (every collective begins when the last rank
    issues it), the draws seeded; the searches compare at the means; one rank waits for nobody."""
    spreads = ComputeScale(worker_spread=0.15, compute_spread=0.2)
    for blocking in (True, False):
        zp, again, prof = _zero(blocking, spreads)
        nominal, drawn = again(prof), again(spreads.apply(prof))
        assert nominal.spread_s == 0 and drawn.spread_s > 0.01 * nominal.step_s
        assert drawn.step_s == pytest.approx(nominal.step_s + drawn.spread_s) == zp.predicted_step_s
        assert again(spreads.apply(prof)).step_s == drawn.step_s and zp.spread_s == drawn.spread_s
        assert drawn.time_split()["forward"] == nominal.time_split()["forward"]  # the compute's phases at the means
        assert f"the spreads drawn: +{drawn.spread_s:.3f} s" in zp.summary()
    zp, again, prof = _zero(True)
    assert zp.spread_s == 0 and "drawn" not in zp.summary()
    one, again1, _ = _zero(True, ComputeScale(worker_spread=0.15), ranks=1)
    assert again1(ComputeScale(worker_spread=0.15).apply(prof)).spread_s == pytest.approx(0.0, abs=1e-12)


def test_zero_on_cpu_workers_waits_for_its_collectives_and_learns_the_reduce_scatters_time() -> None:
    """On CPU workers the dispatch thread fills the blocks, starts the next operator's gathers once its compute has
    ended and waits for each reduce-scatter: the plan's time split has those waits (a GPU's has none, its dispatch
    runs ahead of its streams), the gathers are no longer hidden behind the compute they follow, and a run whose
    reduce-scatters took 1.7x the model (and whose ranks' speeds varied) gives 1.7 back, beside its compute factors,
    for the next plan to simulate with."""
    cpu, again, prof = _zero(True)
    gpu, again_gpu, _ = _zero(False)
    split, gpu_split = again(prof).time_split(), again_gpu(prof).time_split()
    assert split["reduce_scatter"] > 0 and split["gather_wait"] > gpu.stall_s
    assert "reduce_scatter" not in gpu_split and "gather_wait" not in gpu_split
    least, _, _ = _zero(True, chunk_size=1 << 16, cache_blocks=2)  # a chunk per unit, rCache-min: gathered anew
    shard, rs, ag = 1 << 15, 1e-3 + (1 << 15) * 4 / 0.45e9, 1e-3 + (1 << 15) * 2 / 0.45e9
    assert (least.num_chunks, least.padded_chunk // 2) == (8, shard)
    # each backward's flush waits behind the all-gather the dispatch thread started after its compute (prefetch)
    assert least.time_split["reduce_scatter"] >= least.num_chunks * rs + 5 * ag
    truth = ComputeScale(1.3, 0.9, worker_spread=0.1, compute_spread=0.1, reduce_scatter_x=1.7)
    ran = again(truth.apply(prof))
    assert ran.step_s > again(dataclasses.replace(truth, reduce_scatter_x=1.0).apply(prof)).step_s
    run = {k: ran.time_split()[k] for k in ("forward", "backward", "reduce_scatter")}
    fit = fit_scale(prof, again, {**run, "worker_spread": 0.1, "compute_spread": 0.1})
    assert (fit.forward, fit.backward) == (pytest.approx(1.3, rel=0.02), pytest.approx(0.9, rel=0.02))
    assert fit.reduce_scatter_x == pytest.approx(1.7, rel=0.03) and "reduce-scatters x1.7" in fit.line()
    assert fit_reduce_scatter(prof, again_gpu, 1.0) == prof.reduce_scatter_x == 1.0  # nothing to fit on a GPU


def test_the_next_plan_uses_the_mean_of_the_last_runs_and_ignores_a_torn_file(tmp_path: Path) -> None:
    key = scale_key("profile", 2, 1, "pipeline")
    assert learnt_scale(tmp_path, key) == ComputeScale()  # nothing learnt: the profile as measured
    for k in range(KEPT_RUNS + 2):
        record_scale(tmp_path, key, ComputeScale(1.0 + k, 2.0, action_s=k * 1e-4), {"device": "cpu"})
    mean = 1.0 + sum(range(2, KEPT_RUNS + 2)) / KEPT_RUNS
    assert learnt_scale(tmp_path, key) == ComputeScale(pytest.approx(mean), pytest.approx(2.0), KEPT_RUNS,
                                                       pytest.approx((mean - 1.0) * 1e-4))
    scale_path(tmp_path, key).write_text('{"runs": [{"forward": 1.5, "backward": 0.5}]}')  # kept before action_s
    assert learnt_scale(tmp_path, key) == ComputeScale(1.5, 0.5, 1, 0.0)
    other = scale_key("profile", 2, 1, "pipeline/round_robin")  # a schedule with no runs yet takes another's
    assert learnt_scale(tmp_path, other, [(key, "with parallel.schedule=swapped")]) == \
        ComputeScale(1.5, 0.5, 1, 0.0, "with parallel.schedule=swapped")
    assert ComputeScale(1.5, 0.5, 1, 0.0, "with parallel.schedule=swapped").line() == \
        "x1.50 forward, x0.50 backward as the last run with parallel.schedule=swapped on this machine computed"
    record_scale(tmp_path, other, ComputeScale(1.2, 0.8, action_s=2e-4), {"device": "cpu"})
    assert learnt_scale(tmp_path, other, [(key, "with parallel.schedule=swapped")]) == ComputeScale(1.2, 0.8, 1, 2e-4)
    assert learnt_scale(tmp_path, scale_key("profile", 4, 1, "pipeline")).runs == 0  # another worker count: its own
    assert learnt_scale(tmp_path, scale_key("profile", 2, 1, "zero")).runs == 0  # another mode: its own
    scale_path(tmp_path, key).write_text('{"runs": [{"forward": 1.2')
    assert learnt_scale(tmp_path, key) == ComputeScale()
    for spread in (0.1, 0.0, 0.05):  # a run that measured no spread (one worker, zero mode) counts at 0
        record_scale(tmp_path, key, ComputeScale(1.0, 1.0, worker_spread=spread, compute_spread=2 * spread),
                     {"device": "cpu"})
    learnt = learnt_scale(tmp_path, key)
    assert (learnt.worker_spread, learnt.compute_spread) == (pytest.approx(0.05), pytest.approx(0.1))
    assert learnt.reduce_scatter_x == 1.0  # (kept before it: as modelled)
    record_scale(tmp_path, key, ComputeScale(1.0, 1.0, reduce_scatter_x=2.0), {"device": "cpu"})
    assert learnt_scale(tmp_path, key).reduce_scatter_x == pytest.approx(1.25)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["pipeline", "zero"])
def test_a_run_keeps_its_compute_and_the_next_plan_is_made_with_it(tmp_path: Path, demo_data_cache: Path,
                                                                   mode: str) -> None:
    """The demo on 2 CPU workers, 6 steps, as the pipeline and in zero mode: the run keeps the factors its steady
    steps measured, and ``mobius plan`` of the mode then plans with them and says so."""
    cache = tmp_path / "cache"
    common = [f"--data.cache_dir={demo_data_cache}", f"--partition.cache_dir={cache}", f"--parallel.mode={mode}",
              "--parallel.devices=2", "--train.eval_every=0"]
    demo = str(ROOT / "configs" / "demo.yaml")

    r = subprocess.run([sys.executable, "-m", "mobius.cli", "train", demo, f"--output.dir={tmp_path / 'run'}",
                        "--train.max_steps=6", *common], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "compute inside the steps: forward x" in r.stderr and "with that compute the plan's step is" in r.stderr
    kept = [json.loads(p.read_text()) for p in (cache / "partition" / "in_run").glob("*.json")]
    assert len(kept) == 1 and len(kept[0]["runs"]) == 1 and (kept[0]["workers"], kept[0]["mode"]) == (2, mode)
    factors = kept[0]["runs"][0]
    assert 0.2 < factors["forward"] < 5 and 0.2 < factors["backward"] < 5
    if mode == "pipeline":  # CPU workers' dispatch thread per compute (binding stages, copies issued)
        assert 0 < factors["action_s"] < 0.05 and factors["reduce_scatter_x"] == 1.0
    else:  # the reduce-scatters' time the steps measured, against the model's
        assert factors["action_s"] == 0 and 0.1 <= factors["reduce_scatter_x"] != 1.0
        assert "reduce-scatters x" in r.stderr and "reduce scatter " in r.stderr and "gather wait " in r.stderr
        line = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
        assert len(line["forward_by_worker"]) == 2 and line["gather_wait_s"] > 0 and line["reduce_scatter_s"] > 0
    shown = mobius(["plan", demo, "--json", *common])
    assert shown.returncode == 0, shown.stderr[-3000:]
    plan = json.loads(shown.stdout)
    assert plan["compute_scale"] == {**factors, "runs": 1, "origin": ""}
    text = mobius(["plan", demo, *common])
    assert ComputeScale(**factors, runs=1).line() in text.stdout + text.stderr
    assert ComputeScale(**factors, runs=1).line().endswith("as the last run on this machine computed")
    # the spreads its steps measured, drawn in the predicted step
    assert factors["compute_spread"] > 0 and factors["worker_spread"] > 0
    assert "the runs measured drawn" in text.stdout + text.stderr
    if mode == "pipeline":  # the round-robin schedule has no runs of its own yet: planned with the swapped one's
        rr = mobius(["plan", demo, "--parallel.schedule=round_robin", *common])
        assert rr.returncode == 0, rr.stderr[-3000:]
        assert ComputeScale(**factors, runs=1, origin="with parallel.schedule=swapped").line() in rr.stdout + rr.stderr


def test_the_rows_of_this_run_are_those_after_the_lines_before_it_and_a_torn_line_is_left_out(tmp_path: Path) -> None:
    from mobius.app.launch import metrics_lines, run_rows

    metrics = tmp_path / "metrics.jsonl"
    assert metrics_lines(metrics) == 0 and run_rows(metrics, 0) == []
    earlier = [{"step": 1, "ready_s": 3.0}, {"step": 2}]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in earlier))
    before = metrics_lines(metrics)
    with metrics.open("a") as f:  # a resumed run appends; killed while writing its last line
        f.write(json.dumps({"step": 3, "ready_s": 2.0}) + "\n" + json.dumps({"step": 4}) + "\n" + '{"step": 5, "lo')
    assert [r["step"] for r in run_rows(metrics, before)] == [3, 4]
    assert [r["step"] for r in run_rows(metrics)] == [3, 4]  # without the count: from the last run's first line


def test_a_traced_step_is_no_steady_step_and_the_log_sets_each_phase_beside_the_plan() -> None:
    """The step that writes a trace (``parallel.trace_step``'s) waits for the CPU updates: the medians that a run logs, and that
    the next plan learns its compute from, leave it out. The step's end (``reduce_s``) stands beside the plan's
    tail where the runtime measures it (the swapped pipeline's)."""
    from mobius.app.launch import phases, steady_rows

    rows = [{"step": k, "step_s": 1.0 + k / 10, "forward_s": 0.25, "backward_s": 0.5, "upload_wait_s": 0.0,
             "dispatch_s": 0.01, "reduce_s": 0.125} for k in range(1, 7)]
    rows[3]["traced"] = True
    assert [r["step"] for r in steady_rows(rows)] == [3, 5, 6]
    assert [r["step"] for r in steady_rows(rows, steady_from=4)] == [5, 6]
    split = {"forward": 0.2, "backward": 0.4, "upload_wait": 0.0, "dispatch": 0.0, "tail": 0.1}
    table = phases(0.9, split, rows)
    assert table["step"] == (0.9, 1.5) and table["tail"] == (0.1, 0.125) and table["forward"] == (0.2, 0.25)
    for r in rows:
        del r["reduce_s"]  # the round-robin runtime's lines: no measured end
    assert "tail" not in phases(0.9, split, rows)
