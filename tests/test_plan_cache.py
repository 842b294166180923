"""Pipeline plans kept on the machine (mobius/app/plan_cache.py): searched once for the same inputs, searched
again when any input, the code or the host's memory moves, or when the user asks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import topology
from mobius.app import plan_cache, planning
from mobius.app.planning import plan_run
from mobius.app.settings import Machine
from mobius.assemble import planned_architecture
from mobius.config import load_config

ROOT = Path(__file__).resolve().parents[1]
BOX = topology.load_topology(ROOT / "tests" / "fixtures" / "topology" / "topo2x2_sys.txt")


@pytest.fixture
def searches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the planner's searches (calls of partition.plan_schedules through the app)."""
    calls: list[int] = []
    search = planning.plan_schedules
    monkeypatch.setattr(planning, "plan_schedules", lambda *a: calls.append(1) or search(*a))
    return calls


def _plans(cache: Path, *overrides: str):
    """The pipeline's schedules planned for the demo on a 2+2 box."""
    cfg = load_config(ROOT / "configs" / "demo.yaml",  # a small GPT-2: searches of 0.1 s
                      ["--parallel.mode=pipeline", "--parallel.device=cuda", "--parallel.devices=4",
                       "--partition.gpu=rtx3090", "--partition.time_limit_s=1", f"--partition.cache_dir={cache}",
                       *overrides])
    return plan_run(cfg, planned_architecture(cfg), Machine.saved(BOX)).chosen.plan


def _plan(cache: Path, *overrides: str):
    """The swapped pipeline's plan of :func:`_plans`."""
    return _plans(cache, *overrides).swapped


def test_a_plan_is_searched_once_and_reused_for_the_same_inputs(tmp_path: Path, searches: list[int]) -> None:
    first = _plan(tmp_path)
    again = _plan(tmp_path)
    assert len(searches) == 1
    assert again.runtime_settings() == first.runtime_settings()
    assert again.predicted_step_s == first.predicted_step_s and again.stages == first.stages
    assert first.mip.reused is None
    kept = (tmp_path / "partition" / "plans").glob("*.json")
    assert again.mip.reused.file == str(next(kept).resolve())
    line = next(x for x in again.summary().splitlines() if x.startswith("plan reused: "))
    assert "partition.reuse_plan=false searches again" in line
    expected = {k: v for k, v in first.to_json().items() if k != "mip"}
    assert {k: v for k, v in again.to_json().items() if k != "mip"} == expected  # the whole plan, as made


def test_a_kept_plan_of_both_schedules_runs_the_same_round_robin_plan(tmp_path: Path, searches: list[int]) -> None:
    """With ``parallel.schedule: round_robin`` the kept plan holds both schedules: reused, the round-robin plan runs
    again with its cuts, settings and predictions, beside the same swapped plan."""
    from partition import RoundRobinPlan

    first = _plans(tmp_path, "--parallel.schedule=round_robin")
    again = _plans(tmp_path, "--parallel.schedule=round_robin")
    assert len(searches) == 1 and again.swapped.mip.reused is not None
    assert isinstance(again.runs, RoundRobinPlan) and again.runs == first.runs
    assert again.schedules() == first.schedules()


def test_any_input_the_code_or_the_users_word_searches_again(tmp_path: Path, searches: list[int],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    _plan(tmp_path)
    _plan(tmp_path, "--train.micro_batches=4")  # the request
    _plan(tmp_path, "--partition.time_limit_s=2")  # the search's own settings
    _plan(tmp_path, "--data.seq_len=64")  # the profile
    _plan(tmp_path, "--partition.cpu_update_rate=8")  # the machine
    assert len(searches) == 5
    again = _plan(tmp_path, "--partition.reuse_plan=false")  # asked for: searched again, and kept
    assert len(searches) == 6 and again.mip.reused is None
    assert _plan(tmp_path).mip.reused is not None and len(searches) == 6
    monkeypatch.setattr(plan_cache, "code_fingerprint", lambda: "other code")
    _plan(tmp_path)
    assert len(searches) == 7


def test_the_hosts_measured_memory_may_drift_a_little_and_must_hold_the_stores(tmp_path: Path) -> None:
    """The free memory measured on the machine is left out of the key: a kept plan runs while it stays within
    2% (or 1 GiB) of what the plan was made with and holds the plan's stores."""
    from partition import Hardware, PlanRequest, plan_schedules
    from partition.estimate import estimate_units
    from mobius.models import unit_specs

    cfg = load_config(ROOT / "configs" / "demo.yaml", [])
    prof = estimate_units(unit_specs(planned_architecture(cfg)), 4, 128, "fp32", "rtx3090")
    request = PlanRequest(micro_batches=4, time_limit_s=1)
    made: list[int] = []

    def plan_with(gib: float):
        hw = Hardware.uniform(2, 22 * 2**30, 12e9)
        hw.host_memory_bytes = int(gib * 2**30)
        return plan_cache.reuse_or_plan(tmp_path, prof, hw, request,
                                        lambda: made.append(1) or plan_schedules(prof, hw, request)).swapped

    first = plan_with(100)
    near = plan_with(101)
    assert len(made) == 1 and near.host_memory_bytes == 101 * 2**30  # the memory now, in its summary
    assert near.runtime_settings() == first.runtime_settings()
    plan_with(110)  # moved by 10%: planned again
    assert len(made) == 2
    assert plan_cache._memory_holds(None, None, 0) and not plan_cache._memory_holds(None, 2**40, 0)
    assert plan_cache._memory_holds(100 * 2**30, 100 * 2**30, 100 * 2**30)
    assert not plan_cache._memory_holds(100 * 2**30, 100 * 2**30, 100 * 2**30 + 1)  # its stores no longer fit


def test_a_damaged_kept_plan_is_searched_again(tmp_path: Path, searches: list[int],
                                              caplog: pytest.LogCaptureFixture) -> None:
    _plan(tmp_path)
    (path,) = (tmp_path / "partition" / "plans").glob("*.json")
    path.write_text(json.dumps({"plan": {"boundaries": [0, 1]}}))  # a key missing
    again = _plan(tmp_path)
    assert len(searches) == 2 and again.mip.reused is None
    assert f"ignoring the kept plan {path}" in caplog.text
    assert _plan(tmp_path).mip.reused is not None  # the new one kept in its place


def test_the_newest_plans_are_kept(tmp_path: Path, searches: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plan_cache, "PLANS_KEPT", 2)
    for n in (1, 2, 3):
        _plan(tmp_path, f"--train.micro_batches={n}")
    assert len(list((tmp_path / "partition" / "plans").glob("*.json"))) == 2
    _plan(tmp_path, "--train.micro_batches=3")
    assert len(searches) == 3
    _plan(tmp_path, "--train.micro_batches=1")  # the oldest: deleted
    assert len(searches) == 4


def test_the_code_is_every_source_file_of_mobius(tmp_path: Path) -> None:
    for package in plan_cache._PACKAGES:
        (tmp_path / package / "sub").mkdir(parents=True)
        (tmp_path / package / "sub" / "a.py").write_text("x = 1\n")
    (tmp_path / "partition" / "notes.txt").write_text("not code")
    before = plan_cache.source_hash(tmp_path)
    (tmp_path / "partition" / "notes.txt").write_text("still not code")
    assert plan_cache.source_hash(tmp_path) == before
    (tmp_path / "scheduler" / "sub" / "a.py").write_text("x = 2\n")
    assert plan_cache.source_hash(tmp_path) != before
    assert plan_cache.code_fingerprint() == plan_cache.source_hash(ROOT)  # this checkout's
