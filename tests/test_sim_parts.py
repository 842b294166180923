"""The simulator's mechanisms one at a time (:mod:`partition.sim`): link and root-complex sharing, the host's
share of its threads, the optimizer threads, gradients once down, a worker's lists, the compute streams' times,
the copies, what is recorded, the timeline, and the loop that drives them (the whole: tests/test_partition_sim.py)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from fixtures.partition.profiles import hand_profile, toy_profile
from partition import Hardware, PipelineOptions, simulate
from partition.costs import stage_costs
from partition.schedule import Kind, build_schedule
from partition.sim.clock import Clock
from partition.sim.event_loop import Simulation, run_schedule
from partition.sim.flows import Links
from partition.sim.host_sharing import Host
from partition.sim.recorder import Recorder
from partition.sim.timeline import SimEvent, ascii_grid, chrome_trace
from partition.sim.worker_lists import Task, Worker

GiB = 1 << 30
HAND = [0, 1, 2, 3]  # a | b | c: worker 0 holds a and c, worker 1 holds b


def _hand(options: PipelineOptions = PipelineOptions(), hw: Hardware | None = None, prof=None) -> Simulation:
    """The hand step of tests/test_partition_sim.py (or ``prof``'s three units), wired and not yet run."""
    prof = prof or hand_profile()
    hw = hw or Hardware.uniform(2, 64 * GiB, 1e9, cpu_adam_params_per_s=0.25e9)
    sched = build_schedule(3, 2, 2, [0, 1, 0], options)
    return Simulation(prof, stage_costs(prof, HAND), hw, [0, 1], sched, "priority", True)


# ---- link and root-complex sharing -----------------------------------------------------------------------
def test_flows_under_one_root_complex_share_it_max_min_fairly() -> None:
    clock = Clock()
    links = Links(Hardware.uniform(2, GiB, 10e9, groups=[[0, 1]], uplink_Bps=10e9), "priority", clock)
    links.h2d(0, "a", "upload", 1e9, (1, 0), lambda t: None)
    links.h2d(1, "b", "upload", 3e9, (1, 0), lambda t: None)
    links.allocate()
    assert [f.rate for f in links.flows] == [5e9, 5e9]
    assert links.ends() == [0.2, 0.6]


def test_priority_serves_the_higher_class_first_and_fair_shares_alike() -> None:
    hw = Hardware.uniform(1, GiB, 10e9)
    for sharing, rates in (("priority", [10e9, 0.0]), ("fair", [5e9, 5e9])):
        links = Links(hw, sharing, Clock())
        links.d2h(0, "act", "act", 1e9, (0,), lambda t: None)
        links.d2h(0, "grad", "grad", 1e9, (2, 0), lambda t: None)
        links.allocate()
        assert [f.rate for f in links.flows] == rates, sharing


def test_a_root_complex_measured_per_stream_count_slows_as_streams_pile_up() -> None:
    hw = Hardware.uniform(2, GiB, 10e9, groups=[[0, 1]])
    hw.rc_h2d_by_streams = [[10e9, 6e9]]
    links = Links(hw, "fair", Clock())
    links.h2d(0, "a", "upload", 1e9, (1,), lambda t: None)
    links.h2d(1, "b", "upload", 1e9, (1,), lambda t: None)
    links.allocate()
    assert [f.rate for f in links.flows] == [3e9, 3e9]


def test_peer_to_peer_flows_take_the_pairs_rate_and_empty_flows_end_at_once() -> None:
    clock = Clock(t=2.0)
    links = Links(Hardware.uniform(2, GiB, 10e9, p2p_Bps=4e9), "priority", clock)
    got: list[float] = []
    links.p2p(0, 1, "a0>1", 1e9, got.append)
    links.h2d(0, "none", "upload", 0, (1,), got.append)
    links.allocate()
    assert links.flows[0].rate == 4e9 and links.flows[0].track == "p2p" and got == [2.0]


def test_a_flow_advanced_to_its_end_completes_counted_then_calls_back() -> None:
    clock = Clock()
    links = Links(Hardware.uniform(1, GiB, 10e9), "priority", clock)
    order: list[str] = []
    links.h2d(0, "a", "upload", 1e9, (1,), lambda t: order.append(f"done at {t}"))
    links.allocate()
    (t_next,) = links.ends()
    links.advance(t_next - clock.t, t_next)
    clock.t = t_next
    links.complete(lambda f: order.append(f"counted {f.label}"))
    assert order == ["counted a", "done at 0.1"] and not links.flows and links.changed


# ---- the host's CPU and memory ---------------------------------------------------------------------------
def test_updates_at_once_share_the_hosts_rate_and_an_update_yields_to_its_workers_sums() -> None:
    hw = Hardware.uniform(3, GiB, 10e9, cpu_adam_params_per_s=2e9, host_adam_params_per_s=3e9)
    clock = Clock(t=1.0)
    host = Host(hw, False, clock, 3)
    host.updating[0].begin((0, 0, False), 1e9, clock.t)
    host.updating[1].begin((0, 1, False), 1e9, clock.t)
    host.share([], [])
    assert [th.rate for th in host.updating[:2]] == [1.5e9, 1.5e9] and host.updating[0].busy == 1.0 + 1 / 1.5
    host.summing[1].begin("sums", 1e9, clock.t)  # worker 1's update pauses; its sums run beside worker 0's update
    host.share([], [])
    assert host.updating[1].rate == 0.0 and host.updating[1].busy == math.inf
    assert host.updating[0].rate == host.summing[1].rate == 1.5e9
    host.advance(0.5)
    assert host.updating[0].left == 1e9 - 0.75e9 and host.updating[1].left == 1e9
    assert sorted(host.ends()) == [1.0 + 1 / 1.5] * 2 + [math.inf]


def test_cpu_workers_compute_and_copies_share_the_hosts_cores() -> None:
    sim = _hand(hw=dataclasses.replace(Hardware.uniform(2, GiB, 1e9), host_cores=1))
    w = sim.workers[0]
    w.running, w.comp_left = (Task(Kind.FORWARD, 0, 0), 0.0, 0.25), 1.0
    sim.links.h2d(1, "b", "upload", 1e9, (1,), lambda t: None)
    sim.links.allocate()
    sim.host.share(sim.workers, sim.links.flows)
    assert w.comp_rate == 0.5 and w.comp_end == 2.0 and w.busy_until == 2.25
    assert sim.links.flows[0].rate == 0.5e9


# ---- the optimizer threads -------------------------------------------------------------------------------
@pytest.mark.parametrize("delayed", [False, True])
def test_an_upload_reads_weights_one_update_older_under_delayed(delayed: bool) -> None:
    updates = _hand(PipelineOptions(delayed=delayed)).updates
    assert updates.weights_ready(0, 0)
    assert not updates.weights_ready(0, 1)
    if delayed:  # one compute copy per stage: the copy taken after the step's last upload, not the update
        updates.version[0] = 1
        assert not updates.weights_ready(0, 1) and updates.reading_gradients(0, 2)
        updates.copied[0] = 1
    else:
        updates.version[0] = 1
    assert updates.weights_ready(0, 1)


def test_a_compute_copy_goes_ahead_of_the_queued_updates_once_its_stage_has_updated() -> None:
    sim = _hand(PipelineOptions(delayed=True))
    updates = sim.updates
    updates.queue[0] = [(0, 2)]
    updates.copies[0] = [(1, 0)]  # stage 0's copy of step 1: waits for its update of step 0
    assert updates.start({}) and sim.host.updating[0].running == (0, 2, False)
    sim.host.updating[0].end()
    updates.version[0] = 1
    assert updates.start({}) and sim.host.updating[0].running == (1, 0, True)
    assert sim.host.updating[0].left == updates.costs[0].trainable_count * updates.copy_work


def test_an_update_that_ends_counts_its_stage_and_lets_a_held_upload_look_again() -> None:
    sim = _hand()
    sim.host.updating[1].begin((0, 1, False), 1.0, 0.0)
    sim.host.updating[1].busy = 0.0
    sim.updates.complete(1)
    assert sim.updates.version == [0, 1, 0] and sim.clock.unheld == 1 and sim.host.updating[1].running is None
    assert [(e.name, e.track) for e in sim.recorder.events] == [("adam1", "cpu")]


# ---- gradients once down ---------------------------------------------------------------------------------
def test_a_stages_last_download_queues_its_update_and_both_tied_ends_down_are_summed() -> None:
    sim = _hand()
    sums = sim.sums
    sums.grad_down(1, Task(Kind.DOWNLOAD, 1), 4.0)
    assert sums.downloaded == {(0, 1): 4.0} and sim.updates.queue[1] == [(0, 1)]
    tied = dataclasses.replace(hand_profile(), tied_params=1000)
    sched = build_schedule(3, 2, 2, [0, 1, 1], PipelineOptions(), tied=True)
    sim = Simulation(tied, stage_costs(tied, HAND), Hardware.uniform(2, GiB, 1e9), [0, 1], sched, "priority", True)
    sim.sums.summed(0, Task(Kind.DOWNLOAD, 0), 3.0)
    sim.sums.summed(1, Task(Kind.DOWNLOAD, 2), 5.0)
    assert sim.updates.queue == [[], []]  # the tied ends wait for their sum
    assert sim.sums.start_tie() and sim.sums.tie_at == {0: 5.0 + sim.sums.tie_s}
    assert sim.updates.queue == [[(0, 0)], [(0, 2)]] and not sim.sums.tie_done(0)


# ---- a worker's lists ------------------------------------------------------------------------------------
def test_a_workers_list_splits_per_engine_and_counts_the_messages_each_compute_posts() -> None:
    sched = build_schedule(3, 2, 2, [0, 1, 0], PipelineOptions())
    w0, w1 = Worker(0, 0, sched), Worker(1, 1, sched)
    assert [(t.kind, t.stage, t.micro) for t in w0.lists.compute] == [
        (Kind.FORWARD, 0, 0), (Kind.FORWARD, 0, 1), (Kind.FB, 2, 0), (Kind.FB, 2, 1),
        (Kind.BACKWARD, 0, 0), (Kind.BACKWARD, 0, 1)]
    assert [(t.stage, t.phase) for t in w0.lists.uploads] == [(0, "f"), (2, "f"), (0, "b")]
    assert [(t.kind, t.stage) for t in w0.lists.d2h] == [(Kind.DOWNLOAD, 2), (Kind.DOWNLOAD, 0)]
    assert w0.lists.updates_of(0) == [2, 0] and w1.lists.updates_of(0) == [1]
    assert w0.lists.posts == [1, 2, 2, 2, 1, 0]  # each compute's send, and the next one's receive


# ---- the compute streams ---------------------------------------------------------------------------------
def test_each_compute_takes_its_stages_time_and_a_draw_scales_it_the_same_every_time() -> None:
    sim = _hand(PipelineOptions(kept=frozenset({0})))
    times, costs = sim.compute.times, sim.costs
    assert times.duration(Task(Kind.FORWARD, 0, 0), 0, 0) == costs[0].fwd_s
    assert times.duration(Task(Kind.FB, 2, 0), 0, 0) == costs[2].bwd_s + costs[2].acc_s
    assert times.duration(Task(Kind.BACKWARD, 0, 0), 0, 0) == costs[0].bwd_s + costs[0].acc_s - costs[0].fwd_s
    spread = dataclasses.replace(hand_profile(), worker_spread=0.2, compute_spread=0.1)
    drawn = [Simulation(spread, costs, sim.hw, [0, 1], sim.sched, "priority", False, draw=3).compute.times
             for _ in range(2)]
    task = Task(Kind.FORWARD, 0, 1)
    assert drawn[0].duration(task, 0, 4) == drawn[1].duration(task, 0, 4) != costs[0].fwd_s


# ---- the copies ------------------------------------------------------------------------------------------
def test_an_activation_arrives_in_place_on_one_worker_and_by_two_hops_between_two() -> None:
    sim = _hand(prof=toy_profile(blocks=1))
    sim.transfers.send(sim.workers[0], 0, 1, 0, backward=False)  # stage 1 is worker 1's: through host memory
    assert [(f.label, f.track) for f in sim.links.flows] == [("a0>1.0", "d2h")] and sim.workers[0].pending_sends == 1
    sim.links.flows[0].on_done(1.0)
    assert [(f.label, f.track) for f in sim.links.flows] == [("a0>1.0", "d2h"), ("a0>1.0", "h2d")]
    sim.clock.t = 2.0
    sim.transfers.send(sim.workers[0], 1, 0, 1, backward=True)  # stage 0 is worker 0's own: in place, at once
    assert sim.transfers.arrived == {("g", 0, 1): 2.0}


def test_an_upload_waits_for_its_weights_and_is_not_looked_at_again_until_something_changes() -> None:
    sim = _hand()
    w = sim.workers[0]
    sim.clock.step = 1  # step 1's first upload reads stage 0's weights, which its update of step 0 writes
    assert not sim.transfers.start_upload(w) and w.upload_held == (0, 0)
    sim.updates.version[0] = 1
    assert not sim.transfers.start_upload(w)  # (nothing counted as changed)
    sim.clock.unheld += 1
    assert sim.transfers.start_upload(w) and w.uploading and sim.links.flows[0].label == "Uf0"


# ---- what is recorded, and the timeline ------------------------------------------------------------------
def test_a_finished_flow_counts_its_bytes_per_link_root_complex_and_kind() -> None:
    clock = Clock(t=2.5, step_start=2.0)
    hw = Hardware.uniform(2, GiB, 1e9, groups=[[0, 1]])
    rec = Recorder(hw, 1, True, clock)
    links = Links(hw, "priority", clock)
    links.d2h(1, "G0", "grad", 5e8, (2, 0), lambda t: None)
    clock.t = 3.0
    rec.flow_done(links.flows[0])
    assert rec.bytes["d2h"] == [0.0, 5e8] and rec.bytes["rc_d2h"] == [5e8] and rec.by_kind == {"grad": 5e8}
    assert rec.events == [SimEvent(1, "d2h", "G0", 0.5, 1.0, "grad", 5e8)]  # from the step's start
    silent = Recorder(hw, 1, False, clock)
    silent.flow_done(links.flows[0])
    assert silent.events == [] and silent.by_kind == {"grad": 5e8}


def test_the_timeline_draws_stages_links_and_the_cpu_and_writes_a_chrome_trace() -> None:
    events = [SimEvent(0, "compute", "F1.0", 0.0, 1.0, "fwd"), SimEvent(0, "compute", "B1.0", 1.0, 2.0, "bwd"),
              SimEvent(0, "h2d", "Uf1", 0.0, 0.5, "upload", 1.0), SimEvent(-1, "cpu", "adam1", 2.0, 4.0, "adam")]
    grid = ascii_grid(events, 4.0, 8).splitlines()
    assert grid[:3] == ["GPU0 compute|bbBB    |", "     h2d    |>       |", "CPU adam    |    1111|"]
    trace = chrome_trace(events, ["rtx3090"], 4.0)
    names = [e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"]
    assert names == ["CPU", "GPU 0 (rtx3090)"] and trace["otherData"]["step_s"] == 4.0
    assert [e["tid"] for e in trace["traceEvents"] if e["ph"] == "X"] == [0, 0, 1, 4]


# ---- the loop --------------------------------------------------------------------------------------------
def test_the_loop_runs_the_hand_step_as_simulate_does_and_reports_the_memory_models_peaks() -> None:
    prof, hw = hand_profile(), Hardware.uniform(2, 64 * GiB, 1e9, cpu_adam_params_per_s=0.25e9)
    sched = build_schedule(3, 2, 2, [0, 1, 0], PipelineOptions())
    res = run_schedule(prof, stage_costs(prof, HAND), hw, [0, 1], sched, "priority", True, -1, 3)
    assert res.step_ends == pytest.approx([17.0, 34.0, 51.0])
    assert res == simulate(prof, HAND, hw, [0, 1], 2)
    assert all(p > 0 for p in res.peak_bytes)


def test_a_stall_says_when_and_in_which_step() -> None:
    sim = _hand()
    sim.workers[1].lists.compute.append(Task(Kind.BACKWARD, 1, 5))  # a gradient that never comes
    with pytest.raises(AssertionError, match="simulation stalled at .* s in step 0"):
        sim.run(1)


def test_toy_pipeline_moves_the_same_bytes_as_its_parts_count() -> None:
    """The recorder's totals are the flows' bytes: every upload, activation and download once."""
    prof = toy_profile(blocks=6)
    res = simulate(prof, [0, 2, 4, 6, 8], Hardware.uniform(2, 8 * GiB, 10e9), micro_batches=2)
    assert res.total_bytes() == pytest.approx(sum(e.nbytes for e in res.events if e.track != "cpu"))
