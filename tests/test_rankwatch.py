"""The torchrun ranks' watch on each other (:mod:`mobius.app.rankwatch`), on its own: plain processes that
join the star of connections and neither train nor hold a process group, so that nothing but the watch
can end them."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mobius.app.rankwatch import GRACE_S

ROOT = Path(__file__).resolve().parents[1]
RANK = """
import sys, time
from mobius.app.rankwatch import RankWatch
from mobius.app.settings import Torchrun
rank, world, port, stay = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
server = RankWatch.listen() if rank == 0 else None
if server is not None:
    print(server.getsockname()[1], flush=True)
watch = RankWatch(Torchrun(rank, world, 0, 1, rank, "test", world), port, server)
print("watching", flush=True)
time.sleep(stay)
t0 = time.perf_counter()
watch.finish()
print(f"finished in {time.perf_counter() - t0:.3f} s", flush=True)
"""


def _ranks(stays: list[float]) -> list[subprocess.Popen]:
    """One process per rank, each staying ``stays[rank]`` seconds once every rank watches, then finishing."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MASTER_ADDR": "127.0.0.1"}

    def start(rank: int, port: int) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", RANK, str(rank), str(len(stays)), str(port), str(stays[rank])],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    ranks = [start(0, 0)]
    port = int(ranks[0].stdout.readline())
    ranks += [start(r, port) for r in range(1, len(stays))]
    for p in ranks:
        assert p.stdout.readline().strip() == "watching", p.communicate()[1]
    return ranks


def _ended(ranks: list[subprocess.Popen], within: float) -> list[tuple[int, str, str]]:
    """(exit code, stdout, stderr) of each rank."""
    deadline = time.time() + within
    out = []
    for p in ranks:
        try:
            code = p.wait(timeout=max(0.1, deadline - time.time()))
            # (read, not communicate(): that reads the pipe past what readline() has buffered)
            out.append((code, p.stdout.read(), p.stderr.read()))
        except subprocess.TimeoutExpired:
            for q in ranks:
                q.kill()
            pytest.fail(f"a rank did not end within {within} s")
    return out


@pytest.mark.parametrize("victim", [2, 0])
def test_a_killed_rank_ends_every_other_one_with_a_line_naming_it(victim: int) -> None:
    ranks = _ranks([600.0] * 3)
    ranks[victim].send_signal(signal.SIGKILL)
    start = time.time()
    ended = _ended([p for r, p in enumerate(ranks) if r != victim], within=GRACE_S + 10)
    assert time.time() - start < GRACE_S + 10
    for code, _, err in ended:
        assert code == 1
        assert err.count("\n") == 1 and err.startswith("mobius: error: rank ")
        assert f"lost its connection to another rank, which failed or was stopped (rank {victim} ended" in err


def test_ranks_that_finish_one_after_another_end_quietly_and_at_once() -> None:
    stays = [0.6, 0.1, 1.2]  # rank 0 finishes between the others
    ended = _ended(_ranks(stays), within=30)
    assert [(code, err) for code, _, err in ended] == [(0, "")] * 3
    for _, out, _ in ended:  # no rank waits out a grace or its watcher's join
        took = re.fullmatch(r"finished in (\S+) s\n", out)
        assert took and float(took.group(1)) < GRACE_S / 2, out
