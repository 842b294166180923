"""The swapped pipeline's device slots and what moves through them: a stage's weights uploaded into a free slot on
the upload thread (after the part a ``PREFETCH`` left in the prefetch buffer), in chunks served in stage order
per root complex; a delayed stage's compute copy queued at its last upload; the head's tied gradient brought up
with stage 0's backward upload; boundary inputs offloaded to host memory and back; and a stage bound to its slot
before it computes."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from partition.schedule import Action
from scheduler.arbiter import UploadArbiter
from scheduler.counters import Counters
from scheduler.device_slot import DeviceSlot
from scheduler.dispatch_thread import Background, copy_after, event_now, traced
from scheduler.executor_state import ExecutorOptions, StepState
from scheduler.roundrobin_host import WAIT_TIMEOUT_S
from scheduler.stages import StageLayout, bind
from scheduler.stage_store import StageStore

UPLOAD_CHUNK = 64 << 20  # bytes per arbitrated upload chunk


@dataclass(frozen=True)
class SlotView:
    """A tensor a kept graph saved that is a view of its stage's slot, by position in the slot."""

    offset: int  # elements from the start of the slot's parameter buffer
    shape: tuple[int, ...]
    stride: tuple[int, ...]


class StageSwaps:
    """A worker's device slots (``num_slots`` taking its swapped stages in turn, and a permanent one per resident
    stage), its prefetch buffer, and the copies into and out of them on the upload thread and the copy and
    download streams (``bg``)."""

    def __init__(self, device: torch.device, layouts: list[StageLayout], hosts: dict[int, StageStore],
                 resident: dict[int, StageStore], units: dict[int, nn.Module], options: ExecutorOptions,
                 arbiter: UploadArbiter, counters: Counters, bg: Background):
        self.device, self.cuda, self.layouts, self.hosts, self.units = device, bg.cuda, layouts, hosts, units
        self.num_units = layouts[-1].end_unit
        self.arbiter, self.counters, self.bg = arbiter, counters, bg
        self.tied = {j: (o, n) for j, o, n in options.tied if j in hosts}
        acc = options.dtype != torch.float32
        numel = max((layouts[j].numel for j in hosts), default=0)
        grad_numel = max((layouts[j].trainable_numel for j in hosts), default=0)
        self.slots = [DeviceSlot(numel, grad_numel, options.dtype, device, acc)
                      for _ in range(options.pipeline.num_slots if hosts else 0)]
        item = torch.empty(0, dtype=options.dtype).element_size()
        prefetch = min(numel, options.pipeline.prefetch_bytes // item) if hosts else 0
        self.buffer = torch.empty(prefetch, dtype=options.dtype, device=device)  # partial prefetch (one slot)
        self.slot_of: dict[int, DeviceSlot] = {}
        for j, store in resident.items():  # permanent slots
            slot = DeviceSlot(layouts[j].numel, layouts[j].trainable_numel, options.dtype, device, acc,
                              params=store.half)
            slot.stage = j
            slot.ready.set()
            self.slot_of[j] = slot

    # ---- uploads -----------------------------------------------------------------------------------
    def prefetch(self, st: StepState, a: Action) -> None:
        """The first elements of stage j's weights into the prefetch buffer (one slot): its UPLOAD,
        once the slot is free, moves them into the slot and copies only the rest."""
        n = min(self.buffer.numel(), self.layouts[a.stage].numel)
        st.prefetched[a.stage] = n
        order = st.order_base + st.sched.upload_order[(a.stage, a.phase)]
        st.uploads.append(self.bg.submit("upload", self._copy_job, st, a.stage, None, order, 0, n))

    def upload(self, st: StepState, a: Action) -> None:
        slot = next(s for s in self.slots if s.stage is None)
        slot.stage, slot.grads_live, slot.bound = a.stage, False, None
        slot.ready.clear()
        self.slot_of[a.stage] = slot
        order = st.order_base + st.sched.upload_order[(a.stage, a.phase)]
        tie_in = st.sched.tie_in and a.stage == 0 and a.phase == "b"
        last = st.sched.train and self.hosts[a.stage].delayed and st.sched.last_uploads[a.stage] == a.phase
        st.uploads.append(self.bg.submit("upload", self._copy_job, st, a.stage, slot, order,
                                         st.prefetched.pop(a.stage, 0), self.layouts[a.stage].numel, tie_in, last))

    def _copy_job(self, st: StepState, j: int, slot: DeviceSlot | None, order: int, lo: int, hi: int,
                  tie_in: bool = False, refresh: bool = False) -> None:
        """(The upload thread) elements ``lo:hi`` of stage j's weights from its host copy: into ``slot``,
        whose first ``lo`` come from the prefetch buffer (a copy on the device); or, without a slot
        (``PREFETCH``, ``lo`` 0), into the prefetch buffer. ``tie_in``: then the head's end of the tied
        weight's gradient into the slot's sums (:meth:`_tied_gradient_in`); ``refresh``: the step's last read
        of a delayed store's compute copy, which then takes the master (:meth:`_refresh_compute`)."""
        try:
            self._copy(st, j, slot, order, lo, hi, tie_in)
            if refresh:
                self._refresh_compute(st, j, slot)
        except BaseException as e:  # surfaced by check() on the dispatch thread
            self.bg.fail(e)
            self.arbiter.release()
        finally:
            if slot is not None:
                slot.ready.set()

    def _copy(self, st: StepState, j: int, slot: DeviceSlot | None, order: int, lo: int, hi: int,
              tie_in: bool = False) -> None:
        host = self.hosts[j]
        host.wait_ready()  # the CPU update of the previous step has written this stage's copy (delayed: the
        # compute copy, taken after the previous step's last upload of the stage)
        if self.bg.failure is not None:
            raise RuntimeError("not uploading after an earlier failure")
        dst, stream = slot.params if slot is not None else self.buffer, self.bg.streams["copy"]
        with torch.cuda.stream(stream) if self.cuda else contextlib.nullcontext():
            if self.cuda and slot is not None and slot.released is not None:
                stream.wait_event(slot.released)
            with traced(st.trace, "h2d", f"{'U' if slot is not None else 'P'}{j}", stream):
                dst[:lo].copy_(self.buffer[:lo], non_blocking=self.cuda)  # the prefetched part, on the device
                self._arbitrated(host.upload_pieces(lo, hi), dst, order, stream)  # (a tied end: the embedding's)
                moved = self._tied_gradient_in(st, slot, order) if tie_in else 0
                if self.cuda and slot is not None:
                    slot.ready_event = torch.cuda.Event()
                    slot.ready_event.record(stream)
        self.counters.add(h2d=(hi - lo) * dst.element_size() + moved)

    def _arbitrated(self, pieces: Iterable[tuple[int, int, torch.Tensor]], dst: torch.Tensor, order: int,
                    stream: torch.cuda.Stream | None) -> None:
        """Each piece ``(a, b, src)`` into ``dst[a:b]``, served in stage order (``order``) per root complex: on a GPU
        chunk by chunk, each arbitrated again when other workers share the root complex; on the CPU at once."""
        if not self.cuda:
            self.arbiter.acquire(order)
            for a, b, src in pieces:
                dst[a:b].copy_(src)
            self.arbiter.release()
            return
        step = max(1, UPLOAD_CHUNK // dst.element_size())
        for a, b, src in pieces:
            for c in range(a, b, step):
                self.arbiter.acquire(order)
                dst[c:min(c + step, b)].copy_(src[c - a:min(c + step, b) - a], non_blocking=True)
                if self.arbiter.peers:
                    stream.synchronize()  # the next chunk is arbitrated again
        self.arbiter.release()

    def _refresh_compute(self, st: StepState, j: int, slot: DeviceSlot | None) -> None:
        """(The upload thread, delayed) the step's last upload of stage j is enqueued: its compute copy takes the
        master (w_{t-1}, what the next step computes with) once that upload has read it and the stage's AdamWs
        queued so far have run, ahead of every other waiting job; the next step's uploads wait for it
        (``updated``). Queued here rather than when the gradients land, so the copy is off the path from the
        step's last backward to the next step's first forward."""
        host = self.hosts[j]
        host.updated.clear()
        queued = host.updates_queued  # this step's AdamW is queued after the backward that waits for this upload
        read = slot.ready_event if self.cuda and slot is not None else None
        timed = (lambda t0, t1: st.trace.add("cpu", f"K{j}", t0, t1)) if st.trace is not None else None
        self.bg.updater.submit(host.to_compute, read, host.updated, timed, first=True,
                               after=lambda: host.updates_run >= queued)

    def _tied_gradient_in(self, st: StepState, slot: DeviceSlot | None, order: int) -> int:
        """(The upload thread, after stage 0's weights; on the copy stream) one worker holds both ends of the tied
        weight: the slot's gradient sums zeroed and the head's end's gradient, down since the head's DOWNLOAD, put
        in the tied range, so that stage 0's backward adds onto it and its download is the weight's whole
        gradient (no sum on the host). Returns the bytes moved."""
        assert slot is not None
        last, n_sums = st.sched.num_stages - 1, self.layouts[0].trainable_numel
        if not st.head_down.wait(WAIT_TIMEOUT_S) or last not in st.arrived:
            raise RuntimeError("the head's gradients never came down: the step ended before their download")
        (lo, n), (head_lo, _) = self.tied[0], self.tied[last]
        src = self.hosts[last].grads_in[head_lo:head_lo + n]  # fp32, or the half dtype
        sums = slot.sums[lo:lo + n]
        if self.cuda and st.arrived[last] is not None:
            self.bg.streams["copy"].wait_event(st.arrived[last])
        slot.sums[:n_sums].zero_()
        self.arbiter.acquire(order)
        if src.dtype == sums.dtype:
            sums.copy_(src, non_blocking=self.cuda)
        else:  # through the slot's half gradients, free until the backward: no temporary of the weight's size
            sums.copy_(slot.grads[lo:lo + n].copy_(src, non_blocking=self.cuda))
        self.arbiter.release()
        slot.grads_live = True  # set before the slot is ready: the backward does not zero the sums again
        return n * src.element_size()

    def free(self, st: StepState, a: Action) -> None:
        slot = self.slot_of.pop(a.stage)
        if self.cuda and slot.released is None:
            slot.released = event_now(self.device)
        slot.stage = None

    # ---- boundary inputs in host memory ----------------------------------------------------------
    def offload(self, st: StepState, a: Action) -> None:
        """A forward's boundary input to pinned host memory until the stage's backward."""
        key = (a.stage, a.micro)
        x = st.saved[key]
        self.counters.add(d2h=x.nbytes)
        if not self.cuda:
            st.saved[key] = ("host", x.clone(), None)
            return
        stream = self.bg.streams["d2h"]
        host, done = copy_after(stream, event_now(self.device),
                                lambda: torch.empty(x.shape, dtype=x.dtype, pin_memory=True).copy_(x, non_blocking=True))
        x.record_stream(stream)  # its memory is reused only after the copy has read it
        st.saved[key] = ("host", host, done)

    def reload(self, st: StepState, a: Action) -> None:
        """Stage j's offloaded inputs back, on the upload thread right after its backward upload
        (the backward waits for them as for the upload)."""
        st.reloads[a.stage] = self.bg.submit("upload", self._reload_job, st, a.stage)

    def _reload_job(self, st: StepState, j: int) -> torch.cuda.Event | None:
        """(The upload thread) each micro-batch's input back on the copy stream, once its offload is done; an
        event at the last one's end (None on the CPU)."""
        stream = self.bg.streams["copy"]
        for m in range(st.sched.micro_batches):
            _, host, done = st.saved[(j, m)]
            self.counters.add(h2d=host.nbytes)
            if self.cuda:
                with torch.cuda.stream(stream):
                    stream.wait_event(done)
                    dev = host.to(self.device, non_blocking=True)
                    dev.record_stream(torch.cuda.current_stream(self.device))  # (the copy stream, current here)
            else:
                dev = host.clone()
            st.saved[(j, m)] = dev
        if not self.cuda:
            return None
        back = torch.cuda.Event()
        back.record(stream)
        return back

    def inputs_back(self, st: StepState, j: int) -> None:
        """Wait (the dispatch thread, then the compute stream) for stage j's reloaded inputs."""
        job = st.reloads.pop(j, None)
        if job is None:
            return
        t0 = time.perf_counter()
        back = job.result()
        st.wait_s += st.clock.held_since(t0)
        if back is not None:
            torch.cuda.current_stream(self.device).wait_event(back)

    # ---- a stage on its slot -----------------------------------------------------------------------
    def on_device(self, st: StepState, j: int, grads: bool, graph: bool = False) -> DeviceSlot:
        """Wait for stage j's upload (counting the stall) and bind its modules to its slot: with
        gradients, or (``graph``) requiring them without buffers, or for inference."""
        slot = self.slot_of[j]
        if not slot.ready.is_set():
            t0 = time.perf_counter()
            slot.ready.wait()
            st.wait_s += st.clock.held_since(t0)
            if not self.cuda:
                st.stall_s += time.perf_counter() - t0
        self.bg.check()
        if self.cuda and slot.ready_event is not None:
            before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            stream = torch.cuda.current_stream(self.device)
            before.record(stream)
            stream.wait_event(slot.ready_event)
            after.record(stream)
            st.stall_events.append((before, after))
            slot.ready_event = None
            slot.released = None
        n, t = self.layouts[j].numel, self.layouts[j].trainable_numel
        if grads and not slot.grads_live:
            slot.sums[:t].zero_()
            slot.grads_live = True
        mode = "grads" if grads else "graph" if graph else "infer"
        if slot.bound != (j, mode):
            into, sums = slot.gradients_to(0, t) if grads else (None, None)
            slot.point((j, mode), self.units[j], lambda: bind(self.units[j], self.layouts[j], self.num_units,
                                                              slot.params[:n], into, grads or graph, sums))
            slot.bound = (j, mode)
        return slot

    def weights_by_position(self, j: int) -> torch.autograd.graph.saved_tensors_hooks:
        """Saved-tensor hooks for stage j's kept forward: a saved view of its slot is kept as its
        position in the slot and read back from whichever slot holds the stage at the backward."""
        base = self.slot_of[j].params
        ptr, start = base.untyped_storage().data_ptr(), base.storage_offset()

        def pack(t: torch.Tensor) -> torch.Tensor | SlotView:
            if t.device != base.device or t.untyped_storage().data_ptr() != ptr:
                return t
            assert t.dtype == base.dtype, (t.dtype, base.dtype)
            return SlotView(t.storage_offset() - start, tuple(t.shape), tuple(t.stride()))

        def unpack(v: torch.Tensor | SlotView) -> torch.Tensor:
            if not isinstance(v, SlotView):
                return v
            cur = self.slot_of[j].params
            return cur.as_strided(v.shape, v.stride, cur.storage_offset() + v.offset)

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)
