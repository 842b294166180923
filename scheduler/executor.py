"""The dispatcher: executes one worker's action list on a compute stream, a copy thread with its
own stream for uploads, a download stream, and a CPU optimizer thread.

Device memory holds two *slots* (the running stage and the prefetched one), each with the stage's
half-precision parameters and their gradients; the boundary activations of the stages in flight;
nothing else. Uploads are cut into chunks served in stage order per root complex
(:class:`~scheduler.comm.UploadArbiter`). A stage's parameters live in its slot as views, so the
unit modules (built once on the meta device) compute on whatever slot holds them.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from mobius.engine import autocast
from mobius.models import ModelConfig
from mobius.models.base import lm_loss, run_units
from scheduler.comm import Counters, UploadArbiter
from scheduler.schedule import Action, Schedule
from scheduler.stages import StageLayout, bind, build_units
from scheduler.store import HostStage

log = logging.getLogger(__name__)
UPLOAD_CHUNK = 64 << 20  # bytes per arbitrated upload chunk


class StepTrace:
    """Spans of one step's work on the simulator's tracks (compute, h2d, d2h, cpu): CUDA events on
    the GPU (turned into times once the step has finished), ``perf_counter`` otherwise."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.t0 = time.perf_counter()
        self.spans: list[tuple[str, str, object, object]] = []
        self.lock = threading.Lock()
        if self.cuda:
            self.ref = torch.cuda.Event(enable_timing=True)
            self.ref.record(torch.cuda.current_stream(device))

    def mark(self, stream: "torch.cuda.Stream | None" = None) -> object:
        if self.cuda and stream is not None:
            e = torch.cuda.Event(enable_timing=True)
            e.record(stream)
            return e
        return time.perf_counter()

    def add(self, track: str, name: str, start: object, end: object) -> None:
        with self.lock:
            self.spans.append((track, name, start, end))

    def _seconds(self, m: object) -> float:
        if isinstance(m, float):
            return m - self.t0
        return self.ref.elapsed_time(m) / 1e3

    def events(self, pid: int) -> list[dict]:
        """Chrome-trace events (call after the step's work has finished)."""
        tracks = ["compute", "h2d", "d2h", "p2p", "cpu"]
        out = [{"name": "thread_name", "ph": "M", "pid": pid, "tid": t, "args": {"name": n}}
               for t, n in enumerate(tracks)]
        for track, name, a, b in self.spans:
            start, end = self._seconds(a), self._seconds(b)
            out.append({"name": name, "ph": "X", "ts": start * 1e6, "dur": max(0.0, end - start) * 1e6, "pid": pid,
                        "tid": tracks.index(track)})
        return out


class DeviceSlot:
    """One stage's worth of device memory: parameters, gradients (and an fp32 accumulator)."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, accumulate_fp32: bool):
        self.params = torch.empty(numel, dtype=dtype, device=device)
        self.grads = torch.zeros(numel, dtype=dtype, device=device)
        self.acc = torch.zeros(numel, dtype=torch.float32, device=device) if accumulate_fp32 else None
        self.stage: int | None = None
        self.ready = threading.Event()
        self.ready_event: torch.cuda.Event | None = None  # upload finished (CUDA)
        self.released: torch.cuda.Event | None = None  # last use finished (CUDA); uploads wait on it
        self.grads_live = False  # gradients zeroed for this residency
        self.bound: tuple[int, bool] | None = None  # (stage, with gradients) the modules point here for


@dataclass
class StepIO:
    inputs: list[torch.Tensor]  # per micro-batch token ids [B, T]
    targets: list[torch.Tensor]  # per micro-batch targets [B, T]
    step: int
    loss_factor: float  # loss scale / micro-batches
    dropout_seed: int | None  # the run's seed when dropout is active
    lr: float = 0.0


@dataclass
class StepLocal:
    """What one worker saw in a step (reduced across workers by the engine)."""

    loss_sum: torch.Tensor | float = 0.0  # on the device until the step ends (no sync per micro-batch)
    losses: int = 0
    stall_s: float = 0.0  # compute stream idle waiting for stage data (GPU events; host time on the CPU)
    wait_s: float = 0.0  # host blocked waiting for uploads (which wait for the stage's CPU update)
    downloads: dict[int, Future] = field(default_factory=dict)  # stage -> its gradient arrival on the host
    sumsq: list[torch.Tensor] = field(default_factory=list)  # per stage, on the device


class Executor:
    def __init__(self, rank: int, device: torch.device, model_cfg: ModelConfig, layouts: list[StageLayout],
                 hosts: dict[int, HostStage], train_dtype: torch.dtype, precision: str, links: dict,
                 arbiter: UploadArbiter, counters: Counters, activation_shape: tuple[int, ...], num_slots: int = 2):
        self.rank, self.device, self.cfg = rank, device, model_cfg
        self.layouts, self.hosts, self.dtype, self.precision = layouts, hosts, train_dtype, precision
        self.links, self.arbiter, self.counters = links, arbiter, counters
        self.act_shape = activation_shape  # [B, T, H]
        self.num_units = layouts[-1].end_unit
        self.units = {j: build_units(model_cfg, layouts[j].first_unit, layouts[j].end_unit) for j in hosts}
        numel = max(layouts[j].numel for j in hosts)
        acc = train_dtype != torch.float32
        self.slots = [DeviceSlot(numel, train_dtype, device, acc) for _ in range(num_slots)]
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(device)
            self.d2h_stream = torch.cuda.Stream(device)
        self.copier = ThreadPoolExecutor(1, thread_name_prefix="upload")
        self.optim = ThreadPoolExecutor(1, thread_name_prefix="cpu-adam")
        self.skip: dict[int, tuple[int, int]] = {}  # stage -> tied range (offset, numel) kept out of its sumsq
        self.immediate = False  # update each stage as soon as its gradients arrive (no clipping, no fp16)
        self.failure: BaseException | None = None
        self.offload_inputs = False  # boundary inputs wait for their backward in host memory
        self.update_s = 0.0  # time the optimizer thread spent in AdamW (read and reset by the engine)
        self.trace: StepTrace | None = None  # set for the one step being traced
        self.skip_updates = False  # ablation for benchmarks: no AdamW (measures the GPU side alone)
        self.last_mine = max(hosts)  # this worker's last forward stage: its backward follows at once
        self.slot_of: dict[int, DeviceSlot] = {}
        self.uploads: list[Future] = []
        self.stall_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.order_base = 0

    # ---- the dispatch loop ----------------------------------------------------------------------
    def run(self, sched: Schedule, io: StepIO, train: bool) -> StepLocal:
        self.io, self.sched, self.train, self.local = io, sched, train, StepLocal()
        self.batches = self._stage_batches(sched, io)
        self.saved: dict[tuple[int, int], torch.Tensor] = {}
        self.outputs: dict[tuple[str, int, int], torch.Tensor] = {}
        self.waiting: dict[tuple[str, int, int], object] = {}
        handlers = {"upload": self._upload, "free": self._free, "forward": self._forward, "fb": self._fb,
                    "backward": self._backward, "recv_act": self._recv, "recv_grad": self._recv,
                    "send_act": self._send, "send_grad": self._send, "download": self._download,
                    "update": lambda a: None}
        stream = torch.cuda.current_stream(self.device) if self.cuda else None
        for action in sched.actions[self.rank]:
            if self.trace is not None and action.kind in ("forward", "fb", "backward"):
                start = self.trace.mark(stream)
                handlers[action.kind](action)
                self.trace.add("compute", str(action), start, self.trace.mark(stream))
            else:
                handlers[action.kind](action)
        for link in self.links.values():
            link.flush()
        for f in self.uploads:
            f.result()
        self.uploads.clear()
        if self.cuda:
            torch.cuda.synchronize(self.device)
            self.local.stall_s += sum(a.elapsed_time(b) for a, b in self.stall_events) / 1e3
            self.stall_events.clear()
        self.local.loss_sum = float(self.local.loss_sum)
        return self.local

    # ---- swaps ----------------------------------------------------------------------------------
    def _upload(self, a: Action) -> None:
        slot = next(s for s in self.slots if s.stage is None)
        slot.stage, slot.grads_live, slot.bound = a.stage, False, None
        slot.ready.clear()
        self.slot_of[a.stage] = slot
        order = self.order_base + self.sched.upload_order[(a.stage, a.phase)]
        self.uploads.append(self.copier.submit(self._upload_job, a.stage, slot, order, a.phase))

    def _upload_job(self, j: int, slot: DeviceSlot, order: int, phase: str) -> None:
        if self.cuda:
            torch.cuda.set_device(self.device)  # this thread's current device
        try:
            self._upload_copy(j, slot, order)
            if phase == "b":
                self._reload_inputs(j, slot)
        except BaseException as e:  # surfaced by check() on the compute thread
            self.failure = self.failure or e
            self.arbiter.release()
        finally:
            slot.ready.set()

    def check(self) -> None:
        """Raise on the compute thread what failed on a background thread (uploads, CPU updates)."""
        if self.failure is not None:
            raise RuntimeError(f"a background task failed: {type(self.failure).__name__}: {self.failure}") \
                from self.failure

    def _upload_copy(self, j: int, slot: DeviceSlot, order: int) -> None:
        host = self.hosts[j]
        host.updated.wait()  # the CPU update of the previous step has written this stage's copy
        if self.failure is not None:
            raise RuntimeError("not uploading after an earlier failure")
        n = host.layout.numel
        src, dst = host.half[:n], slot.params[:n]
        step = max(1, UPLOAD_CHUNK // src.element_size())
        start = self.trace.mark(self.copy_stream if self.cuda else None) if self.trace is not None else None
        if self.cuda:
            with torch.cuda.stream(self.copy_stream):
                if slot.released is not None:
                    self.copy_stream.wait_event(slot.released)
                if start is not None:
                    start = self.trace.mark(self.copy_stream)
                for lo in range(0, n, step):
                    self.arbiter.acquire(order)
                    dst[lo:lo + step].copy_(src[lo:lo + step], non_blocking=True)
                    if self.arbiter.peers:
                        self.copy_stream.synchronize()  # the next chunk is arbitrated again
                slot.ready_event = torch.cuda.Event()
                slot.ready_event.record(self.copy_stream)
        else:
            self.arbiter.acquire(order)
            dst.copy_(src)
        self.arbiter.release()
        self.counters.add(h2d=n * src.element_size())
        if start is not None:
            self.trace.add("h2d", f"U{j}", start, self.trace.mark(self.copy_stream if self.cuda else None))

    def _offload_input(self, x: torch.Tensor) -> tuple:
        """A stage's boundary input goes to pinned host memory until its backward."""
        self.counters.add(d2h=x.nbytes)
        if not self.cuda:
            return ("host", x.clone(), None)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.d2h_stream):
            self.d2h_stream.wait_event(ready)
            host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
            host.copy_(x, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.d2h_stream)
        x.record_stream(self.d2h_stream)  # its memory is reused only after the copy has read it
        return ("host", host, done)

    def _reload_inputs(self, j: int, slot: DeviceSlot) -> None:
        """(Copy thread) bring stage j's offloaded inputs back with its backward upload."""
        for m in range(self.sched.micro_batches):
            entry = self.saved.get((j, m))
            if not isinstance(entry, tuple):
                continue
            _, host, done = entry
            self.counters.add(h2d=host.nbytes)
            if self.cuda:
                with torch.cuda.stream(self.copy_stream):
                    self.copy_stream.wait_event(done)
                    dev = host.to(self.device, non_blocking=True)
                    dev.record_stream(torch.cuda.current_stream(self.device))
            else:
                dev = host.clone()
            self.saved[(j, m)] = dev
        if self.cuda:  # the compute stream waits for the inputs too
            slot.ready_event = torch.cuda.Event()
            slot.ready_event.record(self.copy_stream)

    def _free(self, a: Action) -> None:
        slot = self.slot_of.pop(a.stage)
        if self.cuda and slot.released is None:
            slot.released = torch.cuda.Event()
            slot.released.record(torch.cuda.current_stream(self.device))
        slot.stage = None

    def _resident(self, j: int, grads: bool) -> DeviceSlot:
        """Wait for stage j's upload (counting the stall) and bind its modules to its slot."""
        slot = self.slot_of[j]
        if not slot.ready.is_set():
            t0 = time.perf_counter()
            slot.ready.wait()
            self.local.wait_s += time.perf_counter() - t0
            if not self.cuda:
                self.local.stall_s += time.perf_counter() - t0
        self.check()
        if self.cuda and slot.ready_event is not None:
            before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            stream = torch.cuda.current_stream(self.device)
            before.record(stream)
            stream.wait_event(slot.ready_event)
            after.record(stream)
            self.stall_events.append((before, after))
            slot.ready_event = None
            slot.released = None
        n = self.layouts[j].numel
        if grads and not slot.grads_live:
            slot.grads[:n].zero_()
            if slot.acc is not None:
                slot.acc[:n].zero_()
            slot.grads_live = True
        if slot.bound != (j, grads):
            bind(self.units[j], self.layouts[j], self.num_units, slot.params[:n], slot.grads[:n] if grads else None)
            slot.bound = (j, grads)
        return slot

    # ---- compute --------------------------------------------------------------------------------
    def _run(self, j: int, x: torch.Tensor, m: int) -> torch.Tensor:
        lay = self.layouts[j]
        seed = (self.io.dropout_seed, self.io.step, m) if self.io.dropout_seed is not None else None
        return run_units(list(self.units[j]), x, lay.first_unit, dropout_seed=seed)

    def _input(self, j: int, m: int) -> torch.Tensor:
        if j == 0:
            return self.batches["inputs"][m]
        return self.waiting.pop(("a", j, m))()

    def _forward(self, a: Action) -> None:
        j, m = a.stage, a.micro
        self._resident(j, grads=False)
        x = self._input(j, m)
        with torch.no_grad(), autocast(self.device, self.precision):
            y = self._run(j, x, m)
            if j == self.sched.num_stages - 1:  # evaluation: the last stage's forward ends in the loss
                self._count_loss(lm_loss(y, self.batches["targets"][m]))
                return
        if self.train:
            offload = self.offload_inputs and x.is_floating_point() and j != self.last_mine
            self.saved[(j, m)] = self._offload_input(x) if offload else x
        self.outputs[("a", j, m)] = y.to(self.dtype)

    def _fb(self, a: Action) -> None:
        """Last stage: forward, loss and backward of one micro-batch (no recompute)."""
        j, m = a.stage, a.micro
        slot = self._resident(j, grads=True)
        x = self._input(j, m)
        if x.is_floating_point():
            x = x.detach().requires_grad_()
        with autocast(self.device, self.precision):
            loss = lm_loss(self._run(j, x, m), self.batches["targets"][m])
        (loss * self.io.loss_factor).backward()
        self._count_loss(loss.detach())
        self._accumulate(slot, j)
        if j > 0:
            self.outputs[("g", j, m)] = x.grad

    def _backward(self, a: Action) -> None:
        """Recompute the stage's forward from its saved input, then backpropagate."""
        j, m = a.stage, a.micro
        slot = self._resident(j, grads=True)
        x = self.saved.pop((j, m))
        g = self.waiting.pop(("g", j, m))()
        if x.is_floating_point():
            x = x.detach().requires_grad_()
        with autocast(self.device, self.precision):
            y = self._run(j, x, m)
        torch.autograd.backward(y, g.to(y.dtype))
        self._accumulate(slot, j)
        if j > 0:
            self.outputs[("g", j, m)] = x.grad

    def _accumulate(self, slot: DeviceSlot, j: int) -> None:
        if slot.acc is not None:
            n = self.layouts[j].numel
            slot.acc[:n].add_(slot.grads[:n])
            slot.grads[:n].zero_()

    def _count_loss(self, loss: torch.Tensor) -> None:
        self.local.loss_sum = self.local.loss_sum + loss.detach().float()
        self.local.losses += 1

    def _stage_batches(self, sched: Schedule, io: StepIO) -> dict[str, list[torch.Tensor]]:
        """Token ids for stage 0 and targets for the last stage, copied to the device up front
        (pinned, asynchronous: a pageable copy would stall the host every micro-batch)."""
        def put(ts: list[torch.Tensor]) -> list[torch.Tensor]:
            if not self.cuda:
                return ts
            return [t.pin_memory().to(self.device, non_blocking=True) for t in ts]
        mine = set(self.hosts)
        return {"inputs": put(io.inputs) if 0 in mine else [],
                "targets": put(io.targets) if sched.num_stages - 1 in mine else []}

    # ---- transfers ------------------------------------------------------------------------------
    def _tag(self, kind: str, sender_stage: int, m: int) -> int:
        S, M = self.sched.num_stages, self.sched.micro_batches
        return ((0 if kind == "a" else 1) * S + sender_stage) * M + m

    def _recv(self, a: Action) -> None:
        kind = "a" if a.kind == "recv_act" else "g"
        sender = a.stage - 1 if kind == "a" else a.stage + 1
        self.waiting[(kind, a.stage, a.micro)] = self.links[a.peer].recv(
            self.act_shape, self.dtype, self._tag(kind, sender, a.micro))

    def _send(self, a: Action) -> None:
        kind = "a" if a.kind == "send_act" else "g"
        t = self.outputs.pop((kind, a.stage, a.micro))
        self.links[a.peer].send(t.to(self.dtype), self._tag(kind, a.stage, a.micro))

    def _download(self, a: Action) -> None:
        """Gradients of a finished stage to its host buffer; the CPU side takes it from there."""
        j = a.stage
        slot, host, n = self.slot_of[j], self.hosts[j], self.layouts[j].numel
        host.updated.clear()
        src = slot.acc[:n] if slot.acc is not None else slot.grads[:n]  # fp32 either way
        self.local.sumsq.append(self._sumsq(src, self.skip.get(j)))
        done = None
        if self.cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.d2h_stream):
                self.d2h_stream.wait_event(ready)
                start = self.trace.mark(self.d2h_stream) if self.trace is not None else None
                host.grad.copy_(src, non_blocking=True)
                done = torch.cuda.Event()
                done.record(self.d2h_stream)
                if start is not None:
                    self.trace.add("d2h", f"D{j}", start, self.trace.mark(self.d2h_stream))
            slot.released = done  # the slot is reused only after the copy has read it
        else:
            start = time.perf_counter()
            host.grad.copy_(src)
            if self.trace is not None:
                self.trace.add("d2h", f"D{j}", start, time.perf_counter())
        self.counters.add(d2h=n * src.element_size())
        self.local.downloads[j] = self.optim.submit(self._grad_arrived, j, done)

    @staticmethod
    def _sumsq(g: torch.Tensor, skip: tuple[int, int] | None) -> torch.Tensor:
        """Sum of squared gradients (on the device), leaving out a tied range counted elsewhere."""
        if skip is None:
            return torch.dot(g, g)
        a, b = g[:skip[0]], g[skip[0] + skip[1]:]
        return torch.dot(a, a) + torch.dot(b, b)

    def _grad_arrived(self, j: int, done: torch.cuda.Event | None) -> None:
        """(Optimizer thread) the stage's gradients are on the host: with ``immediate`` updates, step."""
        if done is not None:
            done.synchronize()
        if self.immediate and j not in self.skip:
            self.update(j, self.io.lr, 1.0)

    def update(self, j: int, lr: float, grad_factor: float) -> None:
        """(Optimizer thread) AdamW on stage j's master weights; unblocks its next upload."""
        t0 = time.perf_counter()
        trace = self.trace
        try:
            if not self.skip_updates:
                self.hosts[j].update(lr, grad_factor)
            if trace is not None:
                trace.add("cpu", f"O{j}", t0, time.perf_counter())
        except BaseException as e:
            self.failure = self.failure or e
        finally:
            self.update_s += time.perf_counter() - t0
            self.hosts[j].updated.set()

    def close(self) -> None:
        self.copier.shutdown(wait=True)
        self.optim.shutdown(wait=True)
