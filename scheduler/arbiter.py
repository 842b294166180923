"""The upload arbiter: Mobius §3.3's "priority prefetch" made real.

CUDA stream priorities do not order copies, so uploads of workers under one root complex are cut
into chunks and a chunk only starts when no upload of an earlier-starting stage under the same root
complex is waiting. The pending order of every worker lives in a small memory-mapped file in
/dev/shm (same host); waiters sleep on a futex in that file. The file is removed as soon as every
worker has mapped it (the mappings live on), so no way of ending a run leaves it behind; files of a
run that died in that moment are removed by the next run (:func:`remove_stale`).
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np


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
        self.path = shm_dir() / name
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

    def unlink(self) -> None:
        """Remove the file (every worker has mapped it: the mappings stay valid)."""
        if self.owner:
            self.path.unlink(missing_ok=True)
            self.owner = False

    def close(self) -> None:
        del self.pending, self._futex, self._map
        self.unlink()


NAME = re.compile(r"mobius-arbiter-(\d+)-[0-9a-f]{8}")  # the creator's pid
OLD_NAME = re.compile(r"mobius-\d+-mobius-(\d+)-[0-9a-f]{8}")  # mobius <= 0.3: port, then the run id of a spawn


def arbiter_name() -> str:
    """A shared-memory name unique to this run, naming the process that creates the file."""
    return f"mobius-arbiter-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def shm_dir() -> Path:
    return Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())


def remove_stale(directory: Path | None = None) -> list[Path]:
    """Remove arbiter files whose creating process is gone (only mobius's own naming); the removed."""
    removed = []
    for path in (directory or shm_dir()).glob("mobius-*"):
        found = NAME.fullmatch(path.name) or OLD_NAME.fullmatch(path.name)
        if found and not _alive(int(found.group(1))):
            try:
                path.unlink()
                removed.append(path)
            except OSError:
                continue
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
