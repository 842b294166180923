"""Measure host<->GPU and GPU<->GPU copy bandwidth (``mobius topo --bench``).

For every GPU, alone: pinned host->GPU, GPU->host, and both directions at once (two streams). For
every root complex: k concurrent upload streams, then k download streams, for k = 1 ..
``max_streams(group)`` = max(its GPUs, 2), the streams dealt round-robin over its GPUs
(:func:`stream_plan`) -- the contention the Mobius paper is about, as a function of the number of
DMA streams; with k = number of GPUs every GPU copies at once (the group's totals), and a one-GPU
root complex also runs two streams on its GPU (do its copy engines share the link?). For every pair
that CUDA allows peer access: a GPU->GPU copy. Results form a
:class:`topology.bandwidth.Bandwidth` (schema ``mobius.bandwidth/1``).

Method: each copy moves one large buffer (``size_bytes``, default 256 MiB) between pinned host
memory and the GPU on a dedicated ``torch.cuda`` stream of its device; after one warm-up copy,
``repeats`` copies are timed with CUDA events recorded on that stream. Concurrent copies are issued
from this one process on every stream (each with its own buffers), repeat by repeat, and each
stream is timed by its own events. The aggregate is all bytes over the longest stream time
(:func:`aggregate_GBps`), and the per-GPU figure is the rate of the slowest GPU (the total divided
by the number of GPUs): copy engines need not share a link fairly, so a mean of per-stream rates
would credit the stream that happened to finish first. Peer copies are timed by
wall clock around synchronised copies (CUDA issues them on the source device's current stream with
barriers to the destination's). Host buffers are allocated per GPU; their NUMA placement is left
to the operating system.
"""

from __future__ import annotations

import datetime as _dt
import logging
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from topology.bandwidth import Bandwidth, GPUBandwidth, RootComplexBandwidth
from topology.errors import TopologyUnavailable
from topology.model import Topology

log = logging.getLogger(__name__)

MiB = 1 << 20


def _torch() -> Any:
    try:
        import torch
    except ImportError as e:
        raise TopologyUnavailable(f"PyTorch is not installed ({e}): nothing to measure with") from None
    return torch


def require_cuda() -> int:
    """Number of CUDA GPUs; raises TopologyUnavailable when there is none."""
    torch = _torch()
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        raise TopologyUnavailable("no CUDA GPU: nothing to measure (this torch build or machine has no usable GPU)")
    return int(torch.cuda.device_count())


@dataclass
class _Buffers:
    """One GPU's buffers: pinned host source/destination and device source/destination."""

    device: int
    host_src: Any
    host_dst: Any
    dev_src: Any
    dev_dst: Any
    up: Any  # stream for host->GPU copies
    down: Any  # stream for GPU->host copies


def _buffers(torch: Any, device: int, size: int) -> _Buffers:
    dev = torch.device("cuda", device)
    return _Buffers(
        device, torch.empty(size, dtype=torch.uint8, pin_memory=True), torch.empty(size, dtype=torch.uint8, pin_memory=True),
        torch.empty(size, dtype=torch.uint8, device=dev), torch.empty(size, dtype=torch.uint8, device=dev),
        torch.cuda.Stream(device=dev), torch.cuda.Stream(device=dev),
    )


@dataclass
class _Job:
    """Copies to run on one stream: ``copy()`` enqueues one copy of ``size`` bytes."""

    device: int
    stream: Any
    copy: Callable[[], None]


@dataclass
class _BufferPool:
    """Buffers per (device, lane), allocated on first use; lane k serves a device's k-th concurrent stream."""

    torch: Any
    size: int
    bufs: dict[tuple[int, int], _Buffers] = field(default_factory=dict)

    def get(self, device: int, lane: int = 0) -> _Buffers:
        """The buffers and streams of ``device``'s lane ``lane``."""
        if (device, lane) not in self.bufs:
            self.bufs[(device, lane)] = _buffers(self.torch, device, self.size)
        return self.bufs[(device, lane)]

    def drop_extra_lanes(self) -> None:
        """Let go of every lane but the first (torch's pinned-memory cache hands them to the next user)."""
        for key in [k for k in self.bufs if k[1] > 0]:
            del self.bufs[key]


def _upload(b: _Buffers) -> _Job:
    return _Job(b.device, b.up, lambda: b.dev_dst.copy_(b.host_src, non_blocking=True))


def _download(b: _Buffers) -> _Job:
    return _Job(b.device, b.down, lambda: b.host_dst.copy_(b.dev_src, non_blocking=True))


def _time_jobs(torch: Any, jobs: list[_Job], repeats: int) -> list[float]:
    """Seconds each job's ``repeats`` copies took, all jobs issued together (CUDA events)."""
    for job in jobs:  # warm-up
        with torch.cuda.device(job.device), torch.cuda.stream(job.stream):
            job.copy()
    for d in {j.device for j in jobs}:
        torch.cuda.synchronize(d)
    events = []
    for job in jobs:
        with torch.cuda.device(job.device):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(job.stream)
        events.append((start, end))
    for _ in range(repeats):
        for job in jobs:
            with torch.cuda.device(job.device), torch.cuda.stream(job.stream):
                job.copy()
    for job, (_, end) in zip(jobs, events):
        end.record(job.stream)
    for job, (_, end) in zip(jobs, events):
        end.synchronize()
    return [start.elapsed_time(end) / 1e3 for start, end in events]


def _peer(torch: Any, src: _Buffers, dst: _Buffers, size: int, repeats: int) -> float:
    """GB/s of src GPU -> dst GPU copies (wall clock around synchronised copies)."""
    dst.dev_dst.copy_(src.dev_src)
    torch.cuda.synchronize(src.device)
    torch.cuda.synchronize(dst.device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        dst.dev_dst.copy_(src.dev_src, non_blocking=True)
    torch.cuda.synchronize(src.device)
    torch.cuda.synchronize(dst.device)
    return size * repeats / (time.perf_counter() - t0) / 1e9


def _groups(topo: Topology | None, n: int) -> list[list[int]]:
    if topo is not None and topo.num_gpus == n:
        return [list(g) for g in topo.root_complexes]
    if topo is not None:
        log.warning("the topology has %d GPUs but CUDA sees %d: measuring each GPU as its own root complex", topo.num_gpus, n)
    return [[i] for i in range(n)]


def max_streams(group: Sequence[int]) -> int:
    """Most concurrent copy streams measured on a root complex: one per GPU, and at least two."""
    return max(len(group), 2)


def stream_plan(group: Sequence[int], streams: int) -> list[tuple[int, int]]:
    """(device, lane) of each of ``streams`` concurrent copy streams dealt round-robin over ``group``.

    Stream s runs on ``group[s % len(group)]``; its lane ``s // len(group)`` numbers the streams that
    one device carries (each lane has its own buffers and CUDA stream).
    """
    if not group or streams < 1:
        raise ValueError(f"need a non-empty group and at least one stream, got {list(group)} and {streams}")
    return [(group[s % len(group)], s // len(group)) for s in range(streams)]


def aggregate_GBps(bytes_per_stream: float, seconds: Sequence[float]) -> float:
    """Aggregate GB/s of concurrent streams that each moved ``bytes_per_stream``: all bytes over the longest time."""
    if not seconds or min(seconds) <= 0:
        raise ValueError(f"need one positive time per stream, got {list(seconds)}")
    return len(seconds) * bytes_per_stream / max(seconds) / 1e9


def stream_sweep(group: Sequence[int], bytes_per_stream: float,
                 time_plan: Callable[[list[tuple[int, int]]], list[float]]) -> list[float]:
    """Aggregate GB/s with k = 1 .. :func:`max_streams` concurrent streams on ``group`` (index k - 1).

    ``time_plan`` runs the streams of one :func:`stream_plan` at once and returns each one's seconds.
    """
    return [aggregate_GBps(bytes_per_stream, time_plan(stream_plan(group, k))) for k in range(1, max_streams(group) + 1)]


def root_complex_figures(group: Sequence[int], alone: tuple[float, float], h2d: Sequence[float],
                         d2h: Sequence[float]) -> RootComplexBandwidth:
    """The bandwidth entry of one root complex from its stream sweeps (GB/s, index k - 1).

    The all-GPUs totals are the sweep's entry at k = number of GPUs; a one-GPU group takes its
    GPU's ``alone`` (upload, download) rates instead, as before the sweep existed.
    """
    k = len(group)
    up, down = alone if k == 1 else (h2d[k - 1], d2h[k - 1])
    return RootComplexBandwidth(list(group), round(up / k, 2), round(down / k, 2), round(up, 2), round(down, 2),
                                [round(x, 2) for x in h2d], [round(x, 2) for x in d2h])


def _progress(total: int, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc="bandwidth", unit="test", disable=not enabled, leave=False)


def measure(topo: Topology | None = None, size_bytes: int = 256 * MiB, repeats: int = 5, progress: bool = True) -> Bandwidth:
    """Run the whole benchmark on this machine's CUDA GPUs.

    ``topo`` gives the root complexes (usually ``topology.detect()``); without it every GPU is its
    own. Raises :class:`TopologyUnavailable` when there is no CUDA GPU.
    """
    n = require_cuda()
    torch = _torch()
    groups = _groups(topo, n)
    pairs = [(i, j) for i in range(n) for j in range(n) if i != j and torch.cuda.can_device_access_peer(i, j)]
    pool = _BufferPool(torch, size_bytes)
    gb = size_bytes * repeats / 1e9
    per_gpu: list[tuple[float, float, float]] = []
    with _progress(3 * n + sum(2 * max_streams(g) for g in groups) + len(pairs), progress) as bar:
        for d in range(n):
            b = pool.get(d)
            up, down = _time_jobs(torch, [_upload(b)], repeats)[0], _time_jobs(torch, [_download(b)], repeats)[0]
            both = max(_time_jobs(torch, [_upload(b), _download(b)], repeats))
            per_gpu.append((gb / up, gb / down, 2 * gb / both))
            bar.update(3)
        rcs = [_root_complex(torch, pool, g, per_gpu, repeats, bar) for g in groups]
        p2p: list[list[float | None]] = [[None] * n for _ in range(n)]
        for i, j in pairs:
            p2p[i][j] = round(_peer(torch, pool.get(i), pool.get(j), size_bytes, repeats), 2)
            bar.update(1)
    names = [torch.cuda.get_device_name(d) for d in range(n)]
    return Bandwidth(
        measured_at=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), host=socket.gethostname(),
        torch=str(torch.__version__), buffer_bytes=int(size_bytes),
        gpus=[GPUBandwidth(i, names[i], *(round(x, 2) for x in per_gpu[i])) for i in range(n)],
        root_complexes=rcs, p2p_GBps=p2p,
    )


def _root_complex(torch: Any, pool: _BufferPool, group: list[int], per_gpu: list[tuple[float, float, float]],
                  repeats: int, bar: Any) -> RootComplexBandwidth:
    """Stream sweeps of one root complex, uploads then downloads, turned into its bandwidth entry."""

    def timer(job: Callable[[_Buffers], _Job]) -> Callable[[list[tuple[int, int]]], list[float]]:
        def time_plan(plan: list[tuple[int, int]]) -> list[float]:
            seconds = _time_jobs(torch, [job(pool.get(device, lane)) for device, lane in plan], repeats)
            bar.update(1)
            return seconds
        return time_plan

    moved = pool.size * repeats
    h2d, d2h = stream_sweep(group, moved, timer(_upload)), stream_sweep(group, moved, timer(_download))
    pool.drop_extra_lanes()
    up, down, _ = per_gpu[group[0]]
    return root_complex_figures(group, (up, down), h2d, d2h)


def heatmap_png(bandwidth: Bandwidth, path: str | Path) -> Path:
    """Draw the per-GPU rates and the peer-copy matrix as heat maps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    n = bandwidth.num_gpus
    rc_of = {i: rc for rc in bandwidth.root_complexes for i in rc.gpus}
    cols = ["H2D", "D2H", "both", "H2D conc.", "D2H conc."]
    host = np.array([[g.h2d_GBps, g.d2h_GBps, g.bidir_GBps, rc_of[g.index].h2d_concurrent_GBps_per_gpu,
                      rc_of[g.index].d2h_concurrent_GBps_per_gpu] for g in bandwidth.gpus])
    peer = np.array([[np.nan if x is None else x for x in row] for row in bandwidth.p2p_GBps], dtype=float)
    fig, axes = plt.subplots(1, 2, figsize=(6 + 0.9 * n, 1.5 + 0.55 * n), squeeze=False)
    _panel(fig, axes[0][0], host, cols, [f"GPU{i}" for i in range(n)], "host <-> GPU, GB/s")
    _panel(fig, axes[0][1], peer, [f"GPU{j}" for j in range(n)], [f"GPU{i}" for i in range(n)], "peer copy row -> column, GB/s")
    fig.suptitle(f"{bandwidth.host}  {bandwidth.measured_at}  ({bandwidth.buffer_bytes // MiB} MiB copies)", fontsize=9)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def _panel(fig: Any, ax: Any, data: Any, xlabels: list[str], ylabels: list[str], title: str) -> None:
    import numpy as np

    masked = np.ma.masked_invalid(data)
    im = ax.imshow(masked, cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(xlabels)), xlabels, rotation=45, ha="right", fontsize=8)
    ax.set_yticks(range(len(ylabels)), ylabels, fontsize=8)
    ax.set_title(title if masked.count() else f"{title}\n(none allowed or measured)", fontsize=9)
    mid = float(np.nanmean(data)) if masked.count() else 0.0
    for (r, c), v in np.ndenumerate(data):
        text, color = ("-", "0.4") if np.isnan(v) else (f"{v:.1f}", "k" if v > mid else "w")
        ax.text(c, r, text, ha="center", va="center", fontsize=7, color=color)
    if masked.count():
        fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
