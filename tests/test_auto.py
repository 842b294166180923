"""``parallel.mode: auto``: the mode comes from the planners' predicted steps side by side, on saved
topologies (PCIe 2+2, 8-GPU 4+4, an NVLink box, one GPU) and without a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest

import topology
from mobius.app.planning import Candidate, decide, plan_run
from mobius.app.run import check_parallel
from mobius.app.settings import Machine
from mobius.assemble import planned_architecture
from mobius.config import load_config
from mobius.errors import MobiusError, NotAvailableError
from in_process import mobius

ROOT = Path(__file__).resolve().parents[1]
TOPO = ROOT / "tests" / "fixtures" / "topology"
OPT13B = ROOT / "configs" / "finetune-opt-13b.yaml"


def _choose(topo: str | None, *overrides: str):
    cfg = load_config(OPT13B, ["--parallel.mode=auto", *overrides])
    machine = Machine.saved(topology.load_topology(TOPO / topo)) if topo else Machine.cpu_only()
    return plan_run(cfg, planned_architecture(cfg), machine)


def _by_mode(choice) -> dict:
    return {c.mode: c for c in choice.candidates}


def test_decide_takes_the_fastest_mode_that_fits() -> None:
    rows = [Candidate("single", 1.0, False, "too big"), Candidate("pipeline", 3.0, True, ""),
            Candidate("zero", 2.0, True, "")]
    assert decide(rows, gpus=4)[0] == "zero"
    rows[0] = Candidate("single", 1.0, True, "")
    mode, reason = decide(rows, gpus=4)
    assert mode == "single" and "fit" in reason


def test_decide_prefers_zero_over_the_pipeline_on_nvlink() -> None:
    rows = [Candidate("pipeline", 1.0, True, ""), Candidate("zero", 1.5, True, "")]
    assert decide(rows, gpus=8, nvlink=False)[0] == "pipeline"
    mode, reason = decide(rows, gpus=8, nvlink=True)
    assert mode == "zero" and "NVLink" in reason and "1.000 s" in reason  # the pipeline's figure in the reason
    rows[1] = Candidate("zero", None, False, "does not fit")  # NVLink or not, zero must fit
    assert decide(rows, gpus=8, nvlink=True)[0] == "pipeline"


def test_decide_names_every_reason_when_nothing_fits() -> None:
    rows = [Candidate("single", 9.0, False, "states 191 GiB"), Candidate("pipeline", None, False, "short by 3 GiB")]
    with pytest.raises(MobiusError, match="no mode fits: single: states 191 GiB; pipeline: short by 3 GiB"):
        decide(rows)


def test_a_pcie_2x2_box_runs_the_pipeline_with_zero_as_runner_up() -> None:
    choice = _choose("topo2x2_sys.txt")
    rows = _by_mode(choice)
    assert choice.mode == "pipeline" and not choice.explicit
    assert not rows["single"].fits and rows["zero"].fits
    assert rows["pipeline"].predicted_step_s < rows["zero"].predicted_step_s
    line = choice.line()
    assert line.startswith("parallel.mode=auto chose pipeline") and "runner-up zero" in line
    assert "without NVLink" in line
    assert choice.table().splitlines()[3].startswith("  pipeline") and "<- chosen" in choice.table().splitlines()[3]


def test_an_8_gpu_pcie_4x4_box_runs_the_pipeline() -> None:
    choice = _choose("topo8_4x4_nic.txt", "--parallel.devices=8", "--train.micro_batches=8")
    assert choice.mode == "pipeline" and _by_mode(choice)["zero"].fits
    assert choice.chosen.settings.workers == 8 and choice.chosen.runs.num_gpus == 8


def test_an_nvlink_box_runs_zero() -> None:
    choice = _choose("dgx_a100_nv12.txt", "--parallel.devices=8", "--train.micro_batches=8")
    assert choice.mode == "zero" and "NVLink" in choice.reason
    assert _by_mode(choice)["pipeline"].fits  # planned beside it, and named in the reason
    assert choice.chosen.settings.workers == 8


def test_one_gpu_trains_a_model_that_fits_plainly_and_pipelines_one_that_does_not() -> None:
    small = _choose("single_gpu.txt", "--parallel.devices=1", "--model.preset=opt-125m")
    assert small.mode == "single" and small.chosen.settings.workers == 1
    big = _choose("single_gpu.txt", "--parallel.devices=1")
    rows = _by_mode(big)
    assert big.mode == "pipeline" and not rows["single"].fits and not rows["zero"].fits
    assert "no other mode fits" in big.line()


def test_without_a_gpu_one_device_is_plain_training_and_cpu_workers_compare_the_others(tmp_path: Path) -> None:
    tiny = ("--model.preset=gpt2-tiny", "--parallel.device=cpu", "--data.seq_len=32", "--train.micro_batch_size=2",
            f"--partition.cache_dir={tmp_path}")  # planned here: profiled on this CPU
    one = _choose(None, "--parallel.devices=1", *tiny)
    assert one.mode == "single" and "no GPU" in one.reason
    two = _choose(None, "--parallel.devices=2", *tiny)
    rows = _by_mode(two)
    assert two.mode in ("pipeline", "zero") and not rows["single"].fits and "stand in for GPUs" in rows["single"].note
    other = "zero" if two.mode == "pipeline" else "pipeline"
    assert rows[two.mode].predicted_step_s <= rows[other].predicted_step_s


def test_an_explicit_mode_wins() -> None:
    choice = _choose("dgx_a100_nv12.txt", "--parallel.mode=pipeline", "--parallel.devices=8",
                     "--train.micro_batches=8")
    assert choice.mode == "pipeline" and choice.explicit and choice.line() == "parallel.mode=pipeline"
    assert [c.mode for c in choice.candidates] == ["pipeline"]


def test_auto_asking_for_cuda_without_a_gpu_stops_before_planning() -> None:
    cfg = load_config(OPT13B, ["--parallel.mode=auto", "--parallel.device=cuda"])
    with pytest.raises(NotAvailableError, match="parallel.device=cuda but no CUDA GPU"):
        check_parallel(cfg, Machine.cpu_only())


@pytest.mark.slow
def test_mobius_train_and_plan_print_autos_choice_and_reason(tmp_path: Path, demo_data_cache: Path) -> None:
    import json
    import subprocess
    import sys

    common = [f"--data.cache_dir={demo_data_cache}", f"--partition.cache_dir={tmp_path / 'cache'}",
              "--parallel.mode=auto", "--parallel.devices=2"]
    r = subprocess.run([sys.executable, "-m", "mobius", "train", str(ROOT / "configs" / "demo.yaml"),
                        f"--output.dir={tmp_path / 'run'}", "--train.max_steps=2", "--train.eval_every=0", *common],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    line = next(x for x in r.stderr.splitlines() if x.startswith("parallel.mode=auto chose "))
    mode = line.split()[2]
    assert mode in ("pipeline", "zero") and "runner-up" in line, line
    assert f"mode {mode}: 2 CPU worker process(es)" in r.stderr
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2
    p = mobius(["plan", str(ROOT / "configs" / "demo.yaml"), "--json", *common])
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout)["mode"]["chosen"] == mode  # the plan shown is the plan run


H100 = "NVIDIA H100 80GB HBM3"


def _on_a_local_h100(monkeypatch: pytest.MonkeyPatch, *overrides: str):
    """``mobius train``'s planning on a machine whose one GPU is an H100 (a stand-in: this machine's
    "measured" profile is the H100's datasheet estimate, named as the GPU names itself)."""
    import dataclasses

    from partition import profile as profiles
    from partition.estimate import estimate_units

    measured = []

    def measure(specs, mbs, seq, precision, device, cache_dir, threads, doc_tokens=None):
        measured.append(device)
        prof = estimate_units(specs, mbs, seq, precision, "h100")
        return dataclasses.replace(prof, source="measured", device_name=H100, profile_s=2.5, notes={})
    monkeypatch.setattr(profiles, "_measured_cached", measure)
    monkeypatch.setattr("mobius.app.planning.host_update_rates_in_step", lambda *a, **k: (3e9, 3e9, "measured"))
    monkeypatch.setattr("mobius.app.planning.cpu_update_rate_in_step", lambda *a, **k: (3e9, "measured"))
    cfg = load_config(ROOT / "configs" / "finetune-opt-1.3b.yaml",
                      ["--parallel.mode=pipeline", "--parallel.devices=1", "--partition.gpu_memory_gib=24",
                       "--partition.host_memory_gib=100", *overrides])
    machine = Machine(topology.Topology.synthetic([1], memory_bytes=80 * 2**30, name=H100), 16, local=True)
    return plan_run(cfg, planned_architecture(cfg), machine), measured


def test_a_run_on_a_gpu_plans_with_that_gpu_and_says_when_partition_gpu_names_another(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from mobius.app.planning import profile_line

    choice, measured = _on_a_local_h100(monkeypatch)  # the config names partition.gpu: rtx3090
    prof = choice.chosen.profile
    assert measured and prof.source == "measured" and prof.device_name == H100
    assert profile_line(prof) == (f"measured on {H100} in 2.5 s (partition.gpu=rtx3090 names another GPU than this "
                                  f"machine's {H100}, which is the one planned for; set partition.profile=estimated "
                                  f"to plan for the rtx3090's datasheet)")
    asked, measured = _on_a_local_h100(monkeypatch, "--partition.profile=estimated")  # a datasheet, on purpose
    prof = asked.chosen.profile
    assert not measured and prof.source == "datasheet" and prof.device_name == "rtx3090"
    assert profile_line(prof).endswith("(60% of 71.0 TFLOP/s; partition.profile=estimated)")
    assert asked.chosen.runs.predicted_step_s > 2 * choice.chosen.runs.predicted_step_s  # a 3090 is slower


def test_a_plan_for_another_machine_uses_the_datasheet_and_says_why() -> None:
    from mobius.app.planning import profile_line

    prof = _choose("topo2x2_sys.txt").chosen.profile
    assert prof.source == "datasheet"
    assert profile_line(prof) == ("estimated for rtx3090 from its datasheet (60% of 71.0 TFLOP/s; planned for another "
                                  "machine, whose GPUs are not here to measure)")
