"""The round-robin runtime's step end on one worker: an op's gradient sums of a round down into the host sum
(``DOWNLOAD``: the first and last rounds of a step straight, a middle round through the staging buffer, which the
summing thread adds), its units' CPU AdamW queued on the optimizer thread (``UPDATE``: a tied weight's embedding
end takes the sum of both ends'), and ``REDUCE``: the step's statistics posted to the sum over the workers
(:class:`~scheduler.roundrobin_step.StepReduce`)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Callable

import torch

from mobius.optim import UpdateRule
from partition.schedule import Action
from scheduler.counters import Counters
from scheduler.device_slot import DeviceSlot
from scheduler.dispatch_thread import Background, event_now
from scheduler.roundrobin_step import RoundRobinStep, StepReduce, ready_version
from scheduler.roundrobin_host import Span, UnitStores, wait_for
from scheduler.stages import add_tied
from scheduler.trace import StepTrace
from scheduler.updater import Events

ToHost = Callable[[torch.Tensor, torch.Tensor, "torch.cuda.Event | None", "StepTrace | None", str], None]
Tied = dict[int, tuple[int, slice, slice]]  # op -> (the other end's op, this end's slice, the other's)


class OpUpdates:
    """One worker's gradients, updates and step end over the shared stores. From its dispatch it takes the slots
    (``slot_of``), their copy down to host memory (``to_host``) and their release once read (``release``)."""

    def __init__(self, stores: UnitStores, spans: list[Span], tied: Tied, rule: UpdateRule, ranks: tuple[int, int],
                 skip_updates: bool, counters: Counters, links: dict, bg: Background,
                 slot_of: dict[tuple[int, int, int], DeviceSlot], to_host: ToHost,
                 release: Callable[..., None]):
        self.stores, self.spans, self.tied, self.rule, self.skip_updates = stores, spans, tied, rule, skip_updates
        (self.rank, self.world), self.counters, self.links, self.bg = ranks, counters, links, bg
        self.slot_of, self.to_host, self.release = slot_of, to_host, release
        self.tied_grad: torch.Tensor | None = None  # unit 0's gradient with the tied head's end's added (the
        # optimizer thread's: one update at a time; kept, as a fresh one of an embedding's size costs page faults)
        self._staging: torch.Tensor | None = None  # (pinned) fp32: a middle round's gradients waiting to be summed
        self._staging_free = threading.Semaphore(1)  # ... taken by its download, given back once they are added
        self._not_adding = threading.Event()  # cleared while the summing thread adds: this worker's updates pause
        self._not_adding.set()  # between blocks then (the sums hold up downloads and slots)
        for opt in stores.optimizers:
            opt.pause = self._not_adding.wait

    # ---- gradients down ----------------------------------------------------------------------------
    def download(self, st: RoundRobinStep, a: Action) -> None:
        """Round ``a.round``'s gradient sums of op k to host memory (the download thread), and the slot is free.
        The first round of a step comes straight into the host sum, once the last update to read it (the step
        before's, or the one before that under delayed; a tied weight's other end too) has; so does the last,
        which took the earlier rounds' sums up (the upload's copy job) and is the step's total, whose share of the
        norm it reads on the device. A middle round comes into the staging buffer, which the summing thread then
        adds into the host sum after the rounds before."""
        k, q, R = a.stage, a.round, st.sched.rounds
        s, slot = self.spans[k], self.slot_of[(st.index, k, a.round)]
        src, ready = slot.sums[:s.trainable], event_now(self.bg.device)
        dst = self.stores.grad(st.index)[s.glo:s.ghi]
        whole = q in (0, R - 1)  # straight into the host sum
        copied = self.bg.submit("download", self._copy_down, st, k, q, src, ready, dst if whole else None)
        st.downloaded[k] = copied if whole else self.bg.submit("sum", self._add_staged, st, k, q, dst, copied)
        st.d2h += [copied, st.downloaded[k]]
        self.counters.add(d2h=s.trainable * 4)

    def _copy_down(self, st: RoundRobinStep, k: int, q: int, src: torch.Tensor, ready: torch.cuda.Event | None,
                   dst: torch.Tensor | None) -> None:
        """(The download thread) op k's round ``q`` into the host sum ``dst``, or (None) the staging buffer."""
        index, R = st.index, st.sched.rounds
        done = index * R + q  # rounds of op k summed before this one
        readers = (k, *(o for o in st.sched.tie_readers if k in self.tied and o != k)) if q == 0 else ()
        for o in readers:
            wait_for(lambda o=o: int(self.stores.version[o]) >= ready_version(index, self.stores.delayed),
                     f"the update of op {o} that reads its gradient sums")
        if q == 0:  # the previous step's rounds are summed first (the sum counts in order)
            wait_for(lambda: int(self.stores.summed[k]) >= done, f"op {k}'s gradients of the step before")
        elif dst is None:
            self._staging_free.acquire()
        self.to_host(dst if dst is not None else self._staged(src.numel()), src, ready, st.trace, f"D{k}")
        if q == R - 1:
            st.sumsq += self._sumsq(k, src)  # (on the device, down before its slot is free)
        self.release(index, k, q, compute=False)
        if dst is not None:
            self.stores.summed[k] = done + 1

    def _add_staged(self, st: RoundRobinStep, k: int, q: int, dst: torch.Tensor, copied: Future) -> None:
        """(The summing thread) a middle round's sums, once down in the staging buffer, added into the host sum
        after the rounds before; this worker's updates pause meanwhile."""
        done = st.index * st.sched.rounds + q
        try:
            copied.result()
            wait_for(lambda: int(self.stores.summed[k]) >= done, f"round {q - 1} of op {k}'s gradients")
            self._not_adding.clear()
            start = time.perf_counter()
            dst.add_(self._staged(dst.numel()))
            if st.trace is not None:
                st.trace.add("cpu", f"+{k}", start, time.perf_counter())
        finally:
            self._not_adding.set()
            self._staging_free.release()
        self.stores.summed[k] = done + 1

    def _staged(self, numel: int) -> torch.Tensor:
        """The staging buffer's first ``numel`` elements (pinned on a GPU's host; made on first use)."""
        if self._staging is None:
            self._staging = torch.empty(max(sp.trainable for sp in self.spans), dtype=torch.float32,
                                        pin_memory=self.bg.cuda)
        return self._staging[:numel]

    def _sumsq(self, k: int, g: torch.Tensor) -> float:
        """The op's share of the squared gradient norm; a tied weight's end is left out (rank 0 counts the sum
        of both ends at REDUCE)."""
        if k not in self.tied:
            return float(torch.dot(g, g))
        _, mine, _ = self.tied[k]
        lo, hi = mine.start - self.spans[k].glo, mine.stop - self.spans[k].glo
        a, b = g[:lo], g[hi:]
        return float(torch.dot(a, a) + torch.dot(b, b))

    def _tied_sumsq(self, st: RoundRobinStep) -> float:
        R = st.sched.rounds
        ops = list(self.tied)
        for o in ops:
            wait_for(lambda o=o: int(self.stores.summed[o]) >= (st.index + 1) * R, f"op {o}'s gradients")
        grad = self.stores.grad(st.index)
        _, ea, eb = self.tied[ops[0]]
        return add_tied(grad[ea], grad[eb])

    # ---- updates -----------------------------------------------------------------------------------
    def update(self, st: RoundRobinStep, a: Action) -> None:
        """Queue the CPU AdamW of op k's units on the optimizer thread. After the step's REDUCE (a barrier) it
        first takes the step's factor and overflow check from the statistics over the workers; the embedding's
        end of a tied weight waits for the head's gradients and takes their sum (the stores copy the result into
        the head's end)."""
        k, index, R, lr, adam_step = a.stage, st.index, st.sched.rounds, st.lr, st.adam_step
        reduced = st.reduce  # None before the REDUCE: no barrier, so no clipping and no fp16 (factor 1)
        reads_tie = k in self.tied and k in st.sched.tie_readers

        def inputs() -> None:  # what the update waits for, outside the time it counts as the CPU AdamW's
            st.downloaded[k].result()
            if reduced is not None:
                reduced.result()
            if reads_tie:
                other, _, _ = self.tied[k]
                wait_for(lambda: int(self.stores.summed[other]) >= (index + 1) * R, f"op {other}'s gradients")

        def update() -> int:
            factor, skip = 1.0, False
            if reduced is not None:
                _, _, skip, factor = reduced.result()
            return self._update_units(k, index, lr, factor, adam_step, skip or self.skip_updates, reads_tie)

        timed = (lambda t0, t1: st.trace.add("cpu", f"O{k}", t0, t1)) if st.trace is not None else None
        self.bg.updater.submit(update, _Waited(inputs), Events(), timed)  # waiters read `version` instead

    def _update_units(self, k: int, index: int, lr: float, factor: float, adam_step: int, skip: bool,
                      reads_tie: bool) -> int:
        """(The optimizer thread) the AdamW of op k's units from step ``index``'s gradient sums; the count of its
        updates after. Returns the parameters updated."""
        s, grad, n = self.spans[k], self.stores.grad(index), 0
        for u in range(s.first, s.end):
            us = self.stores.span(u, u + 1)
            g = grad[us.glo:us.ghi]
            if reads_tie and u == 0:
                _, mine, theirs = self.tied[k]
                if self.tied_grad is None or self.tied_grad.numel() < g.numel():
                    self.tied_grad = torch.empty(g.numel(), dtype=g.dtype)
                g = self.tied_grad[:g.numel()].copy_(g)  # the shared sums stay as they are (rank 0's norm
                # of the tied weight may still read them)
                g[mine.start - us.glo:mine.stop - us.glo] += grad[theirs]
            n += self.stores.update(u, g, lr, factor, adam_step, skip, index)
        self.stores.version[k] = index + 1
        return n

    # ---- the step's end ----------------------------------------------------------------------------
    def reduce(self, st: RoundRobinStep, a: Action, before: StepReduce | None) -> None:
        """The end of this worker's step: its sends, uploads and downloads finished, then its statistics posted to
        the sum over the workers (:class:`StepReduce`: the global norm, the fp16 overflow check, the factor;
        ``before``: the step before's, ended first)."""
        for link in self.links.values():
            link.flush()
        for f in st.uploads + st.d2h:
            f.result()
        assert not st.reloading and not st.reloads, "reloads the step's list started but did not wait for"
        if self.bg.cuda:
            torch.cuda.synchronize(self.bg.device)
        self.bg.check()
        if self.tied and self.rank == 0:
            st.sumsq += self._tied_sumsq(st)
        adam_s, adam_params = self.bg.updater.take()
        moved = self.counters.take()
        st.reduce = StepReduce({**(st.routed.stats() if st.routed is not None else {}),
                                "loss_sum": float(st.loss_sum), "losses": float(st.losses), "sumsq": st.sumsq,
                                "upload_wait_s": st.wait_s, "cpu_adam_s": adam_s, "cpu_adam_params": adam_params,
                                **st.computed.stats(self.rank, self.world), "dispatch_s": st.dispatch_s,
                                **{f"{kind}_bytes": float(n) for kind, n in moved.items()}},
                               self.rule, before)


class _Waited:
    """What an update waits for, as the optimizer thread waits (``synchronize``: ``wait()``, raising its failure)."""

    def __init__(self, wait: Callable[[], None]):
        self.synchronize = wait
