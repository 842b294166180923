"""What a worker moved in a step: bytes by kind, counted where each copy or collective is issued
(both runtimes report these figures, and ``tests/test_traffic.py`` holds them against the planners')."""

from __future__ import annotations

import threading


class Counters:
    """Bytes this worker moved, by kind (``h2d``, ``d2h``, ``p2p``, ``allgather``, ``reduce_scatter``),
    counted where each copy or collective is issued, and the bytes of its messages that found their mailbox
    full (``overflow``: they went through gloo, also counted as ``d2h``); :meth:`take` returns them and starts
    afresh."""

    KINDS = ("h2d", "d2h", "p2p", "overflow")  # always reported (0 when nothing moved)

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
