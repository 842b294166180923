"""Moving tensors between workers, and ordering uploads that share a root complex.

Links between the workers of adjacent stages:

* :class:`LocalLink` — both stages on this worker: the tensor is handed over in memory;
* :class:`DirectLink` — CPU workers (tests, the demo): gloo send/recv of CPU tensors; or CUDA
  workers with peer-to-peer: NCCL send/recv, GPU to GPU;
* :class:`StagedLink` — CUDA workers without peer-to-peer (consumer GPUs, or two workers sharing one
  GPU): GPU -> pinned host buffer -> gloo -> pinned host buffer -> GPU, on side streams and threads;

:class:`UploadArbiter` is the "priority prefetch" of Mobius §3.3 made real: CUDA stream priorities
do not order copies, so uploads of workers under one root complex are cut into chunks and a chunk
only starts when no upload of an earlier-starting stage under the same root complex is waiting.
The pending order of every worker lives in a small memory-mapped file in /dev/shm (same host);
waiters sleep on a futex in that file.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

log = logging.getLogger(__name__)
Waiter = Callable[[], torch.Tensor]


def all_gather_flat(out: torch.Tensor, mine: torch.Tensor, group: "dist.ProcessGroup | None" = None,
                    async_op: bool = False) -> "dist.Work | None":
    """All-gather every rank's equal slice into one flat tensor (``all_gather_single`` where torch
    has it, ``all_gather_into_tensor`` before)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, mine, group=group, async_op=async_op)


def reduce_scatter_flat(out: torch.Tensor, full: torch.Tensor, group: "dist.ProcessGroup | None" = None) -> None:
    """Sum a flat tensor over ranks and keep this rank's equal slice (``reduce_scatter_single`` where
    torch has it, ``reduce_scatter_tensor`` before)."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, full, group=group)


class Counters:
    """Bytes this worker moved, by kind (``h2d``, ``d2h``, ``p2p``, ``allgather``, ``reduce_scatter``),
    counted where each copy or collective is issued; :meth:`take` returns them and starts afresh."""

    KINDS = ("h2d", "d2h", "p2p")  # always reported (0 when nothing moved)

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.moved: dict[str, int] = {}

    def add(self, **nbytes: int) -> None:
        with self.lock:
            for kind, n in nbytes.items():
                self.moved[kind] = self.moved.get(kind, 0) + n

    def take(self) -> dict[str, int]:
        with self.lock:
            out = {**dict.fromkeys(self.KINDS, 0), **self.moved}
            self.moved = {}
            return out


class LocalLink:
    """Adjacent stages on the same worker: nothing moves."""

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
    workers standing in for GPUs, tagged), or GPU tensors through NCCL (peer-to-peer, in order)."""

    def __init__(self, peer: int, counters: Counters, device: torch.device | None = None,
                 group: dist.ProcessGroup | None = None):
        self.peer, self.counters, self.group = peer, counters, group
        self.device = device or torch.device("cpu")
        self.nccl = self.device.type == "cuda"  # NCCL matches sends and receives by order, not tag
        self.pending: list[tuple[dist.Work, torch.Tensor]] = []

    def send(self, t: torch.Tensor, tag: int) -> None:
        t = t.detach().contiguous()
        self.pending.append((dist.isend(t, self.peer, group=self.group, tag=0 if self.nccl else tag), t))
        self.counters.add(**({"p2p": t.nbytes} if self.nccl else {"d2h": t.nbytes}))

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, tag: int) -> Waiter:
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        work = dist.irecv(buf, self.peer, group=self.group, tag=0 if self.nccl else tag)
        if not self.nccl:
            self.counters.add(h2d=buf.nbytes)

        def wait() -> torch.Tensor:
            work.wait()
            return buf
        return wait

    def flush(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()


class StagedLink:
    """GPU tensors through pinned host memory and gloo, for GPUs without peer-to-peer access."""

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


class _Futex:
    """Sleep until a 32-bit word in shared memory changes, and wake its sleepers (Linux futex on a
    shared mapping, so across processes); elsewhere a short sleep stands in for the wait."""

    NUMBERS = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}
    WAIT, WAKE = 0, 1

    def __init__(self, word: np.ndarray):
        import ctypes
        import platform

        self.word, self.ctypes = word, ctypes
        self.addr = ctypes.c_void_p(word.ctypes.data)
        number = self.NUMBERS.get(platform.machine().lower()) if sys.platform.startswith("linux") else None
        self.syscall = (ctypes.CDLL(None, use_errno=True).syscall, number) if number else None

    def wait(self, seen: int, timeout_s: float) -> None:
        """Return when the word is no longer ``seen``, on a wake, or after ``timeout_s``."""
        if self.syscall is None:
            time.sleep(min(timeout_s, 1e-3))
            return
        fn, number = self.syscall
        ts = _Timespec(int(timeout_s), int((timeout_s % 1) * 1e9))
        fn(number, self.addr, self.WAIT, self.ctypes.c_int(seen), self.ctypes.byref(ts), None, 0)

    def bump_and_wake(self) -> None:
        self.word[0] = np.int32((int(self.word[0]) + 1) & 0x7FFFFFFF)
        if self.syscall is not None:
            fn, number = self.syscall
            fn(number, self.addr, self.WAKE, self.ctypes.c_int(2**31 - 1), None, None, 0)


def _timespec_type() -> type:
    import ctypes

    class Timespec(ctypes.Structure):
        _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]
    return Timespec


_Timespec = _timespec_type()


class UploadArbiter:
    """Serves uploads of workers under one root complex in the order their stages start.

    ``acquire(order)`` blocks until no worker of this root complex has a pending upload with a
    smaller order; call it before each chunk, and ``release()`` when the upload is done. The pending
    orders live in a small shared file in /dev/shm (workers on one host); a waiter sleeps on a futex
    that every release bumps (no busy waiting beside the CPU optimizer), re-checking at least every
    ``RECHECK_S`` in case a wake-up raced its sleep.
    """

    IDLE = np.iinfo(np.int64).max
    RECHECK_S = 0.01

    def __init__(self, name: str, rank: int, world: int, peers: list[int], create: bool):
        self.rank, self.peers = rank, [p for p in peers if p != rank]
        base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
        self.path = base / name
        size = 8 * world + 8
        if create:
            buf = np.zeros(size, dtype=np.uint8)
            buf[:8 * world].view(np.int64)[:] = self.IDLE
            buf.tofile(self.path)
        self.owner = create
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r+", shape=(size,))
        self.pending = self._map[:8 * world].view(np.int64)
        self._futex = _Futex(self._map[8 * world:8 * world + 4].view(np.int32))

    def acquire(self, order: int) -> None:
        self.pending[self.rank] = order
        while self.peers:
            seen = int(self._futex.word[0])
            if not any(self.pending[p] < order for p in self.peers):
                return
            self._futex.wait(seen, self.RECHECK_S)

    def release(self) -> None:
        self.pending[self.rank] = self.IDLE
        if self.peers:
            self._futex.bump_and_wake()

    def close(self) -> None:
        del self.pending, self._futex, self._map
        if self.owner:
            self.path.unlink(missing_ok=True)


def arbiter_name() -> str:
    """A shared-memory name unique to this run (the rendezvous port and the run's id)."""
    run = os.environ.get("TORCHELASTIC_RUN_ID") or str(os.getppid())
    return f"mobius-{os.environ.get('MASTER_PORT', '0')}-{run}"
