"""The zero-mode search engine, pure: chunk layout, Belady replacement, Table 1's extremes, memory."""

from __future__ import annotations

import functools
import random
from dataclasses import replace

import pytest

from mobius.errors import ConfigError
from mobius.models import get_preset, unit_specs
from partition.costs import ModelProfile, UnitCost
from mobius.layout import ParamInfo, build_layout
from mobius.models.params import model_params
from partition.schedule.zero import chunk_trace, eval_program, grad_flushes, train_program
from partition.zero import CachePolicy, Setting, Workload, ZeroHardware, ZeroPlan, plan, predict, simulate_cache
from partition.zero.choice import choose_setting, gpu_benefit, rcache_benefit
from partition.zero.memory import STATE_BYTES, activation_bytes, model_state_bytes, usable_bytes

GiB = 2**30


def _params(sizes: list[list[int]], tied: bool = False) -> list[ParamInfo]:
    """Units of 1-D parameters of the given sizes; ``tied``: the last unit also uses the first parameter."""
    out, last = [], len(sizes) - 1
    for u, unit in enumerate(sizes):
        for k, n in enumerate(unit):
            users = (0, last) if tied and u == 0 and k == 0 else (u,)
            out.append(ParamInfo((f"u{u}.p{k}",), (n,), users, decay=k % 2 == 0))
    return out


def _profile(num_units: int, fwd_s: float = 1e-3, act: int = 1000) -> ModelProfile:
    units = [UnitCost(f"u{u}", "block", "b", 0, fwd_s, 2 * fwd_s, 0, 0, act, act, 3 * act, act)
             for u in range(num_units)]
    return ModelProfile(units, 1, 8, "fp32", "test", "datasheet")


def _hw(ranks: int = 1, memory: int = 8 * GiB, **kw) -> ZeroHardware:
    rates = dict(c2g_Bps=10e9, g2c_Bps=10e9, g2g_Bps=100e9, device_Bps=1e12, cpu_adam_params_per_s=2e9,
                 gpu_adam_params_per_s=30e9)
    rates.update(kw)
    return ZeroHardware(ranks, memory, name="test", **rates)


# ---- chunk layout ---------------------------------------------------------------------------------
def _covers_every_element_once(layout) -> None:
    for i, p in enumerate(layout.params):
        pieces = layout.pieces[i]
        assert sum(seg.numel for _, seg in pieces) == p.numel
        assert [seg.start for _, seg in pieces] == [sum(s.numel for _, s in pieces[:k]) for k in range(len(pieces))]
    for ch in layout.chunks:
        ends = 0
        for seg in ch.segments:
            assert seg.offset >= ends and seg.offset % layout.align == 0
            ends = seg.offset + seg.numel
        assert ends <= layout.chunk_size <= layout.padded


def test_layout_groups_in_forward_order_and_closes_a_chunk_that_cannot_take_the_next_parameter() -> None:
    layout = build_layout(_params([[30, 30], [50], [20, 25]]), 3, chunk_size=64, world=1, align=1)
    assert [[s.param for s in ch.segments] for ch in layout.chunks] == [[0, 1], [2], [3, 4]]
    assert layout.unit_chunks == ((0,), (1,), (2,))
    assert layout.min_blocks == 1 and layout.padded == 64
    assert layout.waste == pytest.approx(1 - 155 / (3 * 64))
    _covers_every_element_once(layout)


def test_a_parameter_larger_than_a_chunk_spans_consecutive_chunks_and_its_unit_needs_them_all() -> None:
    layout = build_layout(_params([[10], [250, 5], [7]]), 3, chunk_size=100, world=1, align=1)
    pieces = layout.pieces[1]
    assert [(c, s.start, s.offset, s.numel) for c, s in pieces] == [(1, 0, 0, 100), (2, 100, 0, 100), (3, 200, 0, 50)]
    assert layout.chunks[3].segments[1].param == 2  # the last piece's chunk takes the next parameters
    assert layout.unit_chunks[1] == (1, 2, 3) and layout.min_blocks == 3
    _covers_every_element_once(layout)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_chunk_buffers_split_into_equal_aligned_shards_when_world_does_not_divide_the_chunk(world: int) -> None:
    layout = build_layout(_params([[37, 40], [61], [13]]), 3, chunk_size=101, world=world, align=16)
    assert layout.padded % world == 0 and layout.shard % 16 == 0 and layout.padded >= 101
    assert layout.padded - 101 < world * 16
    runs = [r for rank in range(world) for r in layout.shard_runs(0, rank)]
    assert sum(hi - lo for lo, hi, _ in runs) == layout.chunks[0].used  # the decay runs cover the chunk once
    _covers_every_element_once(layout)


def test_decay_runs_follow_the_parameters_and_alignment_gaps_join_the_run_before() -> None:
    layout = build_layout(_params([[10, 3, 20]]), 1, chunk_size=100, world=1, align=16)
    assert layout.decay_runs(0) == [(0, 16, True), (16, 32, False), (32, 52, True)]
    assert build_layout(_params([[10, 3, 20]]), 1, 64, world=2, align=16).shard_runs(0, 1) == [(0, 20, True)]


def test_a_tied_weight_is_laid_out_once_and_called_by_both_units() -> None:
    layout = build_layout(_params([[40, 10], [30], [8]], tied=True), 3, chunk_size=50, world=1, align=1)
    assert layout.params[0].units == (0, 2) and sum(len(p.names) for p in layout.params) == 4
    assert layout.unit_chunks == ((0,), (1,), (0, 1))  # the head's own parameter shares chunk 1
    flushes = grad_flushes(train_program(3), layout)  # F0, F1, L2 (head), B1, B0
    assert flushes == [(), (), (0,), (1,), (0,)]  # the embedding's chunk: once after the head, once at the end


def test_the_real_models_parameters_come_in_forward_order_with_the_tied_head_on_the_embedding() -> None:
    cfg = get_preset("gpt2-tiny")
    params = model_params(cfg)
    assert params[0].names == ("embed.wte.weight", "head.lm_head.weight") and params[0].units == (0, 5)
    assert [p.units[0] for p in params] == sorted(p.units[0] for p in params)
    assert sum(p.numel for p in params) == sum(s.param_count for s in unit_specs(cfg)) - cfg.vocab_size * cfg.n_embd
    assert not params[2].decay and params[4].decay  # blocks.0.ln_1.weight, blocks.0.attn.qkv.weight


# ---- Belady ---------------------------------------------------------------------------------------
def _optimal_fetches(trace: list[tuple[int, ...]], n_block: int) -> int:
    """Fewest chunk fetches over every replacement choice (demand fetching), by exhaustive search."""
    @functools.lru_cache(maxsize=None)
    def best(t: int, resident: frozenset) -> int:
        if t == len(trace):
            return 0
        need = set(trace[t])
        missing = need - resident
        keep_from = resident - need
        room = n_block - len(need)
        out = None
        for k in range(min(room, len(keep_from)), -1, -1):
            for kept in _subsets(sorted(keep_from), k):
                cost = len(missing) + best(t + 1, frozenset(need | set(kept)))
                out = cost if out is None else min(out, cost)
        return out
    return best(0, frozenset())


def _subsets(items: list[int], k: int):
    if k == 0:
        yield ()
        return
    for i in range(len(items)):
        for rest in _subsets(items[i + 1:], k - 1):
            yield (items[i],) + rest


@pytest.mark.parametrize("seed", range(12))
def test_belady_fetches_as_few_chunks_as_any_replacement(seed: int) -> None:
    rng = random.Random(seed)
    chunks, n_block = rng.randint(3, 6), rng.randint(2, 3)
    width = 1 if seed % 2 else 2  # single-chunk operators, and operators calling two chunks
    trace = [tuple(sorted(rng.sample(range(chunks), rng.randint(1, width)))) for _ in range(rng.randint(6, 11))]
    run = simulate_cache(trace, n_block, prefetch=False)
    assert run.gathers == _optimal_fetches(trace, n_block)


def test_lru_while_recording_and_belady_once_the_trace_is_known() -> None:
    trace = [(0,), (1,), (2,), (0,), (1,), (2,)]
    lru = CachePolicy(2)
    lru.begin(None)
    fetched = 0
    for t in trace:
        fetched += len(lru.need(t))
        lru.done()
    assert fetched == 6 and lru.end() == trace  # LRU misses every call of a cyclic trace one larger than the cache
    assert simulate_cache(trace, 2, prefetch=False).gathers == 4  # Belady keeps one of them


def test_prefetch_uses_only_blocks_that_neither_the_current_nor_the_next_operator_calls() -> None:
    trace = [(0,), (1,), (2,), (1,), (0,)]
    run = simulate_cache(trace, 2, prefetch=True)
    assert run.prefetched == [[(1, 1)], [(2, 0)], [], [(0, 0)], []]  # a free block, then what op t, t+1 leave
    assert all(not d for d in run.demand[1:])  # every later call finds its chunk already there
    assert run.gathers == simulate_cache(trace, 2, prefetch=False).gathers  # the same chunks, earlier
    assert simulate_cache(trace, 1, prefetch=True).prefetched == [[]] * 5  # one block: never evict what runs


def test_a_pass_that_deviates_from_the_recorded_trace_is_refused() -> None:
    policy = CachePolicy(2)
    policy.begin([(0,), (1,)])
    policy.need((0,))
    policy.done()
    with pytest.raises(ValueError, match="calls chunks \\(2,\\), not the recorded \\(1,\\)"):
        policy.need((2,))


# ---- Table 1's extremes ----------------------------------------------------------------------------
@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_rcache_max_gathers_each_chunk_once_and_rcache_min_twice_like_zero2_and_zero3(ranks: int) -> None:
    units = 6
    layout = build_layout(_params([[64]] * units), units, chunk_size=64, world=ranks, align=16)  # a chunk per unit
    S, L, prof = layout.num_chunks * layout.padded, 4, _profile(units)  # fp32: L_c = 4 bytes
    w = Workload(1, "fp32", checkpointing=True, barrier=True)
    zero2 = predict(layout, prof, _hw(ranks), Setting(cache_blocks=units, gpu_chunks=units), w).traffic
    assert zero2["replaced_bytes"] == L * S  # gathered once (forward), kept for the backward
    assert zero2["allgather_bytes"] + zero2["reduce_scatter_bytes"] == 2 * L * S * (ranks - 1) / ranks  # 2 L_c S
    zero3 = predict(layout, prof, _hw(ranks), Setting(cache_blocks=1, gpu_chunks=units), w).traffic
    assert zero3["replaced_bytes"] == L * S * (2 * units - 1) / units  # forward and backward, but the turn
    offload = predict(layout, prof, _hw(ranks), Setting(cache_blocks=units, gpu_chunks=0), w).traffic
    assert offload["h2d_bytes"] + offload["d2h_bytes"] == 2 * L * S / ranks  # rCache-max -> offload: 2 L_c S
    offload3 = predict(layout, prof, _hw(ranks), Setting(cache_blocks=1, gpu_chunks=0), w).traffic
    assert offload3["h2d_bytes"] + offload3["d2h_bytes"] == L * S * (3 * units - 1) / units / ranks  # no write-back


# ---- memory and the choice of a setting -----------------------------------------------------------
def _layout_and_work(ranks: int = 1):
    units = 8
    layout = build_layout(_params([[1000, 24]] * units), units, chunk_size=1024, world=ranks, align=16)
    return layout, Workload(4 // ranks, "bf16", checkpointing=True, barrier=False)


def test_everything_on_the_gpu_and_rcache_max_when_memory_is_plentiful() -> None:
    layout, w = _layout_and_work()
    s = choose_setting(layout, _hw(), 1 * GiB, w)
    assert s == Setting(cache_blocks=layout.num_chunks, gpu_chunks=layout.num_chunks)


def test_chunks_go_to_the_gpu_first_when_j_beats_i_and_the_setting_fits_the_memory() -> None:
    layout, w = _layout_and_work()
    hw = _hw(cpu_adam_params_per_s=0.2e9)  # a slow CPU update: one more chunk on the GPU saves more than a block
    assert gpu_benefit(hw, 2) > rcache_benefit(hw, 2)
    fixed = sum(model_state_bytes(layout, Setting(0, 0), 2).values())
    allowed = fixed + 4 * layout.padded * 2 + 3 * layout.shard * STATE_BYTES + 100
    s = choose_setting(layout, hw, allowed, w)
    assert s.gpu_chunks == 3 and s.cache_blocks >= layout.min_blocks
    assert sum(model_state_bytes(layout, s, 2).values()) <= allowed


def test_rcache_first_when_i_beats_j() -> None:
    layout, w = _layout_and_work()
    hw = _hw(c2g_Bps=0.1e9, g2c_Bps=1e12, cpu_adam_params_per_s=1e12, gpu_adam_params_per_s=1e11)  # slow uploads only
    assert rcache_benefit(hw, 2) > gpu_benefit(hw, 2)
    fixed = sum(model_state_bytes(layout, Setting(0, 0), 2).values())
    s = choose_setting(layout, hw, fixed + layout.num_chunks * layout.padded * 2 + layout.shard * STATE_BYTES, w)
    assert s == Setting(cache_blocks=layout.num_chunks, gpu_chunks=1)


def test_configured_values_are_checked_against_the_layout() -> None:
    layout, w = _layout_and_work()
    assert layout.min_blocks == 2 and layout.num_chunks == 16  # 1000 + 24 (aligned) spill into a second chunk
    with pytest.raises(ConfigError, match=r"zero.cache_blocks=1 must be between 2 .* and 16"):
        choose_setting(layout, _hw(), GiB, w, cache_blocks=1)
    assert choose_setting(layout, _hw(), GiB, w, cache_blocks=3, gpu_chunks=99) == Setting(3, 16)


def test_usable_memory_follows_appendix_a1_and_a_model_that_does_not_fit_is_refused() -> None:
    assert usable_bytes(10 * GiB, 2 * GiB) == int(0.95 * (10 * GiB - 1.25 * 2 * GiB))
    prof = _profile(8, act=10**6)
    params = _params([[10**6]] * 8)
    w = Workload(1, "fp32", True, False)
    act = activation_bytes(prof, w)
    with pytest.raises(ConfigError, match=r"zero mode does not fit in \d+\.\d\d MiB per rank \(partition\."
                                          r"gpu_memory_gib, or the device's memory\): activations take"):
        plan(params, 8, prof, _hw(memory=act * 2), micro_batches=1, checkpointing=True, barrier=False)


def test_the_search_picks_the_chunk_size_that_replaces_the_fewest_bytes() -> None:
    params = _params([[3000, 1000]] * 6)
    p = plan(params, 6, _profile(6), _hw(memory=GiB), micro_batches=2, checkpointing=True, barrier=True)
    fitting = [c for c in p.candidates if c["fits"]]
    assert len(fitting) > 2
    assert p.traffic["replaced_bytes"] >= min(c["replaced_bytes"] for c in fitting)
    chosen = next(c for c in p.candidates if c["chunk_size"] == p.chunk_size)
    assert chosen["replaced_bytes"] <= 1.01 * min(c["replaced_bytes"] for c in fitting)


def test_micro_batches_must_split_evenly_among_ranks() -> None:
    with pytest.raises(ConfigError, match=r"train.micro_batches=3 must be a multiple of the 2 zero ranks"):
        plan(_params([[10]] * 3), 3, _profile(3), _hw(2), micro_batches=3, checkpointing=True, barrier=True)


# ---- predictions and the plan ---------------------------------------------------------------------
def test_offloading_costs_time_when_transfers_and_cpu_updates_are_slow() -> None:
    layout, w = _layout_and_work()
    prof = _profile(layout.num_units, fwd_s=1e-6)
    hw = _hw(c2g_Bps=1e6, g2c_Bps=1e6, cpu_adam_params_per_s=1e6)
    on_gpu = predict(layout, prof, hw, Setting(2, layout.num_chunks), w)
    offloaded = predict(layout, prof, hw, Setting(2, 0), w)
    assert offloaded.step_s > on_gpu.step_s + layout.num_chunks * layout.shard / 1e6  # the CPU updates alone
    assert on_gpu.traffic["h2d_bytes"] == 0 and offloaded.traffic["h2d_bytes"] > 0
    assert offloaded.cpu_adam_s == pytest.approx(layout.num_chunks * layout.shard / 1e6)


@pytest.mark.parametrize("barrier", [False, True])
def test_a_delayed_update_overlaps_the_next_step_up_to_the_cpu_s_own_time(barrier: bool) -> None:
    """Offloaded chunks whose CPU AdamW takes about as long as the compute: in sync the next step's gathers wait
    for the updates (with clipping all of them start after the norm); delayed, they wait only for the compute
    copies taken on the CPU thread as the gradients land (ahead of the AdamWs that have not begun: 6 bytes a
    parameter in bf16 against the AdamW's 30), so the step is about the longer of the two: the CPU's, AdamWs and
    copies, here."""
    from partition.costs import compute_copy_work

    layout, w = _layout_and_work()
    prof, hw = _profile(layout.num_units, fwd_s=1e-3), _hw(cpu_adam_params_per_s=1e5)
    w = replace(w, barrier=barrier)
    sync = predict(layout, prof, hw, Setting(2, 0), w)
    delayed = predict(layout, prof, hw, Setting(2, 0), replace(w, delayed=True))
    cpu = layout.num_chunks * layout.shard / 1e5 * (1 + compute_copy_work(w.precision))
    assert compute_copy_work(w.precision) == pytest.approx(0.2)
    assert delayed.cpu_adam_s == pytest.approx(cpu) and delayed.compute_s < cpu
    assert sync.step_s > delayed.step_s  # by little without clipping: the copies cost the CPU what sync's wait did
    assert cpu <= delayed.step_s < 1.01 * cpu


def test_a_compute_copy_goes_after_the_running_adamw_and_pushes_back_the_waiting_ones() -> None:
    """Delayed: a chunk's compute copy starts when its gradient is down, or when the AdamW running then ends, and
    every AdamW that had not begun starts that much later (the runtime queues the copy ahead of them)."""
    from partition.zero.step_sim import _StepSim

    layout, w = _layout_and_work()
    sim = _StepSim(layout, _profile(layout.num_units), _hw(), Setting(2, 0), replace(w, delayed=True))
    dt = sim.cost["copy"]
    sim.adams, sim.lanes.cpu, sim.stats = [[0.0, 1.0, 0], [1.0, 2.0, 1], [2.0, 3.0, 2]], 3.0, {"cpu": 0.0}
    sim._copy(3, 0.5)
    assert sim.cpu_ready[3] == pytest.approx(1.0 + dt)
    assert sim.adams == [[0.0, 1.0, 0], [1.0 + dt, 2.0 + dt, 1], [2.0 + dt, 3.0 + dt, 2]]
    assert sim.consumed[2] == pytest.approx(3.0 + dt) and sim.lanes.cpu == pytest.approx(3.0 + dt)
    sim._copy(4, 10.0)  # the thread is idle by then
    assert sim.cpu_ready[4] == pytest.approx(10.0 + dt) and sim.lanes.cpu == pytest.approx(10.0 + dt)
    assert sim.stats["cpu"] == pytest.approx(2 * dt)


def test_cpu_workers_wait_for_their_reduce_scatters_and_chunk_fills() -> None:
    """CPU workers have no streams: the dispatch thread fills each gathered block and waits for each gloo
    reduce-scatter, so the step takes its compute plus every reduce-scatter, where GPU streams overlap the
    same collectives (a fifth of the compute here; rCache-max: no gathers in the backward) with the compute."""
    layout, w = _layout_and_work(ranks=2)
    prof = _profile(layout.num_units, fwd_s=1e-3)
    hw = _hw(ranks=2, g2g_Bps=5e6, collective_s=1e-4)
    s = Setting(layout.num_chunks, layout.num_chunks)
    streams, blocking = predict(layout, prof, hw, s, w), predict(layout, prof, replace(hw, blocking=True), s, w)
    reduces = sum(len(f) for f in grad_flushes(train_program(layout.num_units), layout))
    reduce_s = 1e-4 + layout.shard * 4 / 5e6  # (ranks - 1) x shard x fp32 gradient bytes at g2g
    assert blocking.compute_s == pytest.approx(streams.compute_s)
    assert blocking.step_s >= blocking.compute_s + reduces * reduce_s
    assert streams.step_s < blocking.step_s - reduces * reduce_s / 2


def test_sync_updates_after_the_norm_go_in_forward_order() -> None:
    """With clipping every CPU update starts after the norm, and in sync the next step's gathers wait for them:
    queued in forward order, the forward starts after the first chunk's update and follows them (about the CPU's
    time, then the backward), where in the downloads' order it waited for all of them (the CPU's time, then the
    whole compute)."""
    layout, w = _layout_and_work()
    prof, hw = _profile(layout.num_units, fwd_s=1e-3), _hw(cpu_adam_params_per_s=1e5)
    p = predict(layout, prof, hw, Setting(2, 0), replace(w, barrier=True))
    forward = layout.num_units * w.micro_batches * 1e-3
    assert p.cpu_adam_s + p.compute_s - forward / 2 > p.step_s > p.cpu_adam_s + p.compute_s - forward - 0.01


def test_the_plan_reports_its_choices_and_round_trips_through_json() -> None:
    params = _params([[4000, 96]] * 6, tied=True)
    p = plan(params, 6, _profile(6), _hw(2, memory=GiB // 4), micro_batches=4, checkpointing=False, barrier=False,
             chunk_size=2000, cache_blocks=5, gpu_chunks=3)
    assert (p.chunk_size, p.cache_blocks, p.gpu_chunks, p.world) == (2000, 5, 3, 2)
    assert p.min_blocks == 5  # the head: its 4000-parameter weight's two chunks, a third, and the tied two
    assert p.decided == {"chunk_size": "config", "cache_blocks": "config", "gpu_chunks": "config"}
    assert set(p.alternatives) == {"rcache-min", "rcache-max", "all-offload"}
    again = ZeroPlan.from_json(p.to_json())
    assert again == p
    text = p.summary()
    for words in ("rCache: 5 blocks", "3 chunk(s) on the GPU", "predicted step time", "alternatives (predicted)",
                  "rcache-min", "eq. 1-2"):
        assert words in text, words


def test_traces_of_training_and_evaluation() -> None:
    layout = build_layout(_params([[10], [10], [10]]), 3, chunk_size=10, world=1, align=1)
    assert [str(op) for op in train_program(3)] == ["F0", "F1", "L2", "B1", "B0"]
    assert chunk_trace(eval_program(3), layout) == [(0,), (1,), (2,)]


def test_a_zero_run_logs_its_phases_beside_the_plans() -> None:
    """What a zero run logs at its end (mobius.app.launch.zero_phases): the step, the compute of its forwards and
    of its losses and backwards (from after their gathers) and the CPU AdamW, predicted beside the median of its
    steady steps; the plan's two phases make up its compute."""
    from mobius.app.launch import zero_phases

    p = plan(_params([[4000, 96]] * 6), 6, _profile(6), _hw(2, memory=GiB // 4), micro_batches=4, checkpointing=False,
             barrier=False, chunk_size=2000, cache_blocks=5, gpu_chunks=3)
    rows = [{"step": k, "step_s": 1.0 + k, "forward_s": 0.25, "backward_s": 0.5 + k, "cpu_adam_s": 0.125}
            for k in range(5)]
    table = zero_phases(p, rows)
    assert table == {"step": (p.predicted_step_s, 4.0), "forward": (p.time_split["forward"], 0.25),
                     "backward": (p.time_split["backward"], 3.5), "cpu_adam": (p.cpu_adam_s, 0.125)}
    assert p.time_split["forward"] > 0 and sum(p.time_split.values()) == pytest.approx(p.compute_s)
    assert zero_phases(p, rows[:2]) is None  # no steady step yet

