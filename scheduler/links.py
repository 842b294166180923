"""Activations and their gradients between the workers of adjacent pipeline stages.

* :class:`LocalLink` -- both stages on this worker: the tensor is handed over in memory;
* :class:`DirectLink` -- CPU workers (tests, the demo): gloo send/recv of CPU tensors; or CUDA
  workers with peer-to-peer: NCCL send/recv, GPU to GPU;
* :class:`StagedLink` -- CUDA workers without peer-to-peer (consumer GPUs, or two workers sharing one
  GPU): GPU -> pinned host buffer -> gloo -> pinned host buffer -> GPU, on side streams and threads.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from partition.schedule import Action, Kind
from scheduler.counters import Counters

Waiter = Callable[[], torch.Tensor]


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


class StagedLink:
    """GPU tensors through pinned host memory and gloo, for GPUs without peer-to-peer access."""

    posts_early = False

    def __init__(self, peer: int, device: torch.device, counters: Counters):
        self.peer, self.device, self.counters = peer, device, counters
        self.d2h_stream = torch.cuda.Stream(device)
        self.h2d_stream = torch.cuda.Stream(device)
        self.sender = ThreadPoolExecutor(1, thread_name_prefix=f"send{peer}")
        self.receiver = ThreadPoolExecutor(1, thread_name_prefix=f"recv{peer}")
        self.sends: list[Future] = []

    def send(self, t: torch.Tensor, tag: int) -> None:
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        t = t.detach()

        def job() -> None:
            torch.cuda.set_device(self.device)
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            with torch.cuda.stream(self.d2h_stream):
                self.d2h_stream.wait_event(ready)
                host.copy_(t, non_blocking=True)
            self.d2h_stream.synchronize()
            dist.send(host, self.peer, tag=tag)
        self.sends.append(self.sender.submit(job))
        self.counters.add(d2h=t.nbytes)

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, tag: int) -> Waiter:
        def job() -> tuple[torch.Tensor, torch.cuda.Event]:
            torch.cuda.set_device(self.device)
            host = torch.empty(shape, dtype=dtype, pin_memory=True)
            dist.recv(host, self.peer, tag=tag)
            with torch.cuda.stream(self.h2d_stream):
                dev = host.to(self.device, non_blocking=True)
                done = torch.cuda.Event()
                done.record(self.h2d_stream)
            dev.record_stream(torch.cuda.current_stream(self.device))
            return dev, done
        fut = self.receiver.submit(job)
        self.counters.add(h2d=int(np.prod(shape)) * dtype.itemsize)

        def wait() -> torch.Tensor:
            dev, done = fut.result()
            torch.cuda.current_stream(self.device).wait_event(done)
            return dev
        return wait

    def flush(self) -> None:
        for f in self.sends:
            f.result()
        self.sends.clear()


def post_early(actions: list[Action], links: dict, recv: Callable[[Action], None]) -> None:
    """Post, in list order, the receives of a step's ``actions`` whose links take them when the step begins
    (``recv``: the runtime's handler of a receive, which then finds them posted)."""
    for a in actions:
        if a.kind in (Kind.RECV_ACT, Kind.RECV_GRAD) and links[a.peer].posts_early:
            recv(a)


def link_to(peer: int, rank: int, device: torch.device, counters: Counters,
            nccl: dist.ProcessGroup | None = None) -> LocalLink | DirectLink | StagedLink:
    """The link from this worker (``rank``) to ``peer``: in place to itself, gloo between CPU workers, NCCL between
    GPUs with peer access (``nccl``, their group), through pinned host memory between GPUs without."""
    if peer == rank:
        return LocalLink()
    if device.type != "cuda":
        return DirectLink(peer, counters)
    if nccl is not None:
        return DirectLink(peer, counters, device, nccl)
    return StagedLink(peer, device, counters)
