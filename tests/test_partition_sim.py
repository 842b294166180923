"""The discrete-event simulator: sanity, traffic accounting, contention, traces."""

from __future__ import annotations

import json

import pytest

from fixtures.partition.profiles import toy_profile
from partition import Hardware, model_schedule, simulate
from partition.baselines import is_valid
from partition.costs import stage_costs
from partition.pipeline import PipelineShape

GiB = 1 << 30


def _separate(n: int, memory: float = 2 * GiB, link: float = 10e9) -> Hardware:
    return Hardware.uniform(n, int(memory), link, groups=[[g] for g in range(n)])


def _one_per_stage(blocks: int) -> list[int]:
    return [0] + list(range(2, blocks + 1)) + [blocks + 2]


def test_prefetch_hides_uploads_and_no_prefetch_is_slower() -> None:
    prof = toy_profile(blocks=14)
    hw = _separate(4)
    bounds = _one_per_stage(14)
    with_prefetch = simulate(prof, bounds, hw, micro_batches=4)
    without = simulate(prof, bounds, hw, micro_batches=4, prefetch=False)
    assert without.step_s > with_prefetch.step_s * 1.05
    prefetched = [s.fwd_prefetched for s in with_prefetch.stages[4:]]
    assert all(p > 0 for p in prefetched) and all(s.fwd_prefetched == 0 for s in without.stages)


def test_single_gpu_runs_every_stage_in_order_and_keeps_activations_on_the_gpu() -> None:
    prof = toy_profile(blocks=6)
    hw = _separate(1, memory=4 * GiB)
    res = simulate(prof, [0, 3, 6, 8], hw, micro_batches=3)
    compute = sum(u.fwd_s + u.bwd_s for u in prof.units) * 3
    assert res.step_s >= compute
    assert res.bytes_by_kind.get("act", 0.0) == 0.0  # same GPU: nothing crosses a link
    fwd_starts = [s.fwd_start for s in res.stages]
    bwd_starts = [s.bwd_start for s in res.stages]
    assert fwd_starts == sorted(fwd_starts) and bwd_starts == sorted(bwd_starts, reverse=True)
    assert res.peak_bytes[0] <= hw.gpu_memory_bytes


def test_traffic_is_two_half_precision_uploads_plus_one_gradient_download() -> None:
    """With negligible activations, bytes per step = 2 x params + grads, less what stays resident."""
    blocks, N, M = 46, 4, 4
    prof = toy_profile(blocks=blocks, act_bytes=1e3)
    hw = _separate(N, memory=3 * GiB)
    bounds = _one_per_stage(blocks)
    res = simulate(prof, bounds, hw, micro_batches=M, record=False)
    params = prof.param_bytes()
    grads = sum(u.grad_bytes for u in prof.units)
    stages = stage_costs(prof, bounds)
    shape = PipelineShape(len(stages), N, M)
    resident = sum(s.param_bytes for j, s in enumerate(stages) if shape.is_resident(j))
    moved = res.bytes_by_kind["upload"] + res.bytes_by_kind["grad"]
    assert moved == pytest.approx(2 * params + grads - resident, rel=1e-3)
    assert res.total_bytes() == pytest.approx(2 * params + grads, rel=0.1)


def test_simulator_equals_the_mip_timing_model_without_contention_and_activations() -> None:
    prof = toy_profile(blocks=10, act_bytes=1.0)
    hw = _separate(3, memory=1.2 * GiB)
    bounds = [0, 2, 4, 5, 7, 9, 10, 12]
    sim = simulate(prof, bounds, hw, slots=[0, 1, 2], micro_batches=4)
    model = model_schedule(prof, hw, [0, 1, 2], 4, bounds)
    assert sim.step_s == pytest.approx(model.T, rel=1e-6)
    for j, st in enumerate(sim.stages):
        assert st.fwd_start == pytest.approx(model.sf0[j], abs=1e-9)
        assert st.bwd_start == pytest.approx(model.sb0[j], abs=1e-9)


def test_root_complex_contention_slows_concurrent_uploads() -> None:
    prof = toy_profile(blocks=14, fwd_s=0.004)
    bounds = _one_per_stage(14)
    alone = simulate(prof, bounds, Hardware.uniform(4, 2 * GiB, 10e9, groups=[[0], [1], [2], [3]]),
                     micro_batches=4)
    shared = simulate(prof, bounds, Hardware.uniform(4, 2 * GiB, 10e9, groups=[[0, 1, 2, 3]]), micro_batches=4)
    fair = simulate(prof, bounds, Hardware.uniform(4, 2 * GiB, 10e9, groups=[[0, 1, 2, 3]]), micro_batches=4,
                    sharing="fair")
    assert shared.step_s > alone.step_s * 1.1
    assert fair.step_s >= shared.step_s * 0.999  # serving uploads in stage order never loses to equal sharing
    assert sum(shared.rc_h2d_bytes) == pytest.approx(sum(shared.h2d_bytes))


def test_cross_mapping_beats_sequential_mapping_on_a_2x2_box() -> None:
    prof = toy_profile(blocks=14, fwd_s=0.004)
    bounds = _one_per_stage(14)
    hw = Hardware.uniform(4, 2 * GiB, 10e9, groups=[[0, 1], [2, 3]])
    cross = simulate(prof, bounds, hw, slots=[0, 2, 1, 3], micro_batches=4)
    seq = simulate(prof, bounds, hw, slots=[0, 1, 2, 3], micro_batches=4)
    assert cross.step_s < seq.step_s


def test_peer_to_peer_moves_activations_directly() -> None:
    prof = toy_profile(blocks=6, act_bytes=20e6)
    hw = Hardware.uniform(2, 2 * GiB, 10e9, p2p_Bps=20e9)
    res = simulate(prof, [0, 2, 4, 6, 8], hw, micro_batches=2)
    assert sum(res.p2p_bytes) > 0
    host = Hardware.uniform(2, 2 * GiB, 10e9)
    res_host = simulate(prof, [0, 2, 4, 6, 8], host, micro_batches=2)
    assert sum(res_host.p2p_bytes) == 0 and res_host.bytes_by_kind["act"] > res.bytes_by_kind["act"]


def test_peak_memory_stays_within_the_budget_and_counts_prefetch() -> None:
    prof = toy_profile(blocks=10)
    bounds = [0, 2, 4, 6, 8, 10, 12]
    hw = _separate(2, memory=1.3 * GiB)
    assert is_valid(prof, bounds, hw, 2, 2)
    res = simulate(prof, bounds, hw, micro_batches=2)
    assert all(0 < p <= hw.gpu_memory_bytes for p in res.peak_bytes)
    stages = stage_costs(prof, bounds)
    shape = PipelineShape(len(stages), 2, 2)
    biggest_phase = max(max(shape.fwd_peak(s, j), shape.bwd_peak(s, j)) for j, s in enumerate(stages))
    assert max(res.peak_bytes) > biggest_phase  # prefetched bytes and pending gradients are counted too


def test_chrome_trace_is_valid_json_and_ascii_grid_has_a_row_per_gpu(tmp_path) -> None:
    prof = toy_profile(blocks=6)
    res = simulate(prof, [0, 2, 4, 6, 8], _separate(2), micro_batches=2)
    path = tmp_path / "trace.json"
    res.write_chrome_trace(str(path))
    data = json.loads(path.read_text())
    spans = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert spans and all({"ts", "dur", "pid", "tid", "name"} <= set(e) for e in spans)
    assert max(e["ts"] + e["dur"] for e in spans) == pytest.approx(res.step_s * 1e6, rel=1e-6)
    grid = res.to_ascii(80)
    assert "GPU0 compute" in grid and "GPU1 compute" in grid and "CPU adam" in grid
    rows = [line for line in grid.splitlines() if "|" in line]
    assert all(len(line.split("|")[1]) == 80 for line in rows)


def test_simulator_without_prefetch_equals_the_timing_model_without_prefetch() -> None:
    prof = toy_profile(blocks=10, act_bytes=1.0)
    hw = _separate(3, memory=1.2 * GiB)
    bounds = [0, 2, 4, 5, 7, 9, 10, 12]
    sim = simulate(prof, bounds, hw, slots=[0, 1, 2], micro_batches=4, prefetch=False)
    assert sim.step_s == pytest.approx(model_schedule(prof, hw, [0, 1, 2], 4, bounds, prefetch=False).T, rel=1e-6)
