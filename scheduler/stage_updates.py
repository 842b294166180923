"""The swapped pipeline's step end on one worker: a stage's gradient sums down to its host buffer (``DOWNLOAD``),
its CPU AdamW queued on the optimizer thread (``UPDATE``) or a resident stage's on the compute stream
(``DEVICE_UPDATE``), a tied weight's two ends summed between two workers (``TIE``), and ``REDUCE``: the step's
statistics summed over the workers, with the global norm, the fp16 overflow check and the updates' factor."""

from __future__ import annotations

import time

import torch

from mobius.optim import UpdateRule
from partition.schedule import Action
from scheduler.counters import Counters
from scheduler.dispatch_thread import Background, copy_after, event_now
from scheduler.executor_state import Collectives, ExecutorOptions, StepOutcome, StepState
from scheduler.stage_swaps import StageSwaps
from scheduler.stages import StageLayout, add_tied
from scheduler.stage_store import StageStore


class _UpdateEnd:
    """What a stage's CPU update sets when it ends or fails: ``consumed`` (the next download may come; in sync the
    same event as ``updated``), after counting it run (a compute copy waiting for it may go)."""

    def __init__(self, host: StageStore):
        self.host = host

    def set(self) -> None:
        self.host.updates_run += 1
        self.host.consumed.set()


class StageUpdates:
    """This worker's gradients, updates and step end, over its swapped stages' host stores (``hosts``) and its
    resident stages' device stores (``resident``)."""

    def __init__(self, rank: int, layouts: list[StageLayout], hosts: dict[int, StageStore],
                 resident: dict[int, StageStore], links: dict, swaps: StageSwaps, counters: Counters,
                 collectives: Collectives, rule: UpdateRule, options: ExecutorOptions, bg: Background):
        self.rank, self.layouts, self.hosts, self.resident, self.links = rank, layouts, hosts, resident, links
        self.swaps, self.counters, self.coll, self.bg = swaps, counters, collectives, bg
        self.rule, self.opt = rule, options
        self.tied = swaps.tied

    # ---- gradients down --------------------------------------------------------------------------
    def download(self, st: StepState, a: Action) -> None:
        """Gradients of a finished stage to its host buffer (fp32, or rounded to the half dtype into
        the half copy); the CPU update takes them from there."""
        j = a.stage
        slot, host = self.swaps.slot_of[j], self.hosts[j]
        n = self.layouts[j].trainable_numel  # what trains comes down
        if not host.consumed.is_set():  # delayed: the previous step's AdamW still reads the gradient buffer
            t0 = time.perf_counter()
            host.consumed.wait()
            st.wait_s += st.clock.held_since(t0)
        self.bg.check()
        host.consumed.clear()  # (delayed: `updated` is the compute copy's, cleared at the step's last upload)
        if not host.delayed:
            host.updated.clear()
        src = slot.sums[:n]  # fp32 either way
        summed = st.sched.tie_in and j == 0  # the tied weight's whole gradient: counted here, not at TIE
        st.sumsq.append(self._sumsq(src, None if summed else self.tied.get(j)))  # the exact norm, before any rounding
        if self.opt.half_grads:
            src = slot.grads[:n].copy_(src)  # the slot's half gradients are free once summed
        dst = host.grads_in[:n]
        _, done = copy_after(self.bg.streams["d2h"], event_now(self.swaps.device),
                             lambda: dst.copy_(src, non_blocking=self.bg.cuda), st.trace, "d2h", f"D{j}")
        if self.bg.cuda:
            slot.released = done  # the slot is reused only after the copy has read it
        self.counters.add(d2h=n * src.element_size())
        st.arrived[j] = done
        if j == st.sched.num_stages - 1:
            st.head_down.set()

    @staticmethod
    def _sumsq(g: torch.Tensor, skip: tuple[int, int] | None) -> torch.Tensor:
        """Sum of squared gradients (on the device), leaving out a tied range counted at TIE."""
        if skip is None:
            return torch.dot(g, g)
        a, b = g[:skip[0]], g[skip[0] + skip[1]:]
        return torch.dot(a, a) + torch.dot(b, b)

    # ---- updates ---------------------------------------------------------------------------------
    def update(self, st: StepState, a: Action) -> None:
        """Queue stage j's update on the optimizer thread (it waits for the gradients' download); its end
        sets ``updated`` (the next upload may read the copy) and ``consumed`` (the next download may come),
        one event in sync; delayed: ``consumed`` alone, the copy having been taken before
        (:meth:`StageSwaps._refresh_compute`)."""
        j = a.stage
        host, skip = self.hosts[j], st.skipped or self.opt.skip_updates
        lr, factor, trace = st.io.lr, st.factor, st.trace

        def update() -> int:
            host.update(lr, factor, skip=skip, copy=not host.delayed)
            return 0 if skip else host.own

        timed = (lambda t0, t1: trace.add("cpu", f"O{j}", t0, t1)) if trace is not None else None
        # its end (or failure) releases what waits on it
        host.updates_queued += 1
        self.bg.updater.submit(update, st.arrived.get(j), _UpdateEnd(host), timed)

    def device_update(self, st: StepState, a: Action) -> None:
        """A resident stage's update on the compute stream, from its fp32 gradient sums (delayed: its
        half copy takes the master first, then AdamW updates the master alone)."""
        j = a.stage
        slot, n = self.swaps.slot_of[j], self.layouts[j].trainable_numel
        self.resident[j].update(st.io.lr, st.factor, slot.sums[:n], skip=st.skipped or self.opt.skip_updates)
        slot.grads_live = False  # zeroed before the next backward

    def tie(self, st: StepState, a: Action) -> None:
        """Sum the two ends' gradients of the tied weight, held by two workers (one worker holding both sums
        them on the device: ``Schedule.tie_in``): each end takes the sum and the same update. Its sum of squares
        is counted once, on the embedding's worker."""
        (j, (o, n)), = self.tied.items()
        arrived = st.arrived.get(j)
        if arrived is not None:
            arrived.synchronize()
        mine = self.hosts[j].grads_in[o:o + n]
        other_stage = st.sched.num_stages - 1 if j == 0 else 0
        sumsq = add_tied(mine, self.coll.exchange(mine, st.sched.gpu_of[other_stage]), into=(mine,))
        st.tied_sumsq = sumsq if j == 0 else 0.0

    def sync(self) -> None:
        """Wait for every queued CPU update, all of it (under delayed the AdamW after the copy too),
        and surface a failure of one."""
        self.bg.updater.sync()
        for host in self.hosts.values():
            host.updated.wait()
            host.consumed.wait()
        self.bg.check()

    # ---- the step's end --------------------------------------------------------------------------
    def reduce(self, st: StepState, a: Action) -> None:
        """End of the dispatch: finish this worker's transfers, then sum the step's statistics over
        workers; in training also the global norm, the fp16 overflow check and the update factor."""
        t0 = time.perf_counter()
        for link in self.links.values():
            link.flush()
        for f in st.uploads + list(st.reloads.values()):
            f.result()
        if self.bg.cuda:
            torch.cuda.synchronize(self.swaps.device)
            st.stall_s += sum(x.elapsed_time(y) for x, y in st.stall_events) / 1e3
        st.reduce_wait_s = time.perf_counter() - t0
        if st.sched.train and not st.sched.barrier and self.opt.step_waits_for_updates:
            self.sync()  # without a barrier a (sync) step ends when its updates have
        if st.sched.train:  # resident gradients are still on the device (an update without a factor leaves them)
            for j in self.resident:
                slot, n = self.swaps.slot_of[j], self.layouts[j].trainable_numel
                st.sumsq.append(self._sumsq(slot.sums[:n], None))
        self.bg.check()
        stats = self._local_stats(st)
        stats["reduce_s"] = st.tie_s + time.perf_counter() - t0  # before the sum over workers (it waits for the
        # slowest)
        total = self.coll.reduce(stats)
        loss = total["loss_sum"] / max(total["losses"], 1)
        if not st.sched.train:
            st.outcome = StepOutcome(loss, 0.0, False, total)
            return
        norm, st.skipped, st.factor = self.rule.end(total["sumsq"])
        st.outcome = StepOutcome(loss, norm, st.skipped, total)

    def _local_stats(self, st: StepState) -> dict[str, float]:
        moved = self.counters.take()
        update_s, update_params = self.bg.updater.take()
        sumsq = (float(torch.stack(st.sumsq).double().sum()) if st.sumsq else 0.0) + st.tied_sumsq  # one read
        return {**(st.routed.stats() if st.routed is not None else {}),
                "loss_sum": float(st.loss_sum), "losses": float(st.losses), "sumsq": sumsq, "stall_s": st.stall_s,
                "upload_wait_s": st.wait_s, "cpu_adam_s": update_s, "cpu_adam_params": float(update_params),
                **st.computed.stats(self.rank, len(st.sched.actions)), "dispatch_s": st.dispatch_s,
                "reduce_wait_s": st.reduce_wait_s,
                **{f"{kind}_bytes": float(n) for kind, n in moved.items()}}
