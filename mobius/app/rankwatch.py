"""Across the nodes of a torchrun run, every rank learns at once that another one ended without finishing.

On one machine torchrun's agent stops a node's other ranks when one of them fails. Across machines
nothing does: the ranks of the other nodes learn it from their next collective, and gloo (or NCCL)
may only raise at the collective's timeout (30 minutes), leaving the run hung. So every rank keeps one
TCP connection to rank 0 from its start (:class:`RankWatch`): a connection that closes before its
rank said it finished (a rank that raised, was killed, or whose machine went away: TCP keep-alive,
:data:`KEEPALIVE_S`, notices that within about 25 s) ends rank 0 with one line that names that rank, and rank 0
ending closes its connections after telling every other rank who was lost, which ends them the same
way. A watcher waits :data:`GRACE_S` before it ends its rank, so that a rank whose own main thread is
reporting the same failure (an error every rank raises together) prints that instead.
"""

from __future__ import annotations

import os
import selectors
import socket
import struct
import threading
import time

from mobius.app.settings import Torchrun
from mobius.app.supervise import claim_exit, leave
from mobius.errors import MobiusError

CONNECT_S = 60.0  # how long a rank tries to reach rank 0, and rank 0 waits for every rank
GRACE_S = 2.0  # how long a watcher lets its main thread report a failure first
KEEPALIVE_S = (10, 5, 3)  # idle seconds before TCP probes a quiet connection, seconds between probes, probes
FINISHED, LOST = b"F", b"L"  # "this rank finished"; (rank 0) "rank <int32> was lost", before it closes
_ending_together = threading.Event()  # every rank raises the same error (mobius.app.torchrun.on_ranks)


def ending_together() -> None:
    """Every rank of the run is about to raise the same error: a closed connection is no news."""
    _ending_together.set()


def _keepalive(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in zip(("TCP_KEEPIDLE", "TCP_KEEPINTVL", "TCP_KEEPCNT"), KEEPALIVE_S):
        if hasattr(socket, name):  # (Linux; other systems keep their defaults)
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class RankWatch:
    """This rank's side of the run's star of connections (rank 0 in the middle); :meth:`finish` once
    the run ended well here. Every rank constructs it together, after the default process group."""

    def __init__(self, run: Torchrun, port: int, server: socket.socket | None):
        self.run = run
        self.finished = threading.Event()
        self.conns: dict[int, socket.socket] = {}  # rank -> connection (rank 0: every other; else: rank 0)
        if server is not None:
            self._accept(server)
        else:
            self._connect(port)
        self.thread = threading.Thread(target=self._watch, name="mobius-rank-watch", daemon=True)
        self.thread.start()

    @staticmethod
    def listen() -> socket.socket:
        """(Rank 0) the server every other rank connects to, on every interface and a free port."""
        if socket.has_dualstack_ipv6():
            return socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True)
        return socket.create_server(("", 0))

    def _accept(self, server: socket.socket) -> None:
        deadline = time.monotonic() + CONNECT_S
        with server:
            while len(self.conns) < self.run.world - 1:
                server.settimeout(max(0.1, deadline - time.monotonic()))
                try:
                    conn, _ = server.accept()
                except socket.timeout:
                    raise MobiusError(f"rank 0 waited {CONNECT_S:.0f} s for the other ranks to connect (ranks "
                                      f"{sorted(set(range(1, self.run.world)) - set(self.conns))} did not)") from None
                conn.settimeout(CONNECT_S)
                said = _read(conn, 4)
                rank = struct.unpack("!i", said)[0] if said else -1
                if not 0 < rank < self.run.world or rank in self.conns:
                    conn.close()  # not one of this run's ranks (something else found the port)
                    continue
                conn.settimeout(None)
                _keepalive(conn)
                self.conns[rank] = conn

    def _connect(self, port: int) -> None:
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        try:
            conn = socket.create_connection((host, port), timeout=CONNECT_S)
            conn.sendall(struct.pack("!i", self.run.rank))
        except OSError as e:
            raise MobiusError(f"rank {self.run.rank} cannot reach rank 0 at {host}:{port} ({e}); the nodes must "
                              f"reach each other on any TCP port, as gloo and NCCL do") from None
        conn.settimeout(None)
        _keepalive(conn)
        self.conns[0] = conn

    def finish(self) -> None:
        """The run ended well on this rank: tell rank 0 (rank 0: every rank), then stop watching."""
        for conn in self.conns.values():
            try:
                conn.sendall(FINISHED)
            except OSError:
                pass  # that rank has ended (or this one stopped watching it) already
        self.finished.set()
        for conn in self.conns.values():
            try:
                conn.shutdown(socket.SHUT_RDWR)  # (after the word) wakes the watcher's wait on it
            except OSError:
                pass
        self.thread.join(timeout=GRACE_S + 1)

    # ---- the watcher thread ---------------------------------------------------------------------
    def _watch(self) -> None:
        """Wait on every connection (a rank other than 0: rank 0's) until its rank finished or this one did."""
        with selectors.DefaultSelector() as sel:
            for rank, conn in self.conns.items():
                sel.register(conn, selectors.EVENT_READ, rank)
            while sel.get_map() and not self.finished.is_set():
                for key, _ in sel.select(timeout=0.5):
                    word = _read(key.fileobj, 1)
                    if word == LOST:  # (from rank 0) it is ending, having waited its grace: no second one
                        self._lost(struct.unpack("!i", _read(key.fileobj, 4) or b"\0\0\0\0")[0], grace=0.0)
                    elif word != FINISHED:  # that rank ended before it finished (or this one finishes)
                        self._lost(key.data)
                    sel.unregister(key.fileobj)
        for conn in self.conns.values():
            conn.close()

    def _lost(self, rank: int, grace: float = GRACE_S) -> None:
        """Rank ``rank`` ended before it finished: end this rank (after ``grace``, unless it finished or every
        rank is raising the same error meanwhile); rank 0 first tells every other rank."""
        if self.finished.wait(grace) or _ending_together.is_set():
            return
        claim_exit()
        if self.run.rank == 0:
            for conn in self.conns.values():
                try:
                    conn.sendall(LOST + struct.pack("!i", rank))
                except OSError:
                    pass
        leave(f"mobius: error: rank {self.run.rank} lost its connection to another rank, which failed or was "
              f"stopped (rank {rank} ended before it finished)")


def _read(conn: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes from ``conn``; b"" if it closes first."""
    data = b""
    while len(data) < n:
        try:
            more = conn.recv(n - len(data))
        except OSError:
            more = b""
        if not more:
            return b""
        data += more
    return data
