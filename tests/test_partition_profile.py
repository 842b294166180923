"""Unit profiling: measured on the CPU, estimated from the GPU catalogue, cached as JSON."""

from __future__ import annotations

import json

import pytest
import torch

from mobius.app.planning import profile_line
from mobius.errors import ConfigError
from mobius.models import get_preset, unit_specs
from mobius.models.gpt2 import GPT2Config
from partition import ModelProfile, estimate_units, get_profile, lookup_gpu, profile_units
from partition.profile import profile_key
from in_process import mobius


def _small_gpt() -> list:
    cfg = GPT2Config(n_embd=384, n_layer=3, n_head=6, vocab_size=6144, n_positions=256, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    return unit_specs(cfg)


def _fresh_shares() -> list[float]:
    """:func:`_shares` of the small GPT profiled in a new Python process on one thread. A block's many small
    operators on two threads beside another busy process measured 4.5x their share (a thread waits for its
    partner at every operator); one thread times the units alike whatever runs beside it."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import json, sys, torch; torch.set_num_threads(1); sys.path.insert(0, 'tests'); "
            "from test_partition_profile import _small_gpt, _shares; "
            "from partition import profile_units; "
            "print(json.dumps(_shares(profile_units(_small_gpt(), 2, 128, 'fp32', 'cpu', reps=5, warmup=2))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1])
    return json.loads(out.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def measured() -> ModelProfile:
    return profile_units(_small_gpt(), 2, 128, "fp32", "cpu", reps=5, warmup=2)


def _shares(prof: ModelProfile) -> list[float]:
    times = [u.fwd_s + u.bwd_s for u in prof.units]
    return [t / sum(times) for t in times]


def test_identical_units_are_profiled_once(measured: ModelProfile) -> None:
    assert measured.source == "measured" and measured.device_name == "cpu"
    assert measured.notes["distinct_units"] == 3
    blocks = measured.units[1:-1]
    assert len({(u.fwd_s, u.bwd_s, u.saved_bytes) for u in blocks}) == 1
    assert [u.name for u in measured.units] == ["embed", "block.0", "block.1", "block.2", "head"]
    for prev, unit in zip(measured.units, measured.units[1:]):
        assert unit.in_bytes == prev.act_bytes  # a stage boundary's bytes agree on both sides
    assert all(u.fwd_s > 0 for u in measured.units[1:])
    # recompute+backward holds a forward: longer in total (one tiny unit's timing on a loaded machine
    # can dip below its forward's)
    assert sum(u.bwd_s for u in measured.units[1:]) > sum(u.fwd_s for u in measured.units[1:])


def test_a_profiled_unit_is_built_where_it_is_timed_with_weights_as_the_families_set_them() -> None:
    """No unit is initialised on the CPU for a GPU's profile: it is built on the meta device and its weights set
    on the device, in the training dtype -- matrices drawn with std 0.02, biases 0, norm weights 1 (every weight
    drawn at std 0.02 ran a GPT-2 block 11% slower on the CPU)."""
    from partition.measure import _built_on

    for spec in _small_gpt()[:2]:
        unit = _built_on(spec, torch.device("cpu"), torch.bfloat16)
        assert unit.training
        for name, p in unit.named_parameters():
            assert p.dtype == torch.bfloat16 and p.device.type == "cpu" and not p.is_meta, name
            if p.dim() >= 2:
                assert 0.015 < p.float().std() < 0.025, name
            else:
                assert bool((p == (0.0 if name.endswith("bias") else 1.0)).all()), name


def test_a_units_forward_and_backward_are_timed_in_turn() -> None:
    """Forward and backward alternate, warm-up rounds first, so that a slow spell of the machine falls on both
    (the plan weighs their ratio); each gets the median of its own runs."""
    from partition.measure import _time_interleaved

    calls: list[str] = []
    def run(name: str):
        return lambda: calls.append(name)
    fwd, bwd = _time_interleaved([run("f"), run("b")], torch.device("cpu"), 3, 1)
    assert calls == ["f", "b"] * 4 and 0 <= fwd and 0 <= bwd


def test_estimate_matches_measured_proportions_between_units(measured: ModelProfile) -> None:
    """Compute-bound units: the datasheet estimate and a CPU measurement split the time alike --
    within a factor of two, a bound a loaded or slow machine's timings stay inside."""
    cpu_like = {"base": "rtx3090", "fp32_tflops": 0.2, "mem_GBps": 20}
    estimated = estimate_units(_small_gpt(), 2, 128, "fp32", cpu_like)
    assert estimated.source == "datasheet"
    assert [u.param_bytes for u in estimated.units] == [u.param_bytes for u in measured.units]
    est = _shares(estimated)
    ratios = []
    for attempt in range(3):  # timings on a shared machine: a burst of other work can skew one profile, and
        # a process that ran other tests may time differently (its threads), so the retries measure in a fresh one,
        # on one thread (_fresh_shares)
        meas = _shares(measured) if attempt == 0 else _fresh_shares()
        ratios.append((est[-1] / est[1]) / (meas[-1] / meas[1]))  # the head's time against a block's
        if 0.5 < ratios[-1] < 2.0:
            break
    assert 0.5 < ratios[-1] < 2.0, ratios
    block_est, block_meas = estimated.units[1], measured.units[1]
    assert block_est.saved_bytes == pytest.approx(block_meas.saved_bytes, rel=0.3)
    assert block_est.act_bytes == block_meas.act_bytes


def test_estimate_scales_with_the_gpu() -> None:
    specs = unit_specs(get_preset("opt-1.3b"))
    slow = estimate_units(specs, 1, 512, "bf16", "rtx3090")
    fast = estimate_units(specs, 1, 512, "bf16", "h100")
    assert fast.units[1].fwd_s < slow.units[1].fwd_s / 5
    assert slow.units[1].bwd_s == pytest.approx(3 * slow.units[1].fwd_s, rel=0.05)  # recompute + 2x backward
    assert slow.units[1].param_bytes == 2 * specs[1].param_count


def test_measured_profiles_are_cached_by_shape_batch_sequence_precision_and_device(tmp_path) -> None:
    specs = unit_specs(get_preset("gpt2-tiny"))
    first = get_profile(specs, 1, 32, "fp32", "measured", device="cpu", cache_dir=tmp_path)
    files = list((tmp_path / "profiles").glob("*.json"))
    assert len(files) == 1 and files[0].stem == profile_key(specs, 1, 32, "fp32", "cpu")
    again = get_profile(specs, 1, 32, "fp32", "measured", device="cpu", cache_dir=tmp_path)
    assert again.units == first.units and first.profile_s > 0 and again.profile_s == 0  # not measured again
    assert "(cached)" in profile_line(again) and "(cached)" not in profile_line(first)
    get_profile(specs, 2, 32, "fp32", "measured", device="cpu", cache_dir=tmp_path)
    assert len(list((tmp_path / "profiles").glob("*.json"))) == 2
    assert ModelProfile.from_json(json.loads(files[0].read_text())).to_json() == first.to_json()
    other = json.loads(files[0].read_text())  # another version's file: a field it had that this one has not
    other["draw"] = 0
    other["units"][0]["old_field"] = 1.0
    files[0].write_text(json.dumps(other))
    kept = get_profile(specs, 1, 32, "fp32", "measured", device="cpu", cache_dir=tmp_path)
    assert kept.units == first.units and kept.profile_s == 0  # still cached: not measured again


def test_half_precision_profiles_charge_the_fp32_gradient_sums() -> None:
    specs = unit_specs(get_preset("gpt2-tiny"))
    assert all(u.acc_s == 0 for u in estimate_units(specs, 1, 64, "fp32", "rtx3090").units)
    est = estimate_units(specs, 1, 64, "bf16", "rtx3090").units[1]
    assert est.acc_s == pytest.approx(10 * est.param_count / (936e9 * 0.8) + 2 * 8e-6)  # 10 B/param at 80% of 936 GB/s, 2 launches
    measured = profile_units(specs[:2], 1, 16, "bf16", "cpu", reps=2, warmup=1)
    assert measured.units[1].acc_s > 0 and measured.units[0].acc_s > 0


def test_the_cpu_update_rate_is_measured_once_and_cached(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from partition import cpu_rate

    calls = []
    real = cpu_rate.measure_cpu_update
    monkeypatch.setattr(cpu_rate, "measure_cpu_update", lambda t, p, half_grads=False, states="fp32":
                        calls.append((t, p, half_grads)) or real(t, p, 1 << 20, 2, half_grads, states))
    rate = cpu_rate.cpu_update_rate(1, "bf16", tmp_path)
    assert rate > 1e6 and calls == [(1, "bf16", False)]
    assert cpu_rate.cpu_update_rate(1, "bf16", tmp_path) == rate and len(calls) == 1  # from the cache
    cpu_rate.cpu_update_rate(2, "bf16", tmp_path)
    assert len(calls) == 2  # another thread count is another measurement
    assert cpu_rate.cpu_update_rate(1, "bf16", tmp_path, half_grads=True) > 1e6 and calls[-1] == (1, "bf16", True)


def test_estimated_profile_needs_a_gpu_model() -> None:
    specs = unit_specs(get_preset("gpt2-tiny"))
    with pytest.raises(ConfigError, match="partition.gpu"):
        get_profile(specs, 1, 32, "bf16", "estimated")
    with pytest.raises(ConfigError, match="unknown GPU"):
        get_profile(specs, 1, 32, "bf16", "estimated", gpu="voodoo2")
    prof = get_profile(specs, 1, 32, "bf16", "auto", gpu="rtx4090")
    assert prof.source == "datasheet" and prof.device_name == "rtx4090"


def test_catalogue_understands_device_names() -> None:
    assert lookup_gpu("NVIDIA GeForce RTX 3090 Ti").name == "rtx3090ti"
    assert lookup_gpu("NVIDIA GeForce RTX 3090").name == "rtx3090"
    assert lookup_gpu("NVIDIA H100 80GB HBM3").name == "h100"
    assert lookup_gpu("NVIDIA A100-SXM4-80GB").name == "a100-80gb"
    assert lookup_gpu("unknown") is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_13b_shaped_model_profiles_on_one_gpu_in_well_under_a_minute() -> None:
    specs = unit_specs(get_preset("opt-13b"))
    prof = profile_units(specs, 1, 512, "bf16", "cuda")
    assert prof.profile_s < 60 and prof.notes["distinct_units"] == 3
    assert all(u.work_bytes >= 0 and u.fwd_s > 0 for u in prof.units)


# ---- profile files (partition.profile_file, mobius profile) -------------------------------------------
ROUNDPIPE_8B = {"gpu": "rtx4090", "micro_batch_size": 4, "seq_len": 2048, "precision": "bf16",
                "units": {"block": {"forward_ms": 18.5037, "backward_ms": 41.2066},
                          "head": {"forward_ms": 37.2255, "backward_ms": 74.501}}}  # RoundPipe's RTX 4090 times
TOPO8 = "tests/fixtures/topology/topo8_4x4_nic.txt"


def _plan_json(*args: str) -> dict:
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    r = mobius(["plan", *args, "--json"], cwd=root)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout)


def test_a_plan_takes_its_unit_times_from_a_profile_file_and_estimates_the_kinds_it_does_not_name(tmp_path) -> None:
    path = tmp_path / "llama8b-4090.json"
    path.write_text(json.dumps(ROUNDPIPE_8B))
    out = _plan_json("configs/finetune-llama-3.1-8b.yaml", "--topology", TOPO8, "--parallel.devices=8",
                     "--train.micro_batch_size=4", "--train.micro_batches=16", f"--partition.profile_file={path}",
                     "--partition.gpu=rtx4090", "--partition.time_limit_s=1")
    units = {u["kind"]: u for u in out["profile"]["units"]}
    assert units["block"]["count"] == 32
    assert units["block"]["fwd_s"] == pytest.approx(0.0185037) and units["block"]["bwd_s"] == pytest.approx(0.0597103)
    assert units["head"]["fwd_s"] == pytest.approx(0.0372255) and units["head"]["bwd_s"] == pytest.approx(0.1117265)
    estimated = estimate_units(unit_specs(get_preset("llama-3.1-8b")), 4, 2048, "bf16", "rtx4090").units[0]
    assert units["embed"]["fwd_s"] == pytest.approx(estimated.fwd_s)  # not named: the datasheet's
    assert out["profile"]["device"] == "rtx4090" and out["profile"]["notes"]["estimated_kinds"] == ["embed"]
    assert out["profile"]["source"] == out["profile_source"] == "file"
    assert out["predicted_step_s"] > 32 * 16 * (0.0185037 + 0.0597103) / 8  # at least the blocks' work per GPU


@pytest.mark.parametrize("edit,message", [
    ({"units": {"mlp": {"forward_ms": 1, "backward_ms": 2}}}, "units must map some of"),
    ({"units": {"block": {"forward_ms": -1, "backward_ms": 2}}}, "units.block.forward_ms must be a positive number"),
    ({"units": {"block": {"forward_ms": 1}}}, "units.block must hold forward_ms and backward_ms"),
    ({"gpus": "x"}, "unknown key(s) ['gpus']"),
    ({"seq_len": 1024}, "was measured with seq_len 1024, the run has 2048"),
])
def test_a_wrong_profile_file_is_one_line_naming_the_key(tmp_path, edit: dict, message: str) -> None:
    from pathlib import Path

    path = tmp_path / "p.json"
    path.write_text(json.dumps({**ROUNDPIPE_8B, **edit}))
    r = mobius(["plan", "configs/finetune-llama-3.1-8b.yaml", "--topology", TOPO8, "--parallel.devices=8",
                "--train.micro_batch_size=4", "--train.micro_batches=16", f"--partition.profile_file={path}"],
               cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith(f"mobius: error: partition.profile_file "
                                                                              f"{path}")
    assert message in r.stderr and "Traceback" not in r.stderr


def test_mobius_profile_writes_a_file_that_plans_with_the_times_it_measured(tmp_path) -> None:
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out, cache = tmp_path / "demo-cpu.json", f"--partition.cache_dir={tmp_path / 'cache'}"
    r = subprocess.run([sys.executable, "-m", "mobius", "profile", "configs/demo.yaml", "--out", str(out), cache],
                       capture_output=True, text=True, cwd=root)
    assert r.returncode == 0, r.stderr[-2000:]
    written = json.loads(out.read_text())
    assert set(written["units"]) == {"embed", "block", "head"} and written["seq_len"] == 128
    assert written["gpu"].startswith("cpu")
    plan = _plan_json("configs/demo.yaml", "--parallel.mode=pipeline", "--parallel.devices=2", "--parallel.device=cpu",
                      f"--partition.profile_file={out}", cache)
    units = {u["kind"]: u for u in plan["profile"]["units"]}
    for kind, times in written["units"].items():
        assert units[kind]["fwd_s"] * 1e3 == pytest.approx(times["forward_ms"])
        assert (units[kind]["bwd_s"] - units[kind]["fwd_s"]) * 1e3 == pytest.approx(times["backward_ms"], abs=1e-9)
