"""The parts of zero mode's engine on one rank, in this process (world size 1, no process group): the shards and
their weights (:class:`~scheduler.zero.chunk_store.ChunkStore`), the pass over the units
(:class:`~scheduler.zero.unit_pass.UnitPass`), the flushes and updates
(:class:`~scheduler.zero.zero_updates.ZeroUpdates`), the checkpoint state
(:class:`~scheduler.zero.zero_checkpoint.ZeroCheckpoint`). The engine whole, on worker processes: the exactness
tests (tests/test_zero.py, tests/test_zero_delayed.py)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from mobius.assemble import WeightSource
from mobius.batch import MicroBatch
from mobius.config import TrainSection
from mobius.layout import ChunkLayout, ParamInfo, build_layout
from mobius.models import unit_prefix, unit_specs
from mobius.models.base import bind_parameters, lm_loss_sum, run_units
from mobius.models.gpt2 import GPT2Config
from mobius.models.params import build_units, model_params
from mobius.optim import UpdateRule
from scheduler.counters import Counters
from scheduler.dispatch_thread import Background
from scheduler.zero import share
from scheduler.zero.chunk_store import ChunkStore
from scheduler.zero.rank_cache import GradBuffers, RCache, Streams
from scheduler.zero.unit_pass import PassOptions, PassState, UnitPass
from scheduler.zero.zero_checkpoint import DELAYED_FROM_SYNC, SYNC_FROM_DELAYED, ZeroCheckpoint, owners
from scheduler.zero.zero_updates import ZeroUpdates

CPU = torch.device("cpu")
SEED = 3
MODEL = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
                   attn_pdrop=0.0)
CHUNK = 1000  # the 1024-element token embedding spans two chunks


@dataclass
class Rank:
    """One rank's parts, wired as the engine wires them."""

    layout: ChunkLayout
    store: ChunkStore
    cache: RCache
    grads: GradBuffers
    updates: ZeroUpdates
    unit_pass: UnitPass
    bg: Background
    rule: UpdateRule


def _rank(gpu_chunks: int | None = None, blocks: int | None = None, checkpointing: bool = True,
          barrier: bool = True, delayed: bool = False, train: TrainSection | None = None) -> Rank:
    """World size 1: every chunk whole in this rank's shard; ``gpu_chunks`` None: all on the "GPU"."""
    train = train or TrainSection(seed=SEED, lr=1e-2, update="delayed" if delayed else "sync")
    specs = unit_specs(MODEL)
    layout = build_layout(model_params(MODEL), len(specs), CHUNK, 1)
    counters, bg = Counters(), Background(CPU)
    gpu = layout.num_chunks if gpu_chunks is None else gpu_chunks
    store = ChunkStore(layout, gpu, 0, torch.float32, train, delayed, CPU, counters, bg.check)
    store.load_weights(WeightSource(None, None, SEED), MODEL)
    streams, rule = Streams(CPU), UpdateRule(train)
    cache = RCache(layout, blocks or layout.num_chunks, torch.float32, 0, 1, None, streams, store.fill, True, counters)
    grads = GradBuffers(layout, layout.min_blocks + 1, 0, 1, None, streams, counters)
    options = PassOptions("fp32", checkpointing, None, None, list(range(len(specs))))
    box: list[ZeroUpdates] = []
    units = UnitPass(layout, build_units(MODEL, 0, len(specs)), cache, grads, 0, 1, CPU, options,
                     lambda c, st: box[0].flush(c, st))
    box.append(ZeroUpdates(store, grads, cache, streams, bg, rule, counters, units.runs(), barrier))
    return Rank(layout, store, cache, grads, box[0], units, bg, rule)


def _batches(count: int = 2) -> list[MicroBatch]:
    g = torch.Generator().manual_seed(7)
    return [MicroBatch(torch.randint(0, 64, (2, 8), generator=g), torch.randint(0, 64, (2, 8), generator=g))
            for _ in range(count)]


def _seed_weights() -> dict[str, torch.Tensor]:
    layout = build_layout(model_params(MODEL), len(unit_specs(MODEL)), CHUNK, 1)
    names = {p.names[0] for p in layout.params}
    return WeightSource(None, None, SEED).load(MODEL, names, set(range(len(unit_specs(MODEL)))))


def _reference_grads(batches: list[MicroBatch], factor: float) -> tuple[float, dict[str, torch.Tensor]]:
    """The whole model on the seed weights, plain autograd: the loss sum and each parameter's gradient of
    ``factor`` x it (a tied weight's ends summed, under its first name)."""
    layout = build_layout(model_params(MODEL), len(unit_specs(MODEL)), CHUNK, 1)
    first = {n: p.names[0] for p in layout.params for n in p.names}
    weights = _seed_weights()
    units = build_units(MODEL, 0, len(unit_specs(MODEL)))
    bound = [b for k, u in enumerate(units)
             for b in bind_parameters(u, unit_prefix(k, len(units)), lambda n: weights[first[n]].clone(), True)]
    total = 0.0
    for b in batches:
        loss = lm_loss_sum(run_units(list(units), b.inputs), b.targets)
        (loss * factor).backward()
        total += float(loss.detach())
    grads: dict[str, torch.Tensor] = {}
    for name, p in bound:
        grads[first[name]] = grads.get(first[name], 0) + p.grad
    return total, grads


def test_share_splits_the_micro_batches_into_contiguous_blocks() -> None:
    assert [list(share(8, r, 4)) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [len(share(3, r, 2)) for r in range(2)] == [1, 2]  # an evaluation's uneven split covers every batch
    assert sorted(m for r in range(3) for m in share(9, r, 3)) == list(range(9))


def test_the_store_holds_the_seed_weights_where_the_plan_puts_each_chunk() -> None:
    r = _rank(gpu_chunks=1)
    n = r.layout.num_chunks
    assert r.store.gpu.chunks == [0] and sorted(r.store.hosts) == list(range(1, n)) and not r.store.frozen
    assert [s is r.store.gpu for s in map(r.store.shards_of, range(n))] == [True] + [False] * (n - 1)
    weights = _seed_weights()
    for c in range(n):
        master = r.store.shards_of(c).master_of(c)  # [P]: the whole chunk on one rank
        for p, start, at, k in r.store.segments(c):
            flat = weights[r.layout.params[p].names[0]].reshape(-1)
            assert torch.equal(master[at:at + k], flat[start:start + k])
    covered = sum(k for c in range(n) for *_, k in r.store.segments(c))
    assert covered == r.layout.param_numel  # one rank's segments: every element once
    r.bg.close()


def test_a_gather_of_an_offloaded_chunk_waits_for_its_update_and_raises_a_failed_one() -> None:
    r = _rank(gpu_chunks=0)
    mine = torch.empty(r.layout.shard)  # [s]
    r.store.fill(1, mine)
    assert torch.equal(mine, r.store.hosts[1].half) and r.store.counters.take()["h2d"] == mine.nbytes
    r.store.hosts[1].ready.clear()  # an update in flight that fails before it writes the half copy
    r.bg.updater.submit(lambda: 1 / 0, None, threading.Event())
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        r.store.fill(1, mine)
    r.bg.close()


@pytest.mark.parametrize("checkpointing, blocks", [(True, None), (False, 7)])
def test_a_training_pass_flushes_each_chunk_once_per_run_and_its_gradients_are_autograds(
        checkpointing: bool, blocks: int | None) -> None:
    """Every chunk's gradient runs are flushed (the tied embedding's two), nothing of the pass is left over, and
    the gradient shards hold the whole model's gradients of the loss times the pass's factor (with the fewest
    blocks, kept graphs find their chunks again after eviction)."""
    r = _rank(blocks=blocks, checkpointing=checkpointing)
    assert blocks is None or blocks == r.layout.min_blocks
    flushed: list[int] = []
    flush = r.unit_pass.flush
    r.unit_pass.flush = lambda c, st: flushed.append(c) or flush(c, st)
    batches, factor = _batches(), 0.25
    st = r.unit_pass.begin(True, 0, batches, factor, r.updates.take_updated())
    r.unit_pass.run(st)
    assert sorted(flushed) == sorted(c for c, k in r.unit_pass.runs().items() for _ in range(k))
    assert max(r.unit_pass.runs().values()) == 2  # the embedding tied to the head: two runs, one flush each
    assert st.flushed == r.unit_pass.runs() and not (st.graphs or st.bound or st.dys or st.logs)
    assert not st.acts if checkpointing else sorted(st.acts) == [(u, m) for u in (1, 2) for m in (0, 1)]  # (kept
    # graphs: a unit's input stays beside its graph until the pass ends)
    loss, expected = _reference_grads(batches, factor)
    assert float(st.loss_sum) == pytest.approx(loss, rel=1e-6)
    for i, p in enumerate(r.layout.params):
        got = torch.cat([r.store.gpu.grad_of(c)[seg.offset:seg.offset + seg.numel] for c, seg in r.layout.pieces[i]])
        torch.testing.assert_close(got.view(p.shape), expected[p.names[0]], atol=1e-6, rtol=1e-5)
    sumsq = sum(float((g.float() ** 2).sum()) for g in expected.values())
    assert r.grads.take_sumsq() == pytest.approx(sumsq, rel=1e-5)
    r.bg.close()


def test_an_evaluation_pass_flushes_nothing_and_keeps_no_activations() -> None:
    r = _rank(blocks=7)
    r.unit_pass.flush = lambda c, st: pytest.fail("an evaluation flushed a gradient")
    st = r.unit_pass.begin(False, 0, _batches(3), 1.0, None)
    with torch.no_grad():
        r.unit_pass.run(st)
    loss, _ = _reference_grads(_batches(3), 1.0)
    assert float(st.loss_sum) == pytest.approx(loss, rel=1e-6) and not st.acts and not st.flushed
    assert st.gather_wait_s > 0 and sorted(st.computed.stats(0, 1)) != []
    r.bg.close()


def _flush_all(r: Rank, st: PassState, chunks: list[int]) -> None:
    """Each of ``chunks``' runs flushed with a gradient of ones."""
    for c in chunks:
        for _ in range(r.unit_pass.runs()[c]):
            r.grads.get(c).fill_(1.0)
            r.updates.flush(c, st)


@pytest.mark.parametrize("barrier", [False, True])
def test_an_offloaded_chunk_is_updated_when_its_gradient_is_down_or_after_the_norm(barrier: bool) -> None:
    r = _rank(gpu_chunks=1, barrier=barrier)
    host, before = r.store.hosts[2], r.store.hosts[2].shards.master.clone()
    st = r.unit_pass.begin(True, 0, _batches(), 1.0, None)
    r.cache.end()
    st.lr = 1e-2
    _flush_all(r, st, [2])  # (one run: no other unit uses block 0's attention)
    assert [c for c, _ in st.arrived] == [2] and torch.equal(host.shards.grad, torch.ones_like(host.shards.grad))
    r.bg.sync()
    assert torch.equal(host.shards.master, before) == barrier  # no barrier: updated during the backward
    norm, skipped = r.updates.end_step(st, 1e-2, r.grads.take_sumsq())
    r.bg.sync()
    assert not skipped and norm == pytest.approx(host.shards.grad.numel() ** 0.5)
    assert not torch.equal(host.shards.master, before) and host.ready.is_set()
    assert torch.equal(host.half, host.shards.master)  # fp32 sync: gathers upload the master itself
    r.bg.close()


def test_the_step_end_updates_the_gpu_shards_and_the_next_pass_takes_its_event_once() -> None:
    r = _rank()
    before = r.store.gpu.master.clone()
    st = r.unit_pass.begin(True, 0, _batches(), 1.0, None)
    r.cache.end()
    _flush_all(r, st, list(range(r.layout.num_chunks)))
    r.updates.end_step(st, 1e-2, r.grads.take_sumsq())
    assert not torch.equal(r.store.gpu.master, before) and r.rule.optimizer_step == 1
    assert r.updates.take_updated() is None and r.updates.take_updated() is None  # (CPU: no events)
    r.bg.close()


def test_newest_puts_the_masters_in_the_compute_copies_meanwhile() -> None:
    r = _rank(gpu_chunks=1, delayed=True)
    for shards in r.store.all_shards():
        shards.master.add_(1.0)  # the newest weights, one update ahead of the compute copies
    with r.updates.newest():
        assert all(torch.equal(s.compute, s.master) for s in r.store.all_shards())
    assert not any(torch.equal(s.compute, s.master) for s in r.store.all_shards())
    r.bg.close()


def test_owners_write_contiguous_runs_and_an_adapter_with_its_weight() -> None:
    params = [ParamInfo((f"u{u}.w.weight",), (100,), (u,), decay=True) for u in range(4)]
    params.insert(1, ParamInfo(("u3.w.lora_A",), (10,), (3,), decay=False))  # an adapter of a later layer
    layout = build_layout(params, 4, chunk_size=256, world=2, align=16)
    assert owners(layout, 2) == [0, 1, 0, 1, 1]
    assert owners(layout, 1) == [0] * 5


def test_the_rank_state_of_one_rank_holds_every_weight_and_its_moments() -> None:
    r = _rank(gpu_chunks=1, delayed=True)
    state = ZeroCheckpoint(r.store, 1, r.rule, MODEL)
    weights = _seed_weights()
    got = state.rank_state(with_moments=True)
    assert got.moments == {} and got.optimizer_step == 0  # no update yet: no moments
    for name, w in weights.items():
        assert torch.equal(got.weights[name], w) and torch.equal(got.compute[name], w)
    assert torch.equal(got.weights["head.lm_head.weight"], weights["embed.wte.weight"])  # the tied name too
    for shards in r.store.all_shards():  # one AdamW of every shard
        shards.grad.fill_(1.0)
        shards.step(1e-2, 1.0)
    r.rule.optimizer_step = 1
    got = state.rank_state(with_moments=True)
    moved = [n for n in weights if not torch.equal(got.weights[n], weights[n])]
    assert moved and all(torch.equal(got.compute[n], weights[n]) for n in weights)  # the compute copy stayed
    assert set(got.moments) == {p.names[0] for p in r.layout.params}
    r.bg.close()


def _resume(delayed: bool, compute: dict | None) -> SimpleNamespace:
    return SimpleNamespace(optimizer_step=0, scaler={"scale": 1.0, "clean_steps": 0}, delayed=delayed, moments=lambda names, mc: {},
                           compute_weights=lambda names, mc: compute)


@pytest.mark.parametrize("engine_delayed, checkpoint_delayed, said", [  # (a ResumeState's fields used)
    (False, True, SYNC_FROM_DELAYED), (True, False, DELAYED_FROM_SYNC), (False, False, None), (True, True, None)])
def test_loading_a_checkpoint_of_either_update_rule_says_what_it_does(engine_delayed: bool,
                                                                      checkpoint_delayed: bool, said: str | None) -> None:
    r = _rank(gpu_chunks=1, delayed=engine_delayed)
    weights = {k: torch.full_like(v, 0.5) for k, v in _seed_weights().items()}
    state = ZeroCheckpoint(r.store, 1, r.rule, MODEL)
    assert state.load_state(_resume(checkpoint_delayed, weights if checkpoint_delayed else None)) == said
    if engine_delayed:  # the compute copies took the checkpoint's compute weights, or kept the masters
        for c in range(r.layout.num_chunks):
            compute, master = r.store.shards_of(c).compute_of(c), r.store.shards_of(c).master_of(c)
            for _, _, at, k in r.store.segments(c):
                assert torch.equal(compute[at:at + k], torch.full((k,), 0.5) if checkpoint_delayed else
                                   master[at:at + k])
    r.bg.close()
