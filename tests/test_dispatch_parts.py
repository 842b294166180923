"""The pieces both pipeline dispatchers share (scheduler/dispatch_thread.py, scheduler/messages.py) and the
parts of each that run without workers around them; the dispatchers whole: the exactness tests
(tests/test_pipeline*.py, tests/test_round_robin_runtime.py) and tests/test_traffic.py."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from partition.schedule import Action, Kind, PipelineOptions, build_schedule
from partition.schedule.roundrobin_actions import Cuts, build_round_robin
from scheduler.dispatch_thread import Background, copy_after, dispatch_action, event_now, traced
from scheduler.links import LocalLink
from scheduler.messages import Messages, StageMessages
from scheduler.roundrobin_step import ready_version
from scheduler.trace import ComputeSpans, DispatchTime, StepTrace

CPU = torch.device("cpu")


def test_a_failed_job_is_raised_by_its_future_and_by_check_naming_what_failed() -> None:
    wake = threading.Condition()
    bg = Background(CPU, threads=("upload",), what="a copy failed", wake=wake)
    woken: list[bool] = []

    def waiter() -> None:
        with wake:
            woken.append(wake.wait_for(lambda: bg.failure is not None, timeout=10))

    t = threading.Thread(target=waiter)
    t.start()
    first = bg.submit("upload", lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        first.result()
    t.join()
    bg.submit("upload", lambda: [][1]).exception()  # a later failure is not the one raised
    with pytest.raises(RuntimeError, match="a copy failed: ZeroDivisionError") as raised:
        bg.check()
    assert isinstance(raised.value.__cause__, ZeroDivisionError) and woken == [True]
    assert bg.submit("upload", lambda x: x + 1, 41).result() == 42
    bg.close()


def test_sync_waits_for_the_cpu_updates_and_raises_a_failed_ones() -> None:
    bg = Background(CPU)
    done, ran = threading.Event(), []
    bg.updater.submit(lambda: ran.append(1) or 0, None, done)
    bg.sync()
    assert ran == [1] and done.is_set()
    bg.updater.submit(lambda: 1 / 0, None, threading.Event())
    with pytest.raises(RuntimeError, match="a CPU update failed"):
        bg.sync()
    bg.close()


def test_a_copy_on_the_cpu_runs_at_once_as_one_span_of_the_trace() -> None:
    trace = StepTrace(CPU)
    dst, src = torch.zeros(4), torch.arange(4.0)
    out, done = copy_after(None, None, lambda: dst.copy_(src), trace, "d2h", "D3")
    assert out is dst and torch.equal(dst, src) and done is None and event_now(CPU) is None
    with traced(None, "h2d", "nothing"):  # no trace: no span
        pass
    (track, name, start, end), = trace.spans
    assert (track, name) == ("d2h", "D3") and start <= end


def test_each_action_is_timed_and_traced_on_its_track() -> None:
    computed = ComputeSpans(CPU)
    clock, trace = DispatchTime(computed), StepTrace(CPU)

    def compute(a: Action) -> None:
        start = computed.mark()
        computed.add("forward", start, "F", a.stage)

    def held(a: Action) -> None:
        clock.held_since(time.perf_counter() - 0.05)  # 50 ms of waiting: not the thread's own time

    dispatch_action(compute, Action(Kind.FORWARD, 1, 0), computed, clock, trace)
    t0, t1, own = dispatch_action(held, Action(Kind.UPLOAD, 2), computed, clock, trace)
    assert [(s[0], s[1]) for s in trace.spans] == [("compute", "F1,0"), ("dispatch", "Uf2")]
    assert own < t1 - t0 and computed.last is None


def test_messages_are_tagged_apart_and_carry_an_moes_router_choices() -> None:
    """Every message of a step has its own tag (kind, sender, micro-batch); a receive posted early is not
    posted again; a message taken leaves its router choices for the backward."""
    sched = build_schedule(3, 1, 2, [0, 0, 0], PipelineOptions())
    link = LocalLink()
    msg = Messages((1, 2, 3), torch.float32, trailer=2)
    mail = StageMessages({0: link}, msg, SimpleNamespace(experts=2))
    st = SimpleNamespace(sched=sched, waiting={}, outputs={}, choices={}, clock=DispatchTime(ComputeSpans(CPU)),
                         routed=None)
    tags = {StageMessages._tag(st, kind, sender, m) for kind in "ag" for sender in range(3) for m in range(2)}
    assert len(tags) == 12
    act, counts = torch.ones(1, 2, 3), torch.tensor([3.0, 5.0])
    st.outputs[("a", 0, 1)] = mail.pack(act, counts)
    mail.recv(st, Action(Kind.RECV_ACT, 1, 1, peer=0))
    posted = st.waiting[("a", 1, 1)]
    mail.recv(st, Action(Kind.RECV_ACT, 1, 1, peer=0))
    assert st.waiting[("a", 1, 1)] is posted
    mail.send(st, Action(Kind.SEND_ACT, 0, 1, peer=0))
    assert torch.equal(mail.take(st, "a", 1, 1), act) and torch.equal(st.choices[("a", 1, 1)], counts)
    assert StageMessages({0: link}, msg, None).so_far(st, 1, 1, None, CPU) is None  # a dense model: none


def test_a_receive_names_its_sender_by_the_schedules_producer() -> None:
    """The swapped pipeline's gradient comes from the stage after; the round-robin's from the op before."""
    pipe = build_schedule(3, 3, 2, [0, 1, 2], PipelineOptions())
    robin = build_round_robin(Cuts((0, 2, 4), (0, 2, 4), 5), 2, 4, 1, PipelineOptions(), False)
    assert (pipe.producer(1, False), pipe.producer(1, True)) == (0, 2)
    assert (robin.producer(3, False), robin.producer(3, True)) == (2, 2)


def test_an_upload_reads_the_update_before_the_previous_one_under_delayed() -> None:
    assert ready_version(5, delayed=False) == 5 and ready_version(5, delayed=True) == 4


# ---- the swapped pipeline's slots and step end, on one CPU worker ---------------------------------------------
class _Arbiter:
    """Root-complex arbitration with no other worker: it only counts."""

    peers: list[int] = []

    def __init__(self) -> None:
        self.held = 0

    def acquire(self, order: int) -> None:
        self.held += 1

    def release(self) -> None:
        self.held = 0


def _swapped_worker(options: PipelineOptions = PipelineOptions()):
    """A tiny GPT-2 in two swapped stages on one CPU worker: its slots, its step end and a fresh step."""
    from mobius.config import TrainSection
    from mobius.models.gpt2 import GPT2Config
    from mobius.models.params import build_units
    from scheduler.counters import Counters
    from scheduler.executor_state import ExecutorOptions, StepIO, StepState
    from scheduler.stage_swaps import StageSwaps
    from scheduler.stage_updates import StageUpdates
    from scheduler.stages import stage_layouts
    from scheduler.stage_store import StageStore
    from mobius.optim import UpdateRule

    cfg = GPT2Config(vocab_size=320, n_positions=64, n_embd=64, n_layer=2, n_head=2)
    layouts = stage_layouts(cfg, [0, 2, 4])
    hosts = {j: StageStore(layouts[j], torch.bfloat16, TrainSection()) for j in (0, 1)}
    for j, h in hosts.items():
        h.half.copy_(torch.randn(h.half.numel(), generator=torch.Generator().manual_seed(j)))
    units = {j: build_units(cfg, lay.first_unit, lay.end_unit) for j, lay in enumerate(layouts)}
    opts = ExecutorOptions(options, "bf16", torch.bfloat16, (2, 16, 64))
    bg, counters = Background(CPU, threads=("upload",), streams=("copy", "d2h")), Counters()
    swaps = StageSwaps(CPU, layouts, hosts, {}, units, opts, _Arbiter(), counters, bg)
    collectives = SimpleNamespace(reduce=lambda stats: stats, exchange=None)
    updates = StageUpdates(0, layouts, hosts, {}, {}, swaps, counters, collectives, UpdateRule(TrainSection()), opts,
                           bg)
    sched = build_schedule(2, 1, 1, [0, 0], options)
    st = StepState(StepIO([], 0, 1.0, None, lr=1e-3), sched, {}, StepTrace(CPU), 0, computed=ComputeSpans(CPU))
    st.clock = DispatchTime(st.computed)
    return SimpleNamespace(hosts=hosts, layouts=layouts, swaps=swaps, updates=updates, st=st, counters=counters,
                           bg=bg)


def test_an_upload_fills_a_free_slot_on_the_upload_thread_and_binds_the_stage_to_it() -> None:
    w = _swapped_worker()
    n = w.layouts[1].numel
    w.swaps.upload(w.st, Action(Kind.UPLOAD, 1, phase="f"))
    slot = w.swaps.on_device(w.st, 1, grads=False)
    assert torch.equal(slot.params[:n], w.hosts[1].half) and slot.bound == (1, "infer")
    assert w.counters.take()["h2d"] == n * 2 and [s[:2] for s in w.st.trace.spans] == [("h2d", "U1")]
    w.swaps.free(w.st, Action(Kind.FREE, 1, phase="f"))
    assert slot.stage is None and 1 not in w.swaps.slot_of
    w.bg.close()


def test_a_failed_upload_is_raised_where_the_stage_is_next_needed() -> None:
    w = _swapped_worker()
    w.hosts[0].upload_pieces = lambda lo, hi: 1 / 0
    w.swaps.upload(w.st, Action(Kind.UPLOAD, 0, phase="f"))
    with pytest.raises(RuntimeError, match="a background task failed: ZeroDivisionError"):
        w.swaps.on_device(w.st, 0, grads=False)
    assert w.swaps.arbiter.held == 0  # released: the other workers' uploads go on
    w.bg.close()


def test_a_boundary_input_goes_to_host_memory_and_comes_back_before_its_backward() -> None:
    w = _swapped_worker(PipelineOptions(offload_inputs=True))
    x = torch.randn(2, 16, 64)
    w.st.saved[(1, 0)] = x
    w.swaps.offload(w.st, Action(Kind.OFFLOAD, 1, 0))
    assert w.st.saved[(1, 0)][0] == "host"
    w.swaps.reload(w.st, Action(Kind.RELOAD, 1))
    w.swaps.inputs_back(w.st, 1)
    assert torch.equal(w.st.saved[(1, 0)], x) and w.counters.take() == {"h2d": x.nbytes, "d2h": x.nbytes,
                                                                        "p2p": 0, "overflow": 0}
    w.bg.close()


def test_a_download_brings_the_sums_down_and_the_update_runs_on_the_optimizer_thread() -> None:
    w = _swapped_worker()
    t = w.layouts[1].trainable_numel
    w.swaps.upload(w.st, Action(Kind.UPLOAD, 1, phase="f"))
    slot = w.swaps.on_device(w.st, 1, grads=True)
    slot.sums[:t] = torch.linspace(-1, 1, t)
    master = w.hosts[1].master.clone()
    w.updates.download(w.st, Action(Kind.DOWNLOAD, 1))
    assert torch.equal(w.hosts[1].grads_in, slot.sums[:t]) and w.st.head_down.is_set()
    assert float(w.st.sumsq[0]) == pytest.approx(float(torch.dot(slot.sums[:t], slot.sums[:t])))
    w.updates.update(w.st, Action(Kind.UPDATE, 1))
    w.updates.sync()
    assert w.hosts[1].updates_run == 1 and not torch.equal(w.hosts[1].master, master)
    w.updates.reduce(w.st, Action(Kind.REDUCE))
    assert w.st.outcome.stats["d2h_bytes"] == t * 4 and w.st.outcome.grad_norm > 0
    w.bg.close()


# ---- the round-robin's gradient sums ---------------------------------------------------------------------------
def test_a_steps_rounds_sum_into_the_host_sum_in_order_a_middle_one_through_the_staging_buffer() -> None:
    """Three rounds of one op: the first comes straight into the host sum, the middle one into the staging buffer,
    which the summing thread adds after the first; the last is the step's total (its upload brought the earlier
    rounds up), straight into the host sum, whose share of the norm it counts. Each frees its slot once read."""
    from scheduler.counters import Counters
    from scheduler.roundrobin_updates import OpUpdates
    from scheduler.roundrobin_host import Span

    n, host_sum = 5, torch.zeros(5)
    stores = SimpleNamespace(grad=lambda index: host_sum, version=torch.zeros(1, dtype=torch.int64),
                             summed=torch.zeros(1, dtype=torch.int64), delayed=False, optimizers=[])
    bg, slot_of, released = Background(CPU, threads=("download", "sum")), {}, []
    ups = OpUpdates(stores, [Span(0, 1, 0, n, 0, n)], {}, None, (0, 1), False, Counters(), {}, bg, slot_of,
                    lambda dst, src, ready, trace, name: dst.copy_(src),
                    lambda index, k, q, compute: released.append((index, k, q, compute)))
    st = SimpleNamespace(index=0, sched=SimpleNamespace(rounds=3, tie_readers=()), trace=None, downloaded={}, d2h=[],
                         sumsq=0.0)
    for q, (value, want) in enumerate([(1.0, 1.0), (2.0, 3.0), (4.0, 4.0)]):
        slot_of[(0, 0, q)] = SimpleNamespace(sums=torch.full((n,), value))
        ups.download(st, Action(Kind.DOWNLOAD, 0, round=q))
        for f in st.d2h:
            f.result()
        assert torch.equal(host_sum, torch.full((n,), want)) and int(stores.summed[0]) == q + 1, q
    assert st.sumsq == n * 16.0 and released == [(0, 0, q, False) for q in range(3)]
    bg.close()
