"""The host and the links as shared resources: workers' CPU updates share the host's rate (planner,
both simulators, the plan's report), zero's host-staged collectives share the PCIe links with
uploads, and the gradient download dtype weighs host memory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mobius import cli
from mobius.layout import build_layout
from mobius.models import get_preset, unit_specs
from mobius.models.params import model_params
from fixtures.partition.profiles import hand_profile
from partition import Hardware, ModelEvaluator, ModelProfile, PipelineOptions, PlanRequest, plan_model, simulate
from partition import cpu_rate
from partition.estimate import estimate_units
from partition.evaluate import rates_for
from partition.hardware import CPU_UPDATE_IN_STEP, PAPER_ADAM_PARAMS_PER_S
from partition.zero.memory import Setting, Workload, ZeroHardware
from partition.zero.step_sim import predict

GiB = 1 << 30
TOPO_2X2 = Path(__file__).parent / "fixtures" / "topology" / "topo2x2_sys.txt"


def test_workers_updating_at_once_share_the_hosts_cpu_rate() -> None:
    """Stages a|b|c on two workers (a and c on worker 0), clipped: after the step's norm worker 0
    updates a (0.5 G) then c (0.25 G), worker 1 updates b (0.25 G), one worker alone at 0.25 G/s. A host
    that does 0.25 G/s in total gives each of two updating workers half: b runs 0-2 s, a at half rate
    until 2 s and then alone (0-3 s), c 3-4 s; unshared they end at 1, 2 and 3 s (the hand-computed
    step of tests/test_partition_sim.py). The step grows by the second a's update takes longer (18 s
    instead of 17); the MIP's timing model, which cannot follow who updates when, gives every worker
    the share of all N at once (19 s)."""
    prof, clipped = hand_profile(), PipelineOptions(barrier=True)
    cpu: dict[str, list[tuple[float, float]]] = {}
    steps, model = {}, {}
    for host in ("unshared", "shared"):
        hw = Hardware.uniform(2, 64 * GiB, 1e9, cpu_adam_params_per_s=0.25e9,
                              host_adam_params_per_s=0.25e9 if host == "shared" else None)
        res = simulate(prof, [0, 1, 2, 3], hw, [0, 1], 2, clipped)
        cpu[host] = sorted((e.name, (round(e.start, 6), round(e.end, 6))) for e in res.events if e.track == "cpu")
        steps[host] = res.step_s
        model[host] = ModelEvaluator(prof, hw, lambda S: [0, 1], 2, options=clipped).step_time([0, 1, 2, 3])
    assert cpu["unshared"] == [("adam0", (0.0, 2.0)), ("adam1", (0.0, 1.0)), ("adam2", (2.0, 3.0))]
    assert cpu["shared"] == [("adam0", (0.0, 3.0)), ("adam1", (0.0, 2.0)), ("adam2", (3.0, 4.0))]
    assert steps == pytest.approx({"unshared": 17.0, "shared": 18.0})
    assert model == pytest.approx({"unshared": 17.0, "shared": 19.0})


def test_a_workers_share_is_its_rate_alone_or_the_hosts_total_over_those_updating() -> None:
    hw = Hardware.uniform(4, 8 * GiB, 10e9, cpu_adam_params_per_s=3e9, host_adam_params_per_s=8e9)
    hw.cpu_adam_half_grads_params_per_s = 1.5e9  # half-precision gradients: half one worker's rate, and the host's
    assert [hw.cpu_update_rate(updating=k) for k in (1, 2, 3, 4)] == pytest.approx([3e9, 3e9, 8e9 / 3, 2e9])
    assert hw.cpu_update_rate(True, updating=4) == pytest.approx(1e9)
    assert hw.host_update_total() == pytest.approx(8e9) and hw.host_update_total(workers=2) == pytest.approx(6e9)
    rates = rates_for(ModelProfile([], 1, 1, "fp16", "x", "datasheet"), hw, [0, 1, 2, 3], 8)
    assert rates.cpu == pytest.approx(2.0)  # G params/s: the MIP plans every worker at the share of all four


def test_a_saved_topology_plans_with_a_stated_host_default() -> None:
    import topology

    hw = Hardware.from_topology(topology.load_topology(str(TOPO_2X2)), gpu="rtx3090")
    assert hw.host_update_total() == pytest.approx(PAPER_ADAM_PARAMS_PER_S * CPU_UPDATE_IN_STEP)  # 2.72 G/s in all
    assert hw.cpu_update_rate(updating=4) == pytest.approx(PAPER_ADAM_PARAMS_PER_S * CPU_UPDATE_IN_STEP / 4)
    assert "partition.cpu_update_rate" in hw.host_sources["cpu"]


def _run_plan(argv: list[str]) -> int:
    parser = cli.build_parser("plan")
    args, extra = parser.parse_known_args(["plan", *argv])
    args.overrides = extra
    return args.func(args)


@pytest.fixture
def tiny_yaml(tmp_path: Path) -> Path:
    f = tmp_path / "tiny.yaml"
    f.write_text("model:\n  preset: gpt2-tiny\ndata:\n  path: x.txt\n  seq_len: 32\ntrain:\n  micro_batches: 4\n"
                 "  precision: bf16\nparallel:\n  mode: pipeline\n  devices: 4\npartition:\n  gpu: rtx3090\n"
                 f"  cache_dir: {tmp_path / 'cache'}\n")
    return f


def test_mobius_plan_prints_the_host_it_assumed(tiny_yaml: Path, capsys: pytest.CaptureFixture) -> None:
    """From a saved topology: the stated default (2.72 G/s in all, 0.68 per worker while all four
    update) and host memory not known; given on the command line: 0.68 x 8 = 5.44 G/s in all, 1.36 per
    worker, 64 GiB available; the JSON carries the same figures."""
    assert _run_plan([str(tiny_yaml), "--topology", str(TOPO_2X2)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("host: "))
    assert "CPU AdamW 2.72 G params/s in total, 0.68 per worker while all 4 update" in line
    assert "set partition.cpu_update_rate" in line and "host memory: " in line and "not known" in line
    argv = [str(tiny_yaml), "--topology", str(TOPO_2X2), "--partition.cpu_update_rate=8",
            "--partition.host_memory_gib=64"]
    assert _run_plan(argv) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("host: "))
    assert "CPU AdamW 5.44 G params/s in total, 1.36 per worker while all 4 update" in line
    assert "partition.cpu_update_rate=8 G params/s x 0.68" in line and "64.0 GiB available" in line
    assert _run_plan(argv + ["--json"]) == 0
    host = json.loads(capsys.readouterr().out)["host"]
    assert host["cpu_total_params_per_s"] == pytest.approx(5.44e9) and host["workers"] == 4
    assert host["memory_bytes"] == 64 * GiB and 0 < host["memory_needed_bytes"] < host["memory_bytes"]


def test_the_hosts_rate_is_measured_with_the_workers_together_and_cached(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Several updates at once on this machine (small buffers: the rate is positive and finite), then
    the planner's figures: 0.68 x the measured rates, cached; a rate a run measured inside its steps
    is each worker's among the others, so the host's total is the workers' count times it."""
    rate = cpu_rate.measure_host_update(2, 1, "bf16", numel=1 << 18, reps=1)
    assert 1e6 < rate < 1e12
    calls: list[tuple] = []
    monkeypatch.setattr(cpu_rate, "measure_cpu_update", lambda t, p, half_grads=False, states="fp32":
                        calls.append(("one", t)) or 2e9)
    monkeypatch.setattr(cpu_rate, "measure_host_update", lambda n, t, p, half_grads=False, states="fp32":
                        calls.append((n, t)) or 3e9)
    alone, total, source = cpu_rate.host_update_rates_in_step(4, 2, "bf16", tmp_path, "cuda")
    assert (alone, total) == pytest.approx((CPU_UPDATE_IN_STEP * 2e9, CPU_UPDATE_IN_STEP * 3e9))
    assert calls == [("one", 2), (4, 2)] and "4 at once" in source
    cpu_rate.host_update_rates_in_step(4, 2, "bf16", tmp_path, "cuda")
    assert len(calls) == 2  # from the cache
    cpu_rate.record_in_step_rate(2, "bf16", tmp_path, "cuda", False, 0.5e9)
    alone, total, source = cpu_rate.host_update_rates_in_step(4, 2, "bf16", tmp_path, "cuda")
    assert (alone, total) == pytest.approx((0.5e9, 2e9)) and "inside training steps" in source


def test_cpu_workers_zero_memory_is_a_streaming_add_measured_here_and_cached(tiny_yaml: Path, tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Zero mode on CPU workers plans its casts and gradient sums at the rate a streaming fp32 add reaches on
    this machine (measured once per thread count, then cached), its collectives at gloo's measured figures,
    and the dispatch thread waiting for its fills and reduce-scatters."""
    from mobius.app.planning import GLOO_Bps, GLOO_COLLECTIVE_S, hardware, zero_hardware
    from mobius.app.settings import Machine, resolve
    from mobius.config import load_config

    assert 1e8 < cpu_rate.measure_host_memory(1, numel=1 << 16, reps=2) < 1e14
    calls: list[int] = []
    monkeypatch.setattr(cpu_rate, "measure_host_memory", lambda threads: calls.append(threads) or 7e9)
    assert cpu_rate.host_memory_rate(2, tmp_path) == cpu_rate.host_memory_rate(2, tmp_path) == 7e9
    assert calls == [2]
    monkeypatch.setattr(cpu_rate, "measure_cpu_update", lambda t, p, half_grads=False, states="fp32": 2e9)
    monkeypatch.setattr(cpu_rate, "measure_host_update", lambda n, t, p, half_grads=False, states="fp32": 3e9)
    cfg = load_config(str(tiny_yaml), ["--parallel.mode=zero", "--parallel.device=cpu", "--parallel.devices=2"])
    machine = Machine.detect(cfg)
    settings = resolve(cfg, machine, "zero", "")
    zhw = zero_hardware(cfg, settings, machine, hardware(cfg, settings, machine))
    assert zhw.device_Bps == 7e9 and calls == [2, settings.cpu_threads]
    assert (zhw.g2g_Bps, zhw.collective_s, zhw.blocking) == (GLOO_Bps, GLOO_COLLECTIVE_S, True)


def _zero_case() -> tuple:
    cfg = get_preset("gpt2")
    prof = estimate_units(unit_specs(cfg), 1, 512, "bf16", "rtx3090")
    layout = build_layout(model_params(cfg), prof.num_units, 20_000_000, 4)
    return prof, layout, Workload(2, "bf16", True, False)


def test_zeros_host_staged_collectives_share_the_links_with_uploads_and_downloads() -> None:
    """Four ranks, every chunk offloaded: each chunk is uploaded, then all-gathered. With P2P (the
    same collective rate) the all-gathers and reduce-scatters run on their own lane, beside the
    uploads and downloads; through host memory they hold the GPU->host and host->GPU links for half
    their time each, so the step is longer by about what the links carry. With every chunk on the GPU
    nothing else crosses the links and the two agree."""
    prof, layout, w = _zero_case()
    rates = dict(ranks=4, memory_bytes=20 * GiB, c2g_Bps=2e9, g2c_Bps=2e9, g2g_Bps=1e9, device_Bps=700e9,
                 cpu_adam_params_per_s=100e9, gpu_adam_params_per_s=25e9)
    peer, staged = ZeroHardware(**rates), ZeroHardware(**rates, host_staged=True)
    offloaded = Setting(layout.min_blocks + 1, 0)
    p, s = predict(layout, prof, peer, offloaded, w), predict(layout, prof, staged, offloaded, w)
    link_s = (p.traffic["h2d_bytes"] / 2e9 + p.traffic["d2h_bytes"] / 2e9)  # the uploads' and downloads' time
    assert s.step_s > p.step_s + 0.5 * link_s and s.traffic == p.traffic
    resident = Setting(layout.num_chunks, layout.num_chunks)
    assert predict(layout, prof, staged, resident, w).step_s == pytest.approx(
        predict(layout, prof, peer, resident, w).step_s)


def _fp32_or_half(host_memory_gib: float | None) -> tuple[str, str]:
    """OPT-125m on two GPUs with fast links (half downloads save about 1%), planned with a given
    partition, every stage swapped: 2.75 GiB of host memory with fp32 downloads, 2.14 GiB with half."""
    prof = estimate_units(unit_specs(get_preset("opt-125m")), 1, 2048, "bf16", "rtx3090")
    hw = Hardware.uniform(2, 20 * GiB, 50e9, groups=[[0], [1]], cpu_adam_params_per_s=4e9)
    hw.host_memory_bytes = None if host_memory_gib is None else int(host_memory_gib * GiB)
    plan = plan_model(prof, hw, PlanRequest(micro_batches=8, boundaries=[0, 7, prof.num_units], resident=[], kept=[],
                                            with_baselines=False))
    return plan.options.grad_dtype, plan.grad_choice


def test_the_gradient_download_dtype_weighs_host_memory() -> None:
    """fp32 downloads cost 4 more host bytes per parameter for the reference's exact numbers: taken
    where the host memory is known to hold them, not where it is unknown unless they are at least 5%
    faster, and never where they do not fit."""
    dtype, why = _fp32_or_half(None)
    assert dtype == "half" and why.startswith("host memory not known: fp32 would take")
    dtype, why = _fp32_or_half(64.0)
    assert dtype == "fp32" and why.startswith("half would save")
    dtype, why = _fp32_or_half(2.4)  # half fits, fp32 does not
    assert dtype == "half" and "fp32 gradient buffers would need 2.7 GiB" in why
