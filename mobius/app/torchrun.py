"""Runs that ``torchrun`` started: every process runs ``mobius train``, mobius starts no workers itself.

Rendezvous, the workers' environment and their supervision are torchrun's (c10d store, one agent per
node). The processes first join the default process group -- gloo, for the control traffic: errors,
barriers, the plan, checkpoint coordination and the step's statistics; the engines make their own NCCL
groups for tensors between GPUs. Then (:func:`mobius.app.run.train`): rank 0 claims ``output.dir``, every
node checks it sees that directory, the data is tokenized once per node, rank 0 plans (and for
``parallel.mode: auto`` chooses the mode) and sends the plan to every rank, and each rank resolves its
settings from the global world size and its own node's topology.

A failure in one of these steps on any rank is raised on every rank (:func:`on_ranks`), so every
process ends with the same one-line message instead of waiting for a peer that has left.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch.distributed as dist

from mobius.app.launch import TIMEOUT
from mobius.app.rankwatch import RankWatch, ending_together
from mobius.app.settings import Torchrun
from mobius.errors import MobiusError

log = logging.getLogger(__name__)
T = TypeVar("T")


def init() -> None:
    """Join the run's default process group (gloo; torchrun's environment says where its store is)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=TIMEOUT)


def watch_ranks(run: Torchrun) -> RankWatch:
    """(Every rank, once the default group exists) this rank's connection to rank 0 that ends it as soon as
    a rank on another node ends before it finished (:mod:`mobius.app.rankwatch`)."""
    server = RankWatch.listen() if run.rank == 0 else None
    port = from_rank0(lambda: server.getsockname()[1])
    return on_ranks(lambda: RankWatch(run, port, server), True)


def on_ranks(fn: Callable[[], T], mine: bool) -> T | None:
    """Run ``fn`` on the ranks where ``mine`` is true (a collective: every rank calls it). If it fails
    anywhere, every rank raises: the failing rank its own exception, the others a MobiusError with the
    first failure's message (the same text, for a MobiusError)."""
    result, error = None, None
    if mine:
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 -- every rank must learn of it before anyone raises
            error = e
    failures: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(failures, None if error is None else _describe(error))
    first = next(((rank, f) for rank, f in enumerate(failures) if f is not None), None)
    if first is not None:
        ending_together()  # (every rank raises now: a peer's closed connection is no news)
    if error is not None:
        raise error
    if first is not None:
        rank, (is_mobius, text) = first
        raise MobiusError(text if is_mobius else f"rank {rank} failed: {text}")
    return result


def _describe(e: Exception) -> tuple[bool, str]:
    if isinstance(e, MobiusError):
        return True, str(e)
    return False, f"{type(e).__name__}: {e}".splitlines()[0]


def from_rank0(fn: Callable[[], T]) -> T:
    """``fn()`` computed on rank 0 and given to every rank (an error there is raised everywhere)."""
    box = [on_ranks(fn, dist.get_rank() == 0)]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def check_shared_dir(directory: Path, run: Torchrun) -> None:
    """Every rank sees what rank 0 writes in ``directory``: all ranks write their shards of a checkpoint
    into one temporary directory there, which rank 0 renames into place."""
    marker = directory / f".mobius-shared-{run.run_id}"

    def mark() -> None:
        directory.mkdir(parents=True, exist_ok=True)
        marker.write_text(f"written by rank 0 of torchrun run {run.run_id}\n")
    on_ranks(mark, run.rank == 0)
    seen: list[Any] = [None] * run.world
    dist.all_gather_object(seen, marker.is_file())
    dist.barrier()
    if run.rank == 0:
        marker.unlink(missing_ok=True)
    blind = [rank for rank, ok in enumerate(seen) if not ok]
    if blind:
        raise MobiusError(f"output.dir {directory} is not shared between the nodes: rank(s) {blind} do not see what "
                          f"rank 0 writes there, and every rank writes its part of each checkpoint there; put "
                          f"output.dir on a filesystem that every node mounts (NFS, Lustre, ...)")


def prepare_per_node(prepare: Callable[[], T], run: Torchrun) -> T:
    """``prepare()`` (which tokenizes into ``data.cache_dir``) once per node first -- rank 0, then the
    first rank of each other node (which finds rank 0's cache when the directory is shared) -- then on
    every rank, which maps the cache."""
    on_ranks(prepare, run.rank == 0)
    on_ranks(prepare, run.local_rank == 0 and run.rank != 0)
    return on_ranks(prepare, True)
