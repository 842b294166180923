"""How a run is spread over devices: one validated value, resolved once (in ``mobius.app.settings``)
from the config and the machine, and passed to every path that needs any part of it."""

from __future__ import annotations

import os
import platform
import sys
from dataclasses import dataclass
from typing import Literal

from mobius.errors import ConfigError

Mode = Literal["single", "pipeline", "zero"]


def mailboxes_work_here(device: str, nodes: int, p2p: bool = False) -> bool:
    """Whether workers hand activations through mailboxes in host memory they all map
    (``scheduler.links.Mailboxes``): the workers of one machine whose stores are seen in the order they are made
    (x86-64), with Linux's futexes to sleep on; CPU workers, and GPUs without peer access (those with it use
    NCCL)."""
    return (device in ("cpu", "cuda") and not (device == "cuda" and p2p) and nodes == 1
            and sys.platform == "linux" and platform.machine().lower() in ("x86_64", "amd64"))


@dataclass(frozen=True)
class ParallelSettings:
    """The resolved parallel layout of a run.

    ``workers`` processes (one in single mode) run on ``device``, ``workers / nodes`` on each machine
    (``nodes`` > 1 only under ``torchrun --nnodes``); on CUDA, local worker ``w`` uses GPU ``w % gpus``,
    so several workers may share one GPU (``shared_gpu``: each capped at ``memory_bytes``, transfers
    staged through host memory). ``groups`` lists the workers whose host transfers share a link (a
    root complex, or one GPU's link); uploads within a group are served in stage order.
    """

    mode: Mode
    device: Literal["cpu", "cuda"]
    workers: int
    gpus: int  # CUDA devices in use (0 on the CPU)
    p2p: bool  # activations GPU to GPU (NCCL); else through pinned host memory (or gloo on the CPU)
    memory_bytes: int  # usable device memory per worker (what the planner budgets; the cap on a shared GPU)
    memory_capped: bool  # enforce memory_bytes with set_per_process_memory_fraction
    cpu_threads: int  # torch threads per worker
    groups: tuple[tuple[int, ...], ...]
    reason: str = ""  # why this mode (and device) were chosen
    nodes: int = 1  # machines the workers are spread over (torchrun's nodes), the same number on each
    cpu_pinning: bool = False  # GPU workers' CPU update threads kept off their dispatch and copy threads' cores

    def __post_init__(self) -> None:
        rules = [(self.nodes >= 1 and self.workers % self.nodes == 0, "the workers split evenly over the nodes"),
                 (self.workers >= 1 and self.cpu_threads >= 1 and self.memory_bytes > 0,
                  "at least one worker, one CPU thread and some device memory"),
                 ((self.device == "cpu") == (self.gpus == 0), "GPUs in use exactly when the device is cuda"),
                 (self.mode != "single" or self.workers == 1, "single mode runs one worker"),
                 (sorted(w for g in self.groups for w in g) == list(range(self.workers)),
                  "every worker in exactly one link group"),
                 (not self.p2p or (self.device == "cuda" and not self.shared_gpu),
                  "peer-to-peer only between GPUs of their own")]
        broken = [what for ok, what in rules if not ok]
        if broken:
            raise ConfigError(f"inconsistent parallel settings ({'; '.join(broken)}): {self}")

    @property
    def local_workers(self) -> int:
        """Workers on each machine."""
        return self.workers // self.nodes

    @property
    def shared_gpu(self) -> bool:
        """Several workers on one GPU."""
        return self.device == "cuda" and self.local_workers > self.gpus

    def gpu_of(self, worker: int) -> int | None:
        """The CUDA device index of a worker (None on the CPU)."""
        return worker % self.gpus if self.device == "cuda" else None

    def activation_path(self) -> str:
        if self.workers == 1:
            return "on one device"
        if self.p2p:
            return "GPU to GPU (NCCL)"
        if mailboxes_work_here(self.device, self.nodes):
            return "through mailboxes in shared host memory" + (" (page-locked)" if self.device == "cuda" else "")
        return "gloo between CPU workers" if self.device == "cpu" else "through pinned host memory and gloo"

    def describe(self) -> str:
        where = "CPU worker process(es)" if self.device == "cpu" else f"GPU(s) ({self.gpus} in use)"
        nodes = f" on {self.nodes} nodes" if self.nodes > 1 else ""
        return (f"mode {self.mode}: {self.workers} {where}{nodes}, {self.memory_bytes / 2**30:.1f} GiB each, "
                f"{self.cpu_threads} CPU thread(s) per worker{' (updates pinned)' if self.cpu_pinning else ''}, "
                f"activations {self.activation_path()}"
                + (f" ({self.reason})" if self.reason else ""))


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the OS tells it, else the machine's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
