"""The simulator of the runtime's action lists: a timeline computed by hand, agreement with the
timing model, traffic accounting, contention, memory, traces."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from fixtures.partition.profiles import hand_profile, random_profile, toy_profile
from partition import Hardware, ModelEvaluator, PipelineOptions, simulate
from partition.evaluate import tie_seconds
from partition.baselines import is_valid
from partition.costs import TIE_SUM_BYTES, UPDATE_BYTES, stage_costs
from partition.roundrobin_plan import simulate_round_robin
from partition.schedule.roundrobin_actions import Cuts

GiB = 1 << 30


def _separate(n: int, memory: float = 4 * GiB, link: float = 10e9) -> Hardware:
    return Hardware.uniform(n, int(memory), link, groups=[[g] for g in range(n)])


def _one_per_stage(blocks: int) -> list[int]:
    return [0] + list(range(2, blocks + 1)) + [blocks + 2]


def test_a_step_computed_by_hand() -> None:
    """Stages a|b|c on two workers (c: the last stage, forward+loss+backward in one 3 s action, no
    recompute), two micro-batches, 1 GB/s links, fp32 gradient downloads (4 bytes per parameter), CPU
    AdamW at 0.25 G params/s, two device slots. Worker 0 holds a and c, worker 1 holds b.

    Step 1: a uploads 0-1, c 1-1.5, b 0-0.5. a's forward 1-2, 2-3; b's 2-3, 3-4; c's FB 3-6, 6-9, its
    gradients down 9-10. a's backward upload waits for a's forward to free its slot: 3-4. b's backward
    6-8, 9-11, down 11-12; a's backward 9-11, 11-13, down 13-15 (after c's). Without clipping the
    updates follow the downloads: c 10-11, b 12-13, a 15-17: the step takes 17 s. With clipping every
    update waits for the step's norm (15 s), then runs a, c (worker 0) and b (worker 1); the next
    step's uploads wait for them (a at 2, c at 3, b at 1 s into the step), which delays everything
    by 2 s: 17 s per step in the steady state, 15 s for the first step."""
    prof, hw = hand_profile(), Hardware.uniform(2, 64 * GiB, 1e9, cpu_adam_params_per_s=0.25e9)
    immediate = simulate(prof, [0, 1, 2, 3], hw, [0, 1], 2)
    assert immediate.step_ends == pytest.approx([17.0, 34.0, 51.0])
    st = immediate.stages
    assert (st[0].fwd_start, st[1].fwd_start, st[2].fwd_start) == pytest.approx((1.0, 2.0, 3.0))
    assert (st[2].bwd_end, st[1].bwd_start, st[1].bwd_end, st[0].bwd_start, st[0].bwd_end) == \
        pytest.approx((9.0, 6.0, 11.0, 9.0, 13.0))
    clipped = simulate(prof, [0, 1, 2, 3], hw, [0, 1], 2, PipelineOptions(barrier=True))
    assert clipped.step_ends == pytest.approx([15.0, 32.0, 49.0]) and clipped.step_s == pytest.approx(17.0)
    assert clipped.stages[0].fwd_start == pytest.approx(3.0)  # waits for its update (2 s), then uploads (1 s)
    for options in (PipelineOptions(), PipelineOptions(barrier=True)):  # the timing model says the same
        assert ModelEvaluator(prof, hw, lambda S: [0, 1], 2, options=options).step_time([0, 1, 2, 3]) == \
            pytest.approx(17.0)


def test_a_delayed_update_after_the_norm_leaves_the_next_step_alone_by_hand() -> None:
    """The hand step above with clipping and train.update=delayed. A stage's compute copy takes its master on its
    worker's CPU once the step's last upload of the stage has read it and the stage's earlier updates have run, ahead
    of every waiting update: 6 bytes a parameter (fp16) against the update's 30, so 0.2 s for c and b and 0.4 s for
    a. The updates after the norm (each step's start) go in the order of the downloads (worker 0: c 0-1, a 1-3;
    worker 1: b 0-1); the copies follow b's upload once b's update is done (1-1.2), c's upload (1.5; worker 0 is
    busy with a's update until 3: 3-3.2) and a's backward upload (4-4.4). The next step's uploads wait for none of
    them: every step takes 15 s, the sync step's 17 less the wait for its updates (when the copies were queued at the
    downloads, a's next upload waited 0.4 s for its copy: 15.4 s). With a CPU five times slower the copies take 1 and
    2 s and the updates 5 and 10 s (worker 0: c 0-5, its copy 5-6, a 6-16, a's copy 16-18): a's next download waits
    for its update, and a step takes 18 s (19 with the copies at the downloads)."""
    prof = hand_profile()
    options = PipelineOptions(barrier=True, delayed=True)
    hidden = simulate(prof, [0, 1, 2, 3], Hardware.uniform(2, 64 * GiB, 1e9, cpu_adam_params_per_s=0.25e9), [0, 1],
                      2, options, steps=4)
    assert hidden.step_ends == pytest.approx([15.0, 30.0, 45.0, 60.0])
    assert [s.fwd_start for s in hidden.stages] == pytest.approx([1.0, 2.0, 3.0])  # no upload waits for a copy
    cpu = sorted((round(e.start, 6), round(e.end, 6), e.name) for e in hidden.events if e.track == "cpu")
    assert cpu == [(0.0, 1.0, "adam1"), (0.0, 1.0, "adam2"), (1.0, 1.2, "copy1"), (1.0, 3.0, "adam0"),
                   (3.0, 3.2, "copy2"), (4.0, 4.4, "copy0")]
    slow = simulate(prof, [0, 1, 2, 3], Hardware.uniform(2, 64 * GiB, 1e9, cpu_adam_params_per_s=0.05e9), [0, 1],
                    2, options, steps=4)
    assert slow.step_ends == pytest.approx([15.0, 33.0, 51.0, 69.0])


def test_links_too_fast_to_move_the_clock_still_finish_their_flows() -> None:
    """A transfer's last bytes at 1e15 B/s take less than the clock's resolution at t ~ 17 s: they are
    done, not a loop that cannot advance (it hung the planner with near-infinite links)."""
    prof = hand_profile()
    fast = Hardware.uniform(2, 64 * GiB, 1e15, cpu_adam_params_per_s=0.25e9)
    res = simulate(prof, [0, 1, 2, 3], fast, [0, 1], 2, steps=6)
    assert res.step_s == pytest.approx(14.0, abs=1e-5)  # the hand step's 17 s less a's upload (1 s) and download (2 s)


def test_two_slots_hide_uploads_and_one_slot_is_slower() -> None:
    prof = toy_profile(blocks=14)
    hw = _separate(4)
    bounds = _one_per_stage(14)
    two = simulate(prof, bounds, hw, micro_batches=4)
    one = simulate(prof, bounds, hw, micro_batches=4, options=PipelineOptions(num_slots=1))
    assert one.step_s > two.step_s * 1.05
    assert sum(s.upload_wait_s for s in one.stages) > sum(s.upload_wait_s for s in two.stages)


def test_a_prefetch_buffer_hides_part_of_each_upload_as_the_model_says() -> None:
    """Partial prefetch (one slot and a buffer): the larger the buffer, the shorter the step (not as
    short as two slots even with a whole stage's worth: the slot also holds the gradients, which go
    down before the next stage computes in it); the bytes moved stay the same, the buffer counts in
    the peak memory, and the timing model predicts each step."""
    prof = toy_profile(blocks=14)
    hw = _separate(4)
    bounds = _one_per_stage(14)
    stage = max(c.param_bytes for c in stage_costs(prof, bounds))
    steps, peaks, moved = [], [], []
    for size in (0, stage // 4, stage // 2, stage):
        options = PipelineOptions(num_slots=1, prefetch_bytes=int(size))
        res = simulate(prof, bounds, hw, micro_batches=4, options=options)
        model = ModelEvaluator(prof, hw, lambda S: [0, 1, 2, 3], 4, options=options).step_time(bounds)
        assert model == pytest.approx(res.step_s, rel=0.03), size
        steps.append(res.step_s)
        peaks.append(max(res.peak_bytes))
        moved.append(res.bytes_by_kind["upload"])
    two = simulate(prof, bounds, hw, micro_batches=4).step_s
    assert steps[0] > steps[1] > steps[2] > steps[3] > two, (steps, two)  # (one slot: a backward's gradients
    # leave the slot before the next stage may compute in it; two slots overlap that download too)
    assert moved == pytest.approx([moved[0]] * 4, rel=1e-12)
    assert [b - peaks[0] for b in peaks] == pytest.approx([0, stage // 4, stage // 2, stage], rel=1e-6)


def test_single_gpu_runs_every_stage_in_order_and_keeps_activations_on_the_gpu() -> None:
    prof = toy_profile(blocks=6)
    hw = _separate(1, memory=8 * GiB)
    res = simulate(prof, [0, 3, 6, 8], hw, micro_batches=3)
    costs = stage_costs(prof, [0, 3, 6, 8])
    compute = 3 * (sum(c.fwd_s + c.bwd_s for c in costs[:-1]) + costs[-1].bwd_s)  # the last stage: FB only
    assert res.step_s >= compute
    assert res.bytes_by_kind.get("act", 0.0) == 0.0  # same GPU: nothing crosses a link
    fwd_starts = [s.fwd_start for s in res.stages]
    bwd_starts = [s.bwd_start for s in res.stages[:-1]]
    assert fwd_starts == sorted(fwd_starts) and bwd_starts == sorted(bwd_starts, reverse=True)
    assert res.peak_bytes[0] <= hw.gpu_memory_bytes


@pytest.mark.parametrize("offload", [False, True])
def test_traffic_is_two_uploads_plus_fp32_gradients_less_the_resident_stages(offload: bool) -> None:
    """Bytes per step = every stage's parameters up for its forward, again for its backward unless
    it stays resident (plus, with offloaded inputs, M of them going down and coming back), and fp32
    gradient sums down."""
    blocks, N, M = 22, 4, 4
    prof = toy_profile(blocks=blocks, act_bytes=1e6)
    bounds = _one_per_stage(blocks)
    res = simulate(prof, bounds, _separate(N, memory=8 * GiB), micro_batches=M, record=False,
                   options=PipelineOptions(offload_inputs=offload))
    stages = stage_costs(prof, bounds)
    S = len(stages)
    resident = sum(s.param_bytes for j, s in enumerate(stages) if j + N >= S)
    uploads = 2 * prof.param_bytes() - resident
    offloaded = [s for j, s in enumerate(stages) if j + N < S and j > 0] if offload else []
    uploads += sum(M * s.in_bytes for s in offloaded)
    assert res.bytes_by_kind["upload"] == pytest.approx(uploads, rel=1e-9)
    assert res.bytes_by_kind["grad"] == pytest.approx(4 * prof.param_count(), rel=1e-9)
    assert res.bytes_by_kind.get("ckpt", 0.0) == pytest.approx(sum(M * s.in_bytes for s in offloaded), rel=1e-9)


def test_root_complex_contention_slows_concurrent_uploads() -> None:
    prof = toy_profile(blocks=14, fwd_s=0.004)
    bounds = _one_per_stage(14)
    alone = simulate(prof, bounds, Hardware.uniform(4, 4 * GiB, 10e9, groups=[[0], [1], [2], [3]]),
                     micro_batches=4)
    shared = simulate(prof, bounds, Hardware.uniform(4, 4 * GiB, 10e9, groups=[[0, 1, 2, 3]]), micro_batches=4)
    fair = simulate(prof, bounds, Hardware.uniform(4, 4 * GiB, 10e9, groups=[[0, 1, 2, 3]]), micro_batches=4,
                    sharing="fair")
    assert shared.step_s > alone.step_s * 1.1
    assert fair.step_s >= shared.step_s * 0.999  # serving uploads in stage order never loses to equal sharing
    assert sum(shared.rc_h2d_bytes) == pytest.approx(sum(shared.h2d_bytes))


def test_measured_rates_per_stream_count_shape_the_contention() -> None:
    """A root complex whose aggregate rate falls as streams pile up (as `mobius topo --bench`
    measures it) makes concurrent uploads slower than one link's worth shared."""
    prof = toy_profile(blocks=14, fwd_s=0.004)
    bounds = _one_per_stage(14)
    flat = Hardware.uniform(4, 4 * GiB, 10e9, groups=[[0, 1, 2, 3]])
    falling = Hardware.uniform(4, 4 * GiB, 10e9, groups=[[0, 1, 2, 3]])
    falling.rc_h2d_by_streams = [[10e9, 8e9, 7e9, 6e9]]
    falling.rc_d2h_by_streams = [[10e9, 8e9, 7e9, 6e9]]
    assert falling.uncontended_h2d(0) == 10e9 and falling.shared_h2d(0) == 6e9 / 4
    fair = simulate(prof, bounds, flat, micro_batches=4, sharing="fair").step_s
    assert simulate(prof, bounds, falling, micro_batches=4, sharing="fair").step_s > fair


def test_peer_to_peer_moves_activations_directly() -> None:
    prof = toy_profile(blocks=6, act_bytes=20e6)
    hw = Hardware.uniform(2, 4 * GiB, 10e9, p2p_Bps=20e9)
    res = simulate(prof, [0, 2, 4, 6, 8], hw, micro_batches=2)
    assert sum(res.p2p_bytes) > 0
    host = Hardware.uniform(2, 4 * GiB, 10e9)
    res_host = simulate(prof, [0, 2, 4, 6, 8], host, micro_batches=2)
    assert sum(res_host.p2p_bytes) == 0 and res_host.bytes_by_kind["act"] > res.bytes_by_kind["act"]


def test_a_tied_weight_is_exchanged_across_workers_and_its_ends_update_last() -> None:
    """The two ends of a tied weight on two workers sum their gradients on the host after an exchange through
    host memory; on one worker stage 0's backward upload brings the head's end's gradient (4 bytes a parameter
    more) and its download is the sum. Either way both ends update after the last backward; on one worker the
    embedding's store updates the weight for both, so the head stage's CPU update leaves it out. The model
    agrees."""
    prof = toy_profile(blocks=6)
    hw = _separate(2, memory=8 * GiB)
    split, same = [0, 2, 4, 6, 8], [0, 2, 4, 8]  # stages 0 and 3 on two workers; stages 0 and 2 on one
    untied = simulate(prof, split, hw, micro_batches=2).step_s
    untied_uploads = simulate(prof, same, hw, micro_batches=2).bytes_by_kind["upload"]
    prof.tied_params = prof.units[-1].param_count  # the head's weight is the embedding's
    ends_on_one = simulate(prof, same, hw, micro_batches=2)
    assert ends_on_one.bytes_by_kind["upload"] == pytest.approx(untied_uploads + 4 * prof.tied_params)
    exchange = 4 * prof.tied_params / hw.host_copy_Bps
    assert simulate(prof, split, hw, micro_batches=2).step_s >= untied + exchange
    rate = hw.cpu_update_rate()
    for bounds, held in ((split, 0), (same, prof.tied_params)):
        res = simulate(prof, bounds, hw, micro_batches=2)
        adam = {e.name: e.end - e.start for e in res.events if e.track == "cpu"}
        costs = stage_costs(prof, bounds)
        S = len(costs)
        assert adam[f"adam{S - 1}"] == pytest.approx((costs[-1].trainable_count - held) / rate)
        assert adam["adam0"] == pytest.approx(costs[0].trainable_count / rate)
        model = ModelEvaluator(prof, hw, lambda S: [0, 1], 2).step_time(bounds)
        assert res.step_s == pytest.approx(model, rel=1e-3)  # activations share links
    summed = prof.tied_params * TIE_SUM_BYTES / UPDATE_BYTES / rate  # on the host, after the exchange
    assert tie_seconds(prof, hw) == pytest.approx(exchange + summed)


def test_peak_memory_is_the_memory_model_and_stays_within_the_budget() -> None:
    prof = toy_profile(blocks=10)
    bounds = [0, 2, 4, 6, 8, 10, 12]
    hw = _separate(2, memory=8 * GiB)
    assert is_valid(prof, bounds, hw, 2, 2)
    res = simulate(prof, bounds, hw, micro_batches=2)
    assert all(0 < p <= hw.gpu_memory_bytes for p in res.peak_bytes)
    tight = _separate(2, memory=max(res.peak_bytes) - 1)
    assert not is_valid(prof, bounds, tight, 2, 2)


def test_chrome_trace_is_valid_json_and_ascii_grid_has_a_row_per_gpu(tmp_path) -> None:
    prof = toy_profile(blocks=6)
    res = simulate(prof, [0, 2, 4, 6, 8], _separate(2), micro_batches=2)
    path = tmp_path / "trace.json"
    res.write_chrome_trace(str(path))
    data = json.loads(path.read_text())
    spans = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert spans and all({"ts", "dur", "pid", "tid", "name"} <= set(e) for e in spans)
    compute = [e for e in spans if e["tid"] == 0]
    assert max(e["ts"] + e["dur"] for e in compute) <= res.step_s * 1e6 * (1 + 1e-9)
    grid = res.to_ascii(80)
    assert "GPU0 compute" in grid and "GPU1 compute" in grid and "CPU adam" in grid
    rows = [line for line in grid.splitlines() if "|" in line]
    assert all(len(line.split("|")[1]) == 80 for line in rows)


def test_cpu_workers_compute_shares_the_hosts_cores_with_copies_and_updates_by_hand() -> None:
    """One CPU worker on one core, the hand profile in two stages (a | b c), one micro-batch, two slots, 1 GB/s
    copies, AdamW at 0.25 G params/s. Each copy and CPU update is a thread of the worker that wants the core too:
    while two threads want it, the compute and the copy each get half (the update keeps the rate it is measured at
    inside steps). a's forward (1 s) and b c's upload (1 GB) share 1-3; a's backward upload and b c's forward and
    backward (5 s) share 3-5, which then ends alone at 9; a's backward (2 s) and b c's gradient download (2 GB) share
    9-13; a's download (2 GB) shares 13-15 with b c's update (13-15) and ends alone at 16; a's update ends the step at
    18 s instead of 13. With two cores nothing waits for a core: the step of a GPU (13 s)."""
    prof = hand_profile()
    gpu = Hardware.uniform(1, 64 * GiB, 1e9, cpu_adam_params_per_s=0.25e9)
    spans = {}
    for cores in (0, 1, 2):
        res = simulate(prof, [0, 1, 3], dataclasses.replace(gpu, host_cores=cores), [0], 1)
        spans[cores] = sorted((e.start, e.end, e.name) for e in res.events if e.track != "dispatch")
        assert res.step_s == pytest.approx(18.0 if cores == 1 else 13.0)
    assert spans[0] == spans[2] == [(0.0, 1.0, "Uf0"), (1.0, 2.0, "F0.0"), (1.0, 2.0, "Uf1"), (2.0, 3.0, "Ub0"),
                                    (2.0, 7.0, "FB1.0"), (7.0, 9.0, "B0.0"), (7.0, 9.0, "G1"), (9.0, 11.0, "G0"),
                                    (9.0, 11.0, "adam1"), (11.0, 13.0, "adam0")]
    assert spans[1] == [(0.0, 1.0, "Uf0"), (1.0, 3.0, "F0.0"), (1.0, 3.0, "Uf1"), (3.0, 5.0, "Ub0"), (3.0, 9.0, "FB1.0"),
                        (9.0, 13.0, "B0.0"), (9.0, 13.0, "G1"), (13.0, 15.0, "adam1"), (13.0, 16.0, "G0"),
                        (16.0, 18.0, "adam0")]


@pytest.mark.parametrize("seed", range(4))
def test_cores_enough_for_every_thread_leave_the_simulation_as_a_gpus(seed: int) -> None:
    """With a core for every thread that can run at once, CPU workers' steps are the GPU's to the last bit of
    rounding, in the swapped pipeline and the round-robin, sync and delayed."""
    rng = random.Random(seed)
    prof = random_profile(rng, 8, identical=False)
    gpu = _separate(2, memory=16 * GiB)
    cpu = dataclasses.replace(gpu, host_cores=64, worker_threads=2)
    for options in (PipelineOptions(), PipelineOptions(barrier=True, delayed=True)):
        a = simulate(prof, [0, 2, 4, 6, 8], gpu, micro_batches=4, options=options)
        b = simulate(prof, [0, 2, 4, 6, 8], cpu, micro_batches=4, options=options)
        assert b.step_ends == pytest.approx(a.step_ends, rel=1e-12)
        cuts = Cuts((0, 4, 7), (0, 3, 5, 7), prof.num_units)
        a = simulate_round_robin(prof, cuts, gpu, [0, 1], 4, options)
        b = simulate_round_robin(prof, cuts, cpu, [0, 1], 4, options)
        assert b.step_ends == pytest.approx(a.step_ends, rel=1e-12)
