"""One plan type per schedule: the engine a plan's type picks and the check every engine makes of it first, the
comparison of the pipeline's schedules and its JSON, ``train.update`` read once (``TrainSection.delayed``) and
carried by the plans, and where a profile's unit times come from (``ModelProfile.source``)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

import topology
from fixtures.partition.profiles import toy_profile
from mobius.config import config_from_dict, load_config
from mobius.errors import MobiusError
from partition import Hardware, PlanRequest, RoundRobinPlan, ScheduleComparison, SwappedPlan, plan_schedules
from partition.zero import ZeroHardware, ZeroPlan

ROOT = Path(__file__).resolve().parents[1]
GiB = 1 << 30


def _schedules(delayed: bool, schedule: str = "round_robin", states: str = "fp32") -> ScheduleComparison:
    hw = Hardware.uniform(2, 8 * GiB, 10e9)
    return plan_schedules(toy_profile(blocks=4), hw, PlanRequest(micro_batches=4, mapping=[0, 1], delayed=delayed,
                                                                 schedule=schedule, states=states, time_limit_s=1,
                                                                 with_baselines=False))


def _zero_plan(delayed: bool) -> ZeroPlan:
    from mobius.layout import ParamInfo
    from partition.zero import plan

    prof = toy_profile(blocks=4)
    params = [ParamInfo((f"{u.name}.weight",), (1000,), (i,), True) for i, u in enumerate(prof.units)]
    hw = ZeroHardware(1, 8 * GiB, 10e9, 10e9, 100e9, 1e12, 2e9, 30e9, name="test")
    return plan(params, prof.num_units, prof, hw, micro_batches=2, checkpointing=True, barrier=False, delayed=delayed)


def _cfg(update: str, states: str = "fp32"):
    return config_from_dict({"model": {"preset": "gpt2-tiny"}, "train": {"update": update, "optimizer_states": states}},
                            "run.yaml")


def test_train_update_is_read_once_as_delayed() -> None:
    assert _cfg("delayed").train.delayed and not _cfg("sync").train.delayed


def test_the_plans_carry_the_update_rule_the_config_asked_for(tmp_path: Path) -> None:
    """``mobius plan``'s pipeline plans (both schedules) and zero plan of a delayed run carry ``delayed``; a sync
    run's do not."""
    from mobius.app.planning import plan_run
    from mobius.app.settings import Machine
    from mobius.assemble import planned_architecture

    box = Machine.saved(topology.load_topology(ROOT / "tests" / "fixtures" / "topology" / "topo2x2_sys.txt"))
    for update in ("sync", "delayed"):
        common = ["--parallel.devices=4", "--parallel.device=cuda", "--partition.gpu=rtx3090",
                  "--partition.time_limit_s=0.5", f"--partition.cache_dir={tmp_path}", f"--train.update={update}",
                  "--train.micro_batches=4"]
        cfg = load_config(ROOT / "configs" / "demo.yaml", ["--parallel.mode=pipeline", "--parallel.schedule=auto",
                                                            *common])
        plans = plan_run(cfg, planned_architecture(cfg), box).chosen.plan
        assert plans.swapped.options.delayed == plans.round_robin.options.delayed == (update == "delayed")
        assert {s.update for s in plans.schedules()} == {update}
        cfg = load_config(ROOT / "configs" / "demo.yaml", ["--parallel.mode=zero", *common])
        assert plan_run(cfg, planned_architecture(cfg), box).chosen.plan.delayed == (update == "delayed")


def test_the_engine_is_the_one_of_the_plans_type_and_each_refuses_a_plan_made_for_another_run() -> None:
    """``make_engine`` builds the engine of the plan's type, and every engine first checks the plan against the
    run's ``train.update`` and ``train.optimizer_states`` (one check: ``scheduler.plan_check``), so a plan made for
    a delayed run stops a sync run in the engine of its schedule, before anything is built."""
    from mobius.app.launch import ENGINES, make_engine
    from scheduler.pipeline_engine import PipelineEngine
    from scheduler.roundrobin_engine import RoundRobinEngine
    from scheduler.zero import ZeroEngine

    assert ENGINES == {SwappedPlan: PipelineEngine, RoundRobinPlan: RoundRobinEngine, ZeroPlan: ZeroEngine}
    delayed = _schedules(delayed=True)
    plans = {"the plan": delayed.swapped, "the round-robin plan": delayed.round_robin,
             "the zero plan": _zero_plan(delayed=True)}
    for what, plan in plans.items():
        with pytest.raises(MobiusError, match=f"^{what} was made for train.update=delayed, but the run has "
                                              f"train.update=sync; plan again for this configuration$"):
            make_engine(_cfg("sync"), None, plan, None, None, None)
    int8 = _schedules(delayed=False, states="int8")
    for what, plan in (("the plan", int8.swapped), ("the round-robin plan", int8.round_robin)):
        with pytest.raises(MobiusError, match=f"^{what} was made for train.optimizer_states=int8, but the run has "
                                              f"train.optimizer_states=fp32"):
            make_engine(_cfg("sync"), None, plan, None, None, None)


def test_the_comparison_runs_the_schedule_asked_for_and_round_trips_its_json() -> None:
    """``parallel.schedule``: swapped plans the swapped pipeline alone, round_robin both and runs the round-robin
    family; the comparison's JSON reads back to the same comparison, the plan that runs of the same type."""
    swapped = _schedules(delayed=False, schedule="swapped")
    assert swapped.round_robin is None and swapped.runs is swapped.swapped
    assert [s.schedule for s in swapped.schedules()] == ["swapped"]
    both = _schedules(delayed=False)
    assert isinstance(both.runs, RoundRobinPlan)
    assert [s.schedule for s in both.schedules()] == ["round_robin", "swapped"]
    for plans in (swapped, both):
        data = json.loads(json.dumps(plans.to_json()))
        again = ScheduleComparison.from_json(data)
        assert again.to_json() == data and type(again.runs) is type(plans.runs)
        assert again.runs.predicted_step_s == data["predicted_step_s"] == plans.runs.predicted_step_s
    assert again.round_robin == both.round_robin  # (its cuts, settings and predictions)


def test_a_profile_says_where_its_times_come_from() -> None:
    """``ModelProfile.source``: a datasheet's, a profile file's, and a measured one scaled to the compute earlier
    runs measured (learnt); the plan's ``profile:`` line reads it."""
    from mobius.app.planning import profile_line
    from mobius.models import get_preset, unit_specs
    from partition.calibrate import ComputeScale
    from partition.estimate import estimate_units
    from partition.profile import apply_profile_file

    specs = unit_specs(get_preset("gpt2-tiny"))
    sheet = estimate_units(specs, 1, 32, "bf16", "rtx4090")
    assert sheet.source == "datasheet" and profile_line(sheet).startswith("estimated for rtx4090 from its datasheet")
    times = {"block": {"forward_ms": 2.0, "backward_ms": 4.0}}
    data = {"gpu": "rtx4090", "micro_batch_size": 1, "seq_len": 32, "precision": "bf16", "units": times}
    filed = apply_profile_file(sheet, data, "p.json")
    assert filed.source == "file" and profile_line(filed).startswith("measured on rtx4090, from")
    learnt = dataclasses.replace(ComputeScale(1.5, 1.0, runs=2).apply(filed), source="learnt",
                                 notes={"in_run": {"runs": 2, "forward": 1.5}})
    assert profile_line(learnt).startswith("measured on rtx4090 (cached); x1.50 forward")


def test_a_measured_profile_is_learnt_once_runs_kept_their_compute(tmp_path: Path) -> None:
    """``as_runs_compute``: a measured profile with no runs kept stays measured; with a run's factors kept for the
    setting it is scaled to them and its source is learnt; a datasheet's is as given."""
    from mobius.app.planning import as_runs_compute
    from mobius.app.settings import Machine, resolve
    from mobius.models import get_preset, unit_specs
    from partition.calibrate import ComputeScale, record_scale
    from partition.estimate import estimate_units

    cfg = config_from_dict({"model": {"preset": "gpt2-tiny"}, "parallel": {"mode": "pipeline", "devices": 2,
                                                                           "device": "cpu"},
                            "partition": {"cache_dir": str(tmp_path)}}, "run.yaml")
    mc, settings = get_preset("gpt2-tiny"), resolve(cfg, Machine.cpu_only(), "pipeline")
    sheet = estimate_units(unit_specs(mc), cfg.train.micro_batch_size, cfg.data.seq_len, "fp32", "h100")
    measured = dataclasses.replace(sheet, source="measured", device_name="cpu", notes={})
    assert as_runs_compute(sheet, cfg, mc, settings) is sheet
    first = as_runs_compute(measured, cfg, mc, settings)
    assert first.source == "measured" and first.notes["in_run"]["runs"] == 0
    record_scale(tmp_path / "partition", first.notes["in_run"]["key"], ComputeScale(2.0, 1.0), {})
    again = as_runs_compute(dataclasses.replace(measured, notes={}), cfg, mc, settings)
    assert again.source == "learnt" and again.units[1].fwd_s == pytest.approx(2 * measured.units[1].fwd_s)
