"""The CPU AdamW rates the planner plans with: one worker's measured alone on this machine (the
runtime's own :class:`~mobius.optim.FlatAdamW`), the host's total with ``N`` workers updating at once
(:func:`measure_host_update`: they share its memory bandwidth and cores), or as a run measured them
inside its training steps; cached per CPU model, workers, thread count, precision and gradient dtype.
Also the rate of a streaming add in host memory (:func:`host_memory_rate`), CPU workers' memory in zero mode."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any

from mobius.files import write_text_atomic
from partition.hardware import CPU_UPDATE_IN_STEP
from partition.measure import _time

log = logging.getLogger(__name__)


CPU_UPDATE_NUMEL = 1 << 24  # parameters in the timed AdamW step (large enough to leave the caches)


def update_step(numel: int, precision: str = "fp32", half_grads: bool = False, states: str = "fp32") -> Any:
    """A FlatAdamW step over ``numel`` parameters with ``states``' moments, as a pipeline worker's optimizer thread
    runs it."""
    import torch

    from mobius.config import TrainSection
    from mobius.engine import DTYPES
    from mobius.optim import FlatAdamW

    dtype = DTYPES[precision]
    half = torch.empty(numel, dtype=dtype) if precision != "fp32" else None
    grad = torch.full((numel,), 1e-3, dtype=dtype if half_grads else torch.float32)
    opt = FlatAdamW(torch.zeros(numel), half, [(0, numel, True)],
                    TrainSection(weight_decay=0.1, optimizer_states=states))
    return lambda: opt.step(grad, 1e-4, 0.5)


def measure_cpu_update(threads: int, precision: str, numel: int = CPU_UPDATE_NUMEL, reps: int = 11,
                       half_grads: bool = False, states: str = "fp32") -> float:
    """Parameters per second of the pipeline's CPU update on this machine with ``threads`` threads:
    the runtime's own :class:`~mobius.optim.FlatAdamW` on a flat fp32 master copy, writing the
    half-precision copy (bf16/fp16) in the same pass, from fp32 gradients or (``half_grads``)
    half-precision ones -- what each pipeline worker's optimizer thread runs. The median of ``reps``
    steps: with 3, the plans of one H100 box measured 3.9 and 3.2 G params/s in two runs of one setting."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        return numel / _time(update_step(numel, precision, half_grads, states), torch.device("cpu"), reps, 1)
    finally:
        torch.set_num_threads(before)


def measure_host_update(workers: int, threads: int, precision: str, numel: int = CPU_UPDATE_NUMEL, reps: int = 2,
                        half_grads: bool = False, states: str = "fp32") -> float:
    """Parameters per second of ``workers`` CPU updates running at once on this machine, in total:
    each a :func:`measure_cpu_update` step of its own ``numel`` parameters with ``threads`` threads,
    started together (one Python thread each; the kernels release the GIL), timed until the last ends."""
    import threading

    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        steps = [update_step(numel, precision, half_grads, states) for _ in range(workers)]
        for step in steps:
            step()  # warm-up: first-touch page faults
        start, seconds = threading.Barrier(workers), [0.0] * workers

        def run(i: int) -> None:
            start.wait()
            t0 = time.perf_counter()
            for _ in range(reps):
                steps[i]()
            seconds[i] = time.perf_counter() - t0

        pool = [threading.Thread(target=run, args=(i,)) for i in range(workers)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        return workers * numel * reps / max(seconds)
    finally:
        torch.set_num_threads(before)


HOST_MEMORY_NUMEL = 1 << 24  # fp32 elements of the timed streaming add (192 MiB of traffic: beyond the caches)


def measure_host_memory(threads: int, numel: int = HOST_MEMORY_NUMEL, reps: int = 5) -> float:
    """Bytes per second of a streaming fp32 add (``a += b``: 12 bytes an element) on this machine's CPU with
    ``threads`` threads: the rate a CPU worker folds gradients into sums and copies chunks at (zero mode's
    "device" memory on CPU workers)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        a, b = torch.zeros(numel), torch.ones(numel)
        return 12 * numel / _time(lambda: a.add_(b), torch.device("cpu"), reps, 1)
    finally:
        torch.set_num_threads(before)


def host_memory_rate(threads: int, cache_dir: str | Path | None = None) -> float:
    """:func:`measure_host_memory`, cached per CPU model and thread count."""
    path = _cache_path(cache_dir, threads, "memory-add")
    rate = _read_rate(path, "bytes_per_s")
    if rate is not None:
        return rate
    rate = measure_host_memory(threads)
    log.info("CPU memory: a streaming fp32 add at %.1f GB/s with %d thread(s)", rate / 1e9, threads)
    if path is not None:
        _write_rate(path, rate, "bytes_per_s", threads=threads)
    return rate


IN_STEP = "in-step"


def _cache_path(cache_dir: str | Path | None, *what: object) -> Path | None:
    """The cache file of one measured rate on this CPU model: ``what`` names it (thread count first, then
    what was measured: the CPU update's precision, gradient dtype and kind, or the memory add)."""
    import platform

    key = hashlib.sha1(json.dumps([_cpu_name(), platform.machine(), *what]).encode()).hexdigest()[:16]
    return Path(cache_dir) / "cpu_update" / f"{key}.json" if cache_dir is not None else None


def _read_rate(path: Path | None, unit: str = "params_per_s") -> float | None:
    if path is None or not path.is_file():
        return None
    try:
        return float(json.loads(path.read_text())[unit])
    except (OSError, ValueError, KeyError):
        return None


def _write_rate(path: Path, rate: float, unit: str = "params_per_s", **about: Any) -> None:
    write_text_atomic(path, json.dumps({unit: rate, "cpu": _cpu_name(), **about}))


def _rule(states: str) -> tuple[str, ...]:
    """What a rate's cache key adds for the optimizer states (nothing for fp32: the keys from before they came)."""
    return () if states == "fp32" else (f"states-{states}",)


def cpu_update_rate(threads: int, precision: str, cache_dir: str | Path | None = None,
                    half_grads: bool = False, states: str = "fp32") -> float:
    """:func:`measure_cpu_update`, cached per CPU model, thread count, precision, gradient dtype and optimizer
    states."""
    path = _cache_path(cache_dir, threads, precision, half_grads, "flat-v2", *_rule(states))
    rate = _read_rate(path)
    if rate is not None:
        return rate
    rate = measure_cpu_update(threads, precision, half_grads=half_grads, states=states)
    log.info("CPU AdamW%s%s with %s moments: %.2f G params/s with %d thread(s)",
             "" if precision == "fp32" else " + half copy", " from half gradients" if half_grads else "", states,
             rate / 1e9, threads)
    if path is not None:
        _write_rate(path, rate, threads=threads, precision=precision, half_grads=half_grads, states=states)
    return rate


def host_update_rate(workers: int, threads: int, precision: str, cache_dir: str | Path | None = None,
                     half_grads: bool = False, states: str = "fp32") -> float:
    """:func:`measure_host_update` (one worker: :func:`cpu_update_rate`), cached like it."""
    if workers <= 1:
        return cpu_update_rate(threads, precision, cache_dir, half_grads, states)
    path = _cache_path(cache_dir, threads, precision, half_grads, f"host-{workers}", *_rule(states))
    rate = _read_rate(path)
    if rate is not None:
        return rate
    rate = measure_host_update(workers, threads, precision, half_grads=half_grads, states=states)
    log.info("CPU AdamW of %d workers at once with %s moments: %.2f G params/s in total with %d thread(s) each",
             workers, states, rate / 1e9, threads)
    if path is not None:
        _write_rate(path, rate, workers=workers, threads=threads, precision=precision, half_grads=half_grads,
                    states=states)
    return rate


def host_update_rates_in_step(workers: int, threads: int, precision: str, cache_dir: str | Path | None, device: str,
                              half_grads: bool = False, states: str = "fp32") -> tuple[float, float, str]:
    """One worker's CPU AdamW rate alone and the host's total with ``workers`` updating at once, as
    inside a training step, and where they come from: what a run on this machine measured inside its
    steps (each worker's rate among the others, so the total is ``workers`` times it), or
    ``CPU_UPDATE_IN_STEP`` times the rates measured here alone and together (with ``states``' moments)."""
    rate = _read_rate(_cache_path(cache_dir, threads, precision, half_grads, f"{IN_STEP}-{device}", *_rule(states)))
    if rate is not None:
        return rate, workers * rate, f"measured inside training steps on this machine, {threads} thread(s) per worker"
    alone = cpu_update_rate(threads, precision, cache_dir, half_grads, states)
    total = host_update_rate(workers, threads, precision, cache_dir, half_grads, states)
    return (CPU_UPDATE_IN_STEP * alone, CPU_UPDATE_IN_STEP * total,
            f"{CPU_UPDATE_IN_STEP} (in a step) x measured here with {states} moments: {alone / 1e9:.2f} G/s one "
            f"worker alone, {total / 1e9:.2f} G/s {workers} at once, {threads} thread(s) each")


def record_in_step_rate(threads: int, precision: str, cache_dir: str | Path, device: str, half_grads: bool,
                        rate: float, states: str = "fp32") -> None:
    """Keep the CPU AdamW rate a run measured inside its training steps (``device``: its workers'
    device type; ``states``: its moments), for the next plan on this machine."""
    _write_rate(_cache_path(cache_dir, threads, precision, half_grads, f"{IN_STEP}-{device}", *_rule(states)), rate,
                threads=threads, precision=precision, half_grads=half_grads, device=device, states=states)


def cpu_update_rate_in_step(threads: int, precision: str, cache_dir: str | Path | None, device: str,
                            half_grads: bool = False, states: str = "fp32") -> tuple[float, str]:
    """The CPU AdamW rate to plan with, and where it comes from: what a run on this machine measured
    inside its steps, or ``CPU_UPDATE_IN_STEP`` times the rate measured alone."""
    rate = _read_rate(_cache_path(cache_dir, threads, precision, half_grads, f"{IN_STEP}-{device}", *_rule(states)))
    if rate is not None:
        return rate, "measured inside training steps on this machine"
    alone = cpu_update_rate(threads, precision, cache_dir, half_grads, states)
    return CPU_UPDATE_IN_STEP * alone, f"{CPU_UPDATE_IN_STEP} x {alone / 1e9:.2f} G/s measured alone"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown"
