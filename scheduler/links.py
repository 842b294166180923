"""Activations and their gradients between the workers of adjacent pipeline stages.

* :class:`LocalLink` -- both stages on this worker: the tensor is handed over in memory;
* :class:`MailLink` -- workers of one machine without peer access (CPU workers; consumer GPUs, or two
  workers sharing one GPU): a copy into a mailbox in host memory both map (:class:`Mailboxes`, page-locked on
  GPUs), taken by the receiver (on a GPU: DMA in, DMA out, on side streams and threads); between GPUs
  of several machines, through pinned buffers and gloo;
* :class:`DirectLink` -- CPU workers on several machines: gloo send/recv of CPU tensors; or CUDA
  workers with peer-to-peer: NCCL send/recv, GPU to GPU.
"""

from __future__ import annotations

import ctypes
import functools
import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterable

import numpy as np
import torch
import torch.distributed as dist

from partition.schedule import Action, Kind
from mobius.errors import MobiusError
from mobius.parallel import mailboxes_work_here
from scheduler.counters import Counters
from scheduler.roundrobin_host import WAIT_TIMEOUT_S, SharedHost, wait_for
from scheduler.stage_store import check_host_memory

Waiter = Callable[[], torch.Tensor]
MAILBOX_BYTES = 64 << 20  # payload slots per ordered pair of workers, at most (host memory every worker maps)


class LocalLink:
    """Adjacent stages on the same worker: nothing moves."""

    posts_early = False

    def __init__(self) -> None:
        self.box: dict[int, torch.Tensor] = {}

    def send(self, t: torch.Tensor, tag: int) -> None:
        self.box[tag] = t

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, tag: int) -> Waiter:
        return lambda: self.box.pop(tag)

    def flush(self) -> None:
        self.box.clear()


class DirectLink:
    """Point-to-point sends of tensors already where they must go: CPU tensors through gloo (CPU
    workers standing in for GPUs, tagged), or GPU tensors through NCCL (peer-to-peer, in order).

    Gloo's receives are posted when the step begins (:func:`post_early`), by a thread of the link's own. Gloo
    moves a message only once its receive is posted: posted just before the compute that needs it, every hop
    waited for the sender's gloo thread, which shares its core with the sender's compute, to answer. And a post
    blocks while gloo's thread moves another message of the pair (measured on 2 CPU workers: 0.05-0.2 ms, and
    1.5-7 ms one time in four), which the dispatch thread, that computes on a CPU worker, would wait out.
    Sends stay on the dispatch thread: handed to another thread, a send waited for that thread to get the
    interpreter while the next compute ran."""

    def __init__(self, peer: int, counters: Counters, device: torch.device | None = None,
                 group: dist.ProcessGroup | None = None):
        self.peer, self.counters, self.group = peer, counters, group
        self.device = device or torch.device("cpu")
        self.nccl = self.device.type == "cuda"  # NCCL matches sends and receives by order, not tag
        # gloo's receives are posted early by this thread; NCCL's where the list has them (it matches in order: a
        # receive posted early could wait on a send that comes after one of this worker's own)
        self.poster = None if self.nccl else ThreadPoolExecutor(1, thread_name_prefix=f"recv{peer}")
        self.posts_early = self.poster is not None
        self.pending: list[tuple[dist.Work, torch.Tensor]] = []

    def send(self, t: torch.Tensor, tag: int) -> None:
        t = t.detach().contiguous()
        self.pending.append((dist.isend(t, self.peer, group=self.group, tag=0 if self.nccl else tag), t))
        self.counters.add(**({"p2p": t.nbytes} if self.nccl else {"d2h": t.nbytes}))

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, tag: int) -> Waiter:
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        if self.poster is None:
            work = dist.irecv(buf, self.peer, group=self.group, tag=0)
            return lambda: _received(work, buf)
        posted = self.poster.submit(dist.irecv, buf, self.peer, group=self.group, tag=tag)  # in order
        self.counters.add(h2d=buf.nbytes)
        return lambda: _received(posted.result(), buf)

    def flush(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()


def _received(work: dist.Work, buf: torch.Tensor) -> torch.Tensor:
    work.wait()
    return buf


class Mailboxes:
    """One mailbox per ordered pair of workers that exchange messages, in host memory every worker maps
    (:class:`~scheduler.roundrobin_host.SharedHost`; page-locked for GPUs). A mailbox is a ring of ``RECORDS`` records (tag, payload slot) and
    a ring of payload slots of one message each (two steps of the pair's messages, within ``MAILBOX_BYTES``);
    its sender alone advances what was sent, its receiver alone what was taken, so neither waits on a lock.
    A message is in host memory the moment its send returns, and the receiver copies it out when it needs it:
    no third thread has to be scheduled between them (gloo's threads had to be, on cores the workers' compute
    kept busy: a hop took 0.3-6 ms on 2 CPU workers, where the copies take 0.1), and a GPU's message is not
    copied again between the two processes (gloo moved a 64 MiB message at 2.5-4.2 GB/s through the loopback).
    The sender wakes the receiver's futex on the count it advanced. A send that finds every slot taken, or
    a message of another shape, goes through gloo instead, and its record says so: no schedule can wait on
    a full mailbox.

    The counters are plain stores in shared memory: the payload is written before the record that publishes
    it, which x86-64's store order keeps (:func:`mobius.parallel.mailboxes_work_here`)."""

    RECORDS = 4096

    def __init__(self, sends: dict[tuple[int, int], int], shape: tuple[int, ...], dtype: torch.dtype, pin: bool):
        self.shape, self.dtype = tuple(shape), dtype
        self.nbytes = math.prod(shape) * dtype.itemsize
        self.slots = {pair: mailbox_slots(n, self.nbytes) for pair, n in sends.items()}
        spec: dict[str, tuple[int, torch.dtype]] = {}
        for (src, dst), k in sorted(self.slots.items()):
            spec[f"count{src}>{dst}"] = (4, torch.int64)  # records sent, taken; payloads sent, taken
            spec[f"record{src}>{dst}"] = (2 * self.RECORDS, torch.int64)
            spec[f"payload{src}>{dst}"] = (k * self.nbytes, torch.uint8)
        check_host_memory(sum(n * dtype.itemsize for n, dtype in spec.values()), "the workers' mailboxes")
        self.host = SharedHost(spec, pin=pin, label="mobius-mailboxes")

    def fits(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is a message of the slots' shape and dtype (any other goes through gloo)."""
        return tuple(t.shape) == self.shape and t.dtype == self.dtype

    def message(self, slot: torch.Tensor) -> torch.Tensor:
        """A payload slot's bytes as a message."""
        return slot.view(self.dtype).view(self.shape)

    def box(self, src: int, dst: int) -> tuple[np.ndarray, np.ndarray, torch.Tensor] | None:
        """(counters, records, payload slots [k, bytes]) of the mailbox from ``src`` to ``dst``, if there is one."""
        if (src, dst) not in self.slots:
            return None
        count = self.host[f"count{src}>{dst}"].numpy()
        records = self.host[f"record{src}>{dst}"].numpy().reshape(self.RECORDS, 2)
        return count, records, self.host[f"payload{src}>{dst}"].view(self.slots[(src, dst)], self.nbytes)


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_SYS_FUTEX, _FUTEX_WAIT, _FUTEX_WAKE = 202, 0, 1  # x86-64; shared (not private) futexes: the mapping is a file's


def _futex_wait(address: int, seen: int, timeout_s: float) -> None:
    """Sleep while the 32-bit word at ``address`` still holds ``seen`` (at most ``timeout_s``); returns at
    once if it has changed. ctypes lets go of the interpreter meanwhile."""
    ts = _Timespec(int(timeout_s), int(timeout_s % 1 * 1e9))
    _libc().syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAIT, ctypes.c_int(seen), ctypes.byref(ts), None, 0)


def _futex_wake(address: int) -> None:
    _libc().syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAKE, ctypes.c_int(2**31 - 1), None, None, 0)


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def mailbox_sends(action_lists: Iterable[list[list[Action]]], ranks: int) -> dict[tuple[int, int], int]:
    """Messages a mailbox would hold per ordered pair of workers for none to go through gloo: twice the most
    that one step's lists (of each schedule in ``action_lists``) send from one to the other, so that a step's
    messages and the next one's fit (:func:`mailbox_slots` caps it)."""
    most: dict[tuple[int, int], int] = {}
    for lists in action_lists:
        for src in range(ranks):
            n: dict[int, int] = {}
            for a in lists[src]:
                if a.kind in (Kind.SEND_ACT, Kind.SEND_GRAD) and a.peer != src:
                    n[a.peer] = n.get(a.peer, 0) + 1
            for dst, k in n.items():
                most[(src, dst)] = max(most.get((src, dst), 0), 2 * k)
    return most


def mailboxes_for(device_type: str, nodes: int, world: int, action_lists: Iterable[list[list[Action]]],
                  shape: tuple[int, ...], dtype: torch.dtype, p2p: bool = False) -> Mailboxes | None:
    """A run's mailboxes, sized by the step lists it will run (read only when they are made), or None where
    they do not link its workers (one worker, GPUs with peer access, several machines). Every rank calls it (a
    collective)."""
    if world < 2 or not mailboxes_work_here(device_type, nodes, p2p):
        return None
    return Mailboxes(mailbox_sends(action_lists, world), shape, dtype, pin=device_type == "cuda")


def mailbox_slots(wanted: int, nbytes: int) -> int:
    """Payload slots of one mailbox: ``wanted``, but within ``MAILBOX_BYTES`` (at least 2 slots); the messages
    past them go through gloo, as they all did before."""
    return max(1, min(wanted, max(2, MAILBOX_BYTES // max(nbytes, 1))))


class MailLink:
    """Messages to and from ``peer`` through host memory: a send copies the tensor into the next free payload slot
    of the pair's mailbox (:class:`Mailboxes`) and publishes its record; a receive takes every record that has
    arrived, in order (copying each message out and freeing its slot), until it has its own tag. A message
    with no slot (none for this pair, every slot taken, another shape) goes through gloo, as its record says.

    CPU workers copy on the dispatch thread, which is their compute thread. GPU workers without peer access
    copy on a sender and a receiver thread of the link's own, on side streams, so that the dispatch thread runs
    ahead of the stream: a GPU's message goes by DMA into the page-locked slot and by DMA out of it, with no
    third copy between the two processes (``boxes`` None, across machines: through pinned buffers and gloo)."""

    posts_early = False
    PAUSE_S = 5e-5  # the longest sleep between looks for room in a full mailbox (rare)
    SLEEP_S = 0.1  # the longest sleep on a futex before a receiver looks again (a wake ends it at once)

    def __init__(self, rank: int, peer: int, boxes: Mailboxes | None, counters: Counters,
                 device: torch.device = torch.device("cpu")):
        self.peer, self.boxes, self.counters, self.device = peer, boxes, counters, device
        self.out = boxes.box(rank, peer) if boxes is not None else None
        self.inbox = boxes.box(peer, rank) if boxes is not None else None
        self.arrived: dict[int, torch.Tensor | None] = {}  # None: on its way through gloo
        self.pending: list[tuple[dist.Work, torch.Tensor]] = []  # messages sent through gloo
        self.gpu = device.type == "cuda"
        if self.gpu:
            device = torch.device("cuda", torch.cuda.current_device()) if device.index is None else device
            self.d2h_stream, self.h2d_stream = torch.cuda.Stream(device), torch.cuda.Stream(device)
            self.sender, self.receiver = (ThreadPoolExecutor(1, thread_name_prefix=f"{what}{peer}",
                                                             initializer=torch.cuda.set_device, initargs=(device,))
                                          for what in ("send", "recv"))
        self.sends: list[Future] = []

    def send(self, t: torch.Tensor, tag: int) -> None:
        t = t.detach()
        self.counters.add(d2h=t.nbytes)
        if not self.gpu:
            self._post(t.contiguous(), tag, None)
            return
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        self.sends.append(self.sender.submit(self._post, t, tag, ready))

    def _post(self, t: torch.Tensor, tag: int, ready: torch.cuda.Event | None) -> None:
        """Copy ``t`` into a free slot and publish its record, or send it through gloo (after ``ready``: on a GPU,
        the event that its compute is done)."""
        if self.out is None:  # no mailbox this way (across machines, or no schedule sends this way)
            self._through_gloo(t, tag, ready)
            return
        count, records, payload = self.out
        sent = int(count[0])
        if sent - int(count[1]) >= Mailboxes.RECORDS:
            wait_for(lambda: int(count[0]) - int(count[1]) < Mailboxes.RECORDS,
                     f"room in the mailbox to worker {self.peer}", self.PAUSE_S)
        slot = -1
        if self.boxes.fits(t) and int(count[2]) - int(count[3]) < payload.shape[0]:
            slot = int(count[2]) % payload.shape[0]
            self._to_host(self.boxes.message(payload[slot]), t, ready)
            count[2] += 1
        records[sent % Mailboxes.RECORDS] = (tag, slot)
        count[0] = sent + 1  # published: the payload and the record are stored before this
        _futex_wake(count.ctypes.data)  # a receiver asleep on the count (its low 32 bits)
        if slot < 0:
            self.counters.add(overflow=t.nbytes)
            self._through_gloo(t, tag, ready)

    def _through_gloo(self, t: torch.Tensor, tag: int, ready: torch.cuda.Event | None) -> None:
        host = t
        if self.gpu:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self._to_host(host, t, ready)
        self.pending.append((dist.isend(host, self.peer, tag=tag), host))

    def _to_host(self, dst: torch.Tensor, src: torch.Tensor, ready: torch.cuda.Event | None) -> None:
        if not self.gpu:
            dst.copy_(src)
            return
        with torch.cuda.stream(self.d2h_stream):
            self.d2h_stream.wait_event(ready)
            dst.copy_(src, non_blocking=True)
        self.d2h_stream.synchronize()

    def _to_device(self, src: torch.Tensor) -> torch.Tensor:
        """A message in host memory as a tensor of this worker's own, copied out before its memory is reused."""
        if not self.gpu:
            return src.clone()
        with torch.cuda.stream(self.h2d_stream):
            dev = torch.empty(src.shape, dtype=src.dtype, device=self.device)
            dev.copy_(src, non_blocking=True)
        self.h2d_stream.synchronize()
        return dev

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, tag: int) -> Waiter:
        self.counters.add(h2d=math.prod(shape) * dtype.itemsize)
        if self.gpu:
            taken = self.receiver.submit(self._take, tag, shape, dtype)

            def wait() -> torch.Tensor:
                dev = taken.result()
                dev.record_stream(torch.cuda.current_stream(self.device))  # allocated on the copy's stream
                return dev
            return wait
        if self.inbox is None:  # no mailbox this way: gloo moves it once the receive is posted, so post it now
            buf = torch.empty(shape, dtype=dtype)
            work = dist.irecv(buf, self.peer, tag=tag)
            return lambda: _received(work, buf)
        return lambda: self._take(tag, shape, dtype)

    def _take(self, tag: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if self.inbox is None:
            return self._from_gloo(tag, shape, dtype)
        t0 = time.perf_counter()
        while tag not in self.arrived:
            if not self._collect():
                self._sleep(t0, tag)
        buf = self.arrived.pop(tag)
        return self._from_gloo(tag, shape, dtype) if buf is None else buf  # None: its send is posted

    def _from_gloo(self, tag: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        host = torch.empty(shape, dtype=dtype, pin_memory=self.gpu)
        dist.recv(host, self.peer, tag=tag)
        return self._to_device(host) if self.gpu else host

    def _sleep(self, t0: float, tag: int) -> None:
        """Until the sender publishes another record (it wakes the futex on the count it advanced)."""
        count = self.inbox[0]
        seen = int(count[0])
        if seen == int(count[1]):
            if time.perf_counter() - t0 > WAIT_TIMEOUT_S:
                raise MobiusError(f"waited {WAIT_TIMEOUT_S:.0f} s for message {tag} from worker {self.peer}: "
                                  f"a worker has stopped")
            _futex_wait(count.ctypes.data, seen & 0xFFFFFFFF, self.SLEEP_S)

    def _collect(self) -> bool:
        """Take every record that has arrived, in order (a message in a slot copied out, one through gloo
        noted); False if there was none."""
        count, records, payload = self.inbox
        taken, sent = int(count[1]), int(count[0])
        for i in range(taken, sent):
            tag, slot = (int(x) for x in records[i % Mailboxes.RECORDS])
            assert tag not in self.arrived, f"message {tag} from worker {self.peer} arrived twice"
            self.arrived[tag] = None
            if slot >= 0:
                self.arrived[tag] = self._to_device(self.boxes.message(payload[slot]))
                count[3] += 1
            count[1] = i + 1
        return sent > taken

    def flush(self) -> None:
        for f in self.sends:
            f.result()
        self.sends.clear()
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()


def post_early(actions: list[Action], links: dict, recv: Callable[[Action], None]) -> None:
    """Post, in list order, the receives of a step's ``actions`` whose links take them when the step begins
    (``recv``: the runtime's handler of a receive, which then finds them posted)."""
    for a in actions:
        if a.kind in (Kind.RECV_ACT, Kind.RECV_GRAD) and links[a.peer].posts_early:
            recv(a)


def link_to(peer: int, rank: int, device: torch.device, counters: Counters,
            nccl: dist.ProcessGroup | None = None,
            boxes: Mailboxes | None = None) -> LocalLink | MailLink | DirectLink:
    """The link from this worker (``rank``) to ``peer``: in place to itself, NCCL between GPUs with peer access
    (``nccl``, their group), mailboxes between the other workers of one machine (``boxes``), gloo between CPU
    workers of several, pinned host buffers and gloo between GPUs of several without peer access."""
    if peer == rank:
        return LocalLink()
    if nccl is not None:
        return DirectLink(peer, counters, device, nccl)
    if device.type == "cuda" or boxes is not None:
        return MailLink(rank, peer, boxes, counters, device)
    return DirectLink(peer, counters)
