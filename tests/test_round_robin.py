"""The round-robin schedule family (RoundPipe's class): literal lists, invariants, its simulation by the
pipeline's simulator, the exact minimax cuts and the planner's comparison."""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

import pytest

from partition.costs import ModelProfile, UnitCost, tie_copy_work
from partition.hardware import Hardware
from partition.roundrobin_plan import (candidate_shapes, minimax_cuts, neighbours, parts_for, round_robin_peaks, search_cuts,
                                  shape_cuts, simulate_round_robin)
from partition.schedule import COMPUTE, Kind, PipelineOptions, ScheduleError
from partition.schedule.roundrobin_actions import Cuts, build_round_robin, round_robin_timeline
from in_process import mobius

ROOT = Path(__file__).resolve().parents[1]


def _lists(s) -> list[str]:
    return [" ".join(str(a) for a in acts) for acts in s.actions]


def test_literal_round_robin_lists_two_workers() -> None:
    """Units [0, 3): one forward op (units 0-1, keeping unit 1's input), the fused op (unit 2), two backward ops
    (unit 1, then unit 0); 2 workers, 2 micro-batches: one round of K=4 ops, op k on worker k mod 2. Each
    worker uploads its next op while the current one computes; a backward brings its kept input back (L@1),
    recomputes (C) before it waits for the gradient (rg), downloads (D) and updates (O) its gradients."""
    s = build_round_robin(Cuts((0, 2), (0, 1, 2), 3), 2, 2)
    assert _lists(s) == [
        "Uf0r0 Ub2r0 F0,0 H0@1,0 sa0,0 F0,1 H0@1,1 sa0,1 Xf0r0 L2@1,0 C2,0 rg2,0 B2,0 sg2,0 L2@1,1 C2,1 rg2,1 B2,1 "
        "sg2,1 Xb2r0 D2r0 O2 R",
        "Uf1r0 Ub3r0 ra1,0 FB1,0 sg1,0 ra1,1 FB1,1 sg1,1 Xf1r0 D1r0 O1 C3,0 rg3,0 B3,0 C3,1 rg3,1 B3,1 Xb3r0 D3r0 "
        "O3 R",
    ]
    assert "op k of round q on gpu" in round_robin_timeline(s)


def test_the_rotation_continues_across_rounds_and_steps_and_a_barrier_updates_after_the_reduce() -> None:
    s = build_round_robin(Cuts((0, 2, 4), (0, 1, 2, 3, 4), 6), 3, 4, steps=2,
                          options=PipelineOptions(barrier=True))
    assert s.rounds == 2 and s.num_stages == 7
    for q, k in itertools.product(range(4), range(7)):  # op k of global round q on worker (q*7 + k) mod 3
        assert s.worker_of(k, q) == (q * 7 + k) % 3
    computes = [(a.stage, a.micro, w) for w, acts in enumerate(s.actions) for a in acts if a.kind in COMPUTE
                and a.kind != Kind.RECOMPUTE]
    assert sorted((k, m) for k, m, _ in computes) == [(k, m) for k in range(7) for m in range(8)]
    assert all(w == s.worker_for(k, m) for k, m, w in computes)
    for acts in s.actions:  # with a barrier every update follows its step's REDUCE
        seen_reduce = 0
        for a in acts:
            seen_reduce += a.kind == Kind.REDUCE
            assert a.kind != Kind.UPDATE or seen_reduce >= 1
    updates = [a.stage for acts in s.actions for a in acts if a.kind == Kind.UPDATE]
    assert sorted(updates) == sorted(list(range(2, 7)) * 2)  # the fused and backward ops, once per step


@pytest.mark.parametrize("fwd,bwd,units,N,M,steps,slots", [
    ((0, 2, 4), (0, 1, 2, 3, 4), 6, 3, 4, 2, 2), ((0, 5), (0, 2, 5), 6, 4, 8, 3, 1), ((0, 1), (0, 1), 3, 2, 3, 1, 2),
    ((0, 3, 6, 9), (0, 1, 2, 3, 4, 5, 6, 7, 8, 9), 10, 8, 16, 2, 2)])
def test_round_robin_invariants(fwd, bwd, units, N, M, steps, slots) -> None:
    s = build_round_robin(Cuts(fwd, bwd, units), N, M, steps, PipelineOptions(num_slots=slots))  # checked inside
    sends = sorted((a.stage + 1, a.micro) for acts in s.actions for a in acts if a.kind in (Kind.SEND_ACT,
                                                                                              Kind.SEND_GRAD))
    recvs = sorted((a.stage, a.micro) for acts in s.actions for a in acts if a.kind in (Kind.RECV_ACT, Kind.RECV_GRAD))
    assert sends == recvs
    kept = {(a.unit, a.micro) for acts in s.actions for a in acts if a.kind == Kind.OFFLOAD}
    reloaded = {(a.unit, a.micro) for acts in s.actions for a in acts if a.kind == Kind.RELOAD}
    assert reloaded == kept  # every input a backward brings back, a forward put in host memory


def test_bad_cuts_are_refused() -> None:
    with pytest.raises(ScheduleError, match="must both end"):
        Cuts((0, 2), (0, 1, 3), 4)
    with pytest.raises(ScheduleError, match="no resident or kept"):
        build_round_robin(Cuts((0, 2), (0, 1, 2), 3), 2, 2, options=PipelineOptions(resident=frozenset({1})))


def test_minimax_cuts_are_exact() -> None:
    times = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0]
    for parts in range(1, len(times) + 1):
        bounds = minimax_cuts(times, parts)
        got = max(sum(times[a:b]) for a, b in zip(bounds, bounds[1:]))
        best = min(max(sum(times[a:b]) for a, b in zip((0, *c), (*c, len(times))))
                   for c in itertools.combinations(range(1, len(times)), parts - 1))
        assert len(bounds) == parts + 1 and got == pytest.approx(best)
    assert parts_for(times, 9.0) == 4 and parts_for([10.0, 1.0], 5.0) == 2


def _profile(blocks: int = 8, tied: bool = False) -> ModelProfile:
    def unit(kind: str, i: int, fwd: float, params: int) -> UnitCost:
        return UnitCost(f"{kind}.{i}", kind, kind, params, fwd, 3 * fwd, 2 * params, 2 * params, 8 << 20, 8 << 20,
                        64 << 20, 16 << 20)
    units = [unit("embed", 0, 0.001, 50_000_000)] + [unit("block", i, 0.010, 100_000_000) for i in range(blocks)]
    units.append(unit("head", 0, 0.020, 50_000_000))
    return ModelProfile(units, 1, 1024, "bf16", "test", "datasheet", tied_params=50_000_000 if tied else 0)


@pytest.mark.parametrize("tied", [False, True])
def test_the_simulator_runs_the_lists_and_a_delayed_update_is_not_slower(tied: bool) -> None:
    prof, hw = _profile(tied=tied), Hardware.paper_3090ti()
    cuts = Cuts((0, 3, 6, 9), (0, 2, 4, 6, 7, 8, 9), prof.num_units)
    sync = simulate_round_robin(prof, cuts, hw, [0, 1, 2, 3], 8, PipelineOptions(barrier=True))
    delayed = simulate_round_robin(prof, cuts, hw, [0, 1, 2, 3], 8, PipelineOptions(barrier=True, delayed=True))
    assert len(sync.step_ends) == 4 and delayed.step_s <= sync.step_s + 1e-9
    work = sum(u.fwd_s + u.bwd_s for u in prof.units) * 8 / 4 - prof.units[-1].fwd_s * 8 / 4  # FB: no recompute
    assert delayed.step_s >= work * 0.999  # at least the compute per GPU
    ops = [cuts.units(k) for k in range(cuts.num_ops)]
    uploads = 2 * sum(sum(u.param_bytes for u in prof.units[a:b]) for a, b in ops)  # each op once per round
    uploads += 4 * sum(sum(u.trainable_count for u in prof.units[a:b]) for a, b in ops[cuts.num_forward:])  # the
    # last round's gradient ops also bring the first round's fp32 sums up
    kept = sum(prof.units[u].in_bytes for u in cuts.backward[1:-1]) * 8
    assert delayed.bytes_by_kind["upload"] == pytest.approx(uploads)
    assert delayed.bytes_by_kind["ckpt"] == pytest.approx(2 * kept)  # kept once, brought back once
    grads = 2 * 4 * sum(sum(u.trainable_count for u in prof.units[a:b]) for a, b in ops[cuts.num_forward:])
    assert delayed.bytes_by_kind["grad"] == pytest.approx(grads)  # fp32, every round
    assert "C" in delayed.to_ascii(80) or "c" in delayed.to_ascii(80)


def test_the_time_split_holds_the_reported_steps_compute_under_either_update_rule() -> None:
    """With a delayed update the next step computes before the reported step's end, and part of this one's compute
    falls before the period it reports: the split counts the step's own compute wherever it fell, as much as in sync,
    and adds up to the step."""
    prof, hw = _profile(), Hardware.paper_3090ti()
    cuts = Cuts((0, 3, 6, 9), (0, 2, 4, 6, 7, 8, 9), prof.num_units)
    res = {rule: simulate_round_robin(prof, cuts, hw, [0, 1, 2, 3], 8, PipelineOptions(delayed=rule == "delayed"),
                                      record=rule == "sync") for rule in ("sync", "delayed")}
    busy = {rule: r.time_split()["forward"] + r.time_split()["backward"] for rule, r in res.items()}
    assert busy["delayed"] == pytest.approx(busy["sync"], rel=1e-6)
    computed = sum(e.end - e.start for e in res["sync"].events if e.track == "compute" and e.cat != "dispatch") / 4
    assert busy["sync"] == pytest.approx(computed)  # a sync step's compute lies in its period
    for r in res.values():
        assert sum(r.time_split().values()) == pytest.approx(r.step_s)


def test_the_summing_thread_pays_for_adding_the_middle_rounds_sums_when_they_land() -> None:
    """The summing thread adds a middle round's fp32 sums into the host sum (12 bytes per parameter) on the memory
    the CPU AdamW uses (30 per update), as each download lands; the first round comes down into the host sum, and
    the last takes the earlier rounds' sums up with its weights, so that its download is the total (the GPU reads
    the norm): an op's update itself is one AdamW (it pauses while the adds run), and the adds run during the
    step, not after it."""
    prof, hw = _profile(), Hardware.paper_3090ti()
    cuts = Cuts((0, 3, 6, 9), (0, 2, 4, 6, 7, 8, 9), prof.num_units)
    one, two, three = build_round_robin(cuts, 4, 4), build_round_robin(cuts, 2, 4), build_round_robin(cuts, 1, 3)
    assert one.download_work(0) == 0 and not any(one.sums_up(k, 0) for k in range(cuts.num_ops))
    assert [two.download_work(q) for q in (0, 1, 2, 3)] == [0, 0, 0, 0]
    assert [k for k in range(cuts.num_ops) if two.sums_up(k, 1)] == list(range(cuts.num_forward, cuts.num_ops))
    assert not any(two.sums_up(k, 0) for k in range(cuts.num_ops))
    assert [three.download_work(q) for q in (0, 1, 2, 3, 4, 5)] == pytest.approx([0, 12 / 30, 0, 0, 12 / 30, 0])
    hw = dataclasses.replace(hw, host_adam_params_per_s=None)  # the two threads do not slow each other down here
    res = simulate_round_robin(prof, cuts, hw, [0], 3, PipelineOptions(), steps=1)
    trainable = sum(u.trainable_count for u in prof.units)
    def busy(cat: str) -> float:
        return sum(e.end - e.start for e in res.events if e.cat == cat)
    sums = [e for e in res.events if e.cat == "sum"]
    paused = sum(max(0.0, min(e.end, s.end) - max(e.start, s.start)) for e in res.events if e.cat == "adam"
                 for s in sums)  # an update waits while its worker's summing thread adds
    assert busy("adam") - paused == pytest.approx(trainable / hw.cpu_update_rate())
    assert busy("sum") == pytest.approx(trainable * 12 / 30 / hw.cpu_update_rate())  # round 1 of 3
    first_update = min(e.start for e in res.events if e.cat == "adam")
    assert any(e.cat == "sum" and e.end <= first_update for e in res.events)  # round 1's adds, before any update
    last_compute = max(e.end for e in res.events if e.track == "compute")
    assert any(e.cat == "sum" and e.end < last_compute for e in res.events)  # ... ran beside the compute


def test_a_tied_weight_trains_once_at_the_embeddings_end_which_copies_it_into_the_heads() -> None:
    """Unit 0's update runs the tied weight's AdamW on both ends' gradients, then copies the result (the fp32
    master and the compute copy) into the head's end; the head's update leaves the tied weight out, so it need not
    wait for the embedding's gradients, and the head's op's uploads wait for unit 0's update instead."""
    prof = _profile(tied=True)
    hw = dataclasses.replace(Hardware.paper_3090ti(), host_adam_params_per_s=None)
    cuts = Cuts((0, 3, 6, 8), (0, 2, 4, 6, 7, 8), prof.num_units)  # the fused op: block 7 and the head
    F, K = cuts.num_forward, cuts.num_ops
    res = simulate_round_robin(prof, cuts, hw, [0], 1, PipelineOptions(), steps=1)
    adam = {e.name: e for e in res.events if e.cat == "adam"}

    def params(k: int) -> int:
        a, b = cuts.units(k)
        return sum(u.trainable_count for u in prof.units[a:b])

    rate = hw.cpu_update_rate()
    head, embed = adam[f"adam{F}"], adam[f"adam{K - 1}"]
    assert head.end - head.start == pytest.approx((params(F) - prof.tied_params) / rate)
    assert embed.end - embed.start == pytest.approx((params(K - 1) + prof.tied_params * tie_copy_work("bf16")) / rate)
    assert tie_copy_work("bf16") == pytest.approx(12 / 30)  # master 4 + 4, bf16 copy 2 + 2, against AdamW's 30
    assert head.start < max(e.end for e in res.events if e.track == "compute")  # before the embedding's backward
    sched = build_round_robin(cuts, 4, 8, tied=True)
    assert sched.update_deps(F) == (F, K - 1)  # its own update, and unit 0's
    assert build_round_robin(cuts, 4, 8).update_deps(F) == (F,)


def test_the_memory_model_counts_the_next_op_in_the_second_slot() -> None:
    prof = _profile()
    cuts = Cuts((0, 9), (0, 9), prof.num_units)
    one, two = round_robin_peaks(prof, cuts, 2, 1), round_robin_peaks(prof, cuts, 2, 2)
    assert two > one > 9 * 2 * 100_000_000 / 1e9  # a forward op holds its 9 units' half weights at least
    assert all(shape_cuts(prof, s).fused_from in (prof.num_units - 1, prof.num_units - 2) for s in candidate_shapes(prof))


def test_the_search_ends_no_slower_than_every_candidate_and_every_neighbouring_shape() -> None:
    """The cuts it returns are the fastest simulated of the candidate shapes, and one forward or backward op more
    or fewer would not be faster (it climbs until then)."""
    prof, hw, gpus = _profile(blocks=12), Hardware.paper_3090ti(), [0, 1, 2, 3]
    choice = search_cuts(prof, hw, gpus, 8, PipelineOptions(), 22.0)
    def step(shape) -> float:
        return simulate_round_robin(prof, shape_cuts(prof, shape), hw, gpus, 8, PipelineOptions(), record=False).step_s
    c = choice.cuts
    shape = (c.fused_from, c.num_forward, c.num_backward)
    assert shape_cuts(prof, shape) == c and choice.result.step_s == pytest.approx(step(shape))
    for other in candidate_shapes(prof) + neighbours(shape):
        assert step(other) >= choice.result.step_s - 1e-9, other


@pytest.mark.slow
def test_mobius_plan_prints_the_round_robin_prediction_under_both_update_rules(tmp_path) -> None:
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps({"gpu": "rtx4090", "micro_batch_size": 1, "seq_len": 512, "precision": "bf16",
                                "units": {"block": {"forward_ms": 2.0, "backward_ms": 4.0},
                                          "head": {"forward_ms": 3.0, "backward_ms": 6.0}}}))
    args = ["plan", "configs/finetune-opt-1.3b.yaml", "--gpus", "4", "--model.preset=opt-125m",
            "--partition.gpu=rtx4090", "--train.micro_batch_size=1", "--data.seq_len=512", "--train.micro_batches=8",
            f"--partition.profile_file={prof}", "--parallel.schedule=auto", "--partition.time_limit_s=1"]
    text = mobius(args, cwd=ROOT)
    assert text.returncode == 0, text.stderr[-2000:]
    out = json.loads(mobius(args + ["--json"], cwd=ROOT).stdout)
    rr = out["round_robin"]
    swapped = next(s for s in [out, *out["other_schedules"]] if s["schedule"] == "swapped")
    assert rr["runs"] == (rr["step_s"] < swapped["predicted_step_s"])  # auto: the faster predicted one runs
    first = text.stdout.splitlines()[0]  # the schedule that runs, the update rule and the predictions come first
    runs, other = ("round-robin", "swapped pipeline") if rr["runs"] else ("swapped pipeline", "round-robin")
    assert first.startswith(f"schedule: {runs}") and "update sync" in first and f"not run: the {other}" in first
    assert "round-robin schedule (RoundPipe's class; " + ("runs)" if rr["runs"] else "not run") in text.stdout
    assert "tokens/s with update sync" in text.stdout and "tokens/s with delayed" in text.stdout
    assert rr["update"] == "sync" and rr["delayed_step_s"] <= rr["step_s"] + 1e-9
    assert rr["forward"][0] == 0 and rr["forward"][-1] == rr["backward"][-1] == rr["fused"][0]


def test_mobius_plan_json_gives_at_its_top_level_the_schedule_that_runs(tmp_path) -> None:
    """Issue 65: with the round-robin schedule running, the JSON's top level gave the swapped pipeline's step. Its
    top level is the schedule that runs (schedule, update, step, tokens/s, where the step goes), every other one
    under ``other_schedules`` with the same fields, and auto's comparison and plan.json's round trip agree."""
    from partition import RoundRobinPlan, ScheduleComparison

    args = ["plan", "configs/demo.yaml", "--gpus", "4", "--parallel.mode=pipeline", "--parallel.device=cuda",
            "--partition.gpu=rtx3090", "--partition.time_limit_s=1", "--parallel.schedule=round_robin",
            f"--partition.cache_dir={tmp_path}", "--json"]
    r = mobius(args, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    rr, fields = out["round_robin"], ["schedule", "update", "predicted_step_s", "tokens_per_s", "time_split"]
    assert rr["runs"] and out["schedule"] == "round_robin"
    assert [out[k] for k in fields[1:]] == [rr["update"], rr["step_s"], rr["tokens_per_s"], rr["time_split"]]
    assert out["mode"]["candidates"][0]["predicted_step_s"] == out["predicted_step_s"]
    [swapped] = out["other_schedules"]
    assert list(swapped) == fields and swapped["schedule"] == "swapped" and swapped["update"] == "sync"
    tokens = out["micro_batches"] * out["micro_batch_size"] * out["seq_len"]
    assert swapped["tokens_per_s"] == pytest.approx(tokens / swapped["predicted_step_s"])
    assert swapped["predicted_step_s"] != out["predicted_step_s"]
    again = ScheduleComparison.from_json(out)  # plan.json and the kept plans read it back
    s = again.swapped
    assert s.predicted_step_s == swapped["predicted_step_s"] and s.time_split == swapped["time_split"]
    assert isinstance(again.runs, RoundRobinPlan) and again.runs.predicted_step_s == out["predicted_step_s"]
    assert again.to_json() == {k: v for k, v in out.items() if k not in ("mode", "profile", "model", "host")}


def test_a_delayed_update_takes_the_cpu_update_off_the_swapped_pipelines_step() -> None:
    """The swapped pipeline keeps one compute copy per stage: with a barrier, a sync step's uploads wait for
    the previous step's whole CPU update, a delayed step's only for its start (the copy of the master)."""
    import dataclasses

    from partition.simulate import simulate

    prof = _profile()
    hw = Hardware.paper_3090ti()
    slow = dataclasses.replace(hw, cpu_adam_params_per_s=hw.cpu_adam_params_per_s / 4,
                               host_adam_params_per_s=hw.host_adam_params_per_s / 4)
    bounds = [0, 3, 5, 7, prof.num_units]
    sync = simulate(prof, bounds, slow, [0, 1], 4, PipelineOptions(barrier=True), record=False)
    delayed = simulate(prof, bounds, slow, [0, 1], 4, PipelineOptions(barrier=True, delayed=True), record=False)
    assert delayed.step_s < 0.8 * sync.step_s
    assert delayed.total_bytes() == pytest.approx(sync.total_bytes())  # the same traffic, another order
    fast_sync = simulate(prof, bounds, hw, [0, 1], 4, PipelineOptions(barrier=True), record=False)
    fast_delayed = simulate(prof, bounds, hw, [0, 1], 4, PipelineOptions(barrier=True, delayed=True), record=False)
    assert fast_delayed.step_s <= fast_sync.step_s + 1e-9


def test_each_hand_off_between_ops_costs_its_two_workers_a_message_each() -> None:
    """With ``Hardware.message_s`` the simulated step pays one message per send and one per receive of every
    micro-batch between consecutive ops (on other workers), in the step's dispatch time."""
    prof = _profile()
    hw = Hardware.paper_3090ti()
    cuts = Cuts((0, 3, 6, 9), (0, 2, 4, 6, 7, 8, 9), prof.num_units)
    base = simulate_round_robin(prof, cuts, hw, [0, 1, 2, 3], 8, PipelineOptions(), steps=1)
    slow = simulate_round_robin(prof, cuts, dataclasses.replace(hw, message_s=1e-3), [0, 1, 2, 3], 8,
                                PipelineOptions(), steps=1)
    messages = 2 * (cuts.num_ops - 1) * 8  # per step, over the 4 workers
    assert slow.time_split()["dispatch"] * 4 == pytest.approx(messages * 1e-3)
    assert base.time_split()["dispatch"] == 0 and slow.step_s > base.step_s
