"""Unit costs: measured on this machine (one unit at a time) or estimated from datasheets.

* :func:`profile_units` builds each *distinct* unit once (units with equal ``signature`` are
  identical: the paper's layer similarity), runs its forward and its recompute+backward on one
  micro-batch, and takes the median of several timed repetitions (CUDA events on a GPU,
  ``perf_counter`` on the CPU). Saved activations are counted with autograd's saved-tensor hooks;
  peak working memory is measured with ``torch.cuda.max_memory_allocated`` on a GPU and estimated
  on the CPU (twice the output plus the largest saved tensor). A 13B-shaped model has three
  distinct units, so it profiles in seconds without ever being built whole.
* :func:`estimate_units` needs no GPU: FLOPs and bytes per unit against a :class:`GPUSpec`: matrix
  multiplies at ``compute_efficiency`` of the datasheet rate (or weight reads at
  ``memory_efficiency`` of its bandwidth, whichever is slower), plus the element-wise passes over
  activations at that bandwidth, plus kernel launches; backward = recompute + twice the matrix
  multiplies + the element-wise passes once more. Checked against measurements on an H100 (OPT-13B
  and a 1.4B GPT, bf16, sequence 512-1024): blocks and heads within 25%, over-estimated.
* :func:`get_profile` picks one of the two, and caches measured profiles as JSON keyed by model
  shape, micro-batch size, sequence length, precision and device name.

torch is imported inside the measuring functions only, so the solver side stays torch-free.
"""

from __future__ import annotations

import hashlib
import json
import logging
import statistics
import time
from pathlib import Path
from typing import Any, Sequence

from mobius.errors import ConfigError, NotAvailableError
from mobius.files import write_text_atomic
from partition.costs import PRECISION_BYTES, ModelProfile, UnitCost
from partition.gpus import GPUSpec, gpu_spec

log = logging.getLogger(__name__)

COMPUTE_EFFICIENCY = 0.55  # achievable share of datasheet tensor throughput for transformer blocks
MEMORY_EFFICIENCY = 0.8  # achievable share of datasheet memory bandwidth
LAUNCH_S = 8e-6  # per kernel launch
KERNELS = {"embed": 3, "block": 14, "head": 5}  # forward kernels per unit (backward: twice as many)
ACC_BYTES_PER_PARAM = 12  # fp32 sums += half gradients, then the gradients zeroed: read 4 + 2, write 4 + 2


def precision_bytes(precision: str) -> int:
    if precision not in PRECISION_BYTES:
        raise ConfigError(f"precision must be one of {', '.join(PRECISION_BYTES)}, got {precision!r}")
    return PRECISION_BYTES[precision]


# ---------------------------------------------------------------------------------- estimate
def estimate_units(specs: Sequence[Any], micro_batch_size: int, seq_len: int, precision: str,
                   gpu: str | dict | GPUSpec, compute_efficiency: float = COMPUTE_EFFICIENCY,
                   memory_efficiency: float = MEMORY_EFFICIENCY) -> ModelProfile:
    """Analytic unit costs for ``gpu`` (a catalogue name, device name, figures, or a GPUSpec)."""
    spec = gpu_spec(gpu)
    units = [_estimate_unit(s, micro_batch_size, seq_len, precision, spec, compute_efficiency, memory_efficiency)
             for s in specs]
    notes = {"gpu": spec.name, "compute_efficiency": compute_efficiency, "memory_efficiency": memory_efficiency,
             "tflops": spec.tflops(precision), "mem_GBps": spec.mem_GBps}
    return ModelProfile(units, micro_batch_size, seq_len, precision, spec.name, "estimated", 0.0, notes)


def _estimate_unit(s: Any, mbs: int, seq: int, precision: str, gpu: GPUSpec, ce: float, me: float) -> UnitCost:
    elem = precision_bytes(precision)
    tokens = mbs * seq
    flops = float(s.fwd_flops(mbs, seq))
    param_bytes = s.param_count * elem
    in_bytes = tokens * 8 if s.kind == "embed" else tokens * s.hidden_size * elem
    act_bytes = int(s.out_numel(mbs, seq)) * elem
    saved, work = s.memory(mbs, seq, elem)  # the family's count of saved and transient activations
    # matrix multiplies (compute- or weight-bound) run apart from the element-wise passes over
    # activations (norms, activations, softmax); the loss makes ~16 B of fp32 traffic per logit
    elementwise = in_bytes + act_bytes + saved + (s.kind == "head") * tokens * s.vocab_size * 16
    bandwidth = gpu.mem_GBps * 1e9 * me
    matmul_s = max(flops / (gpu.tflops(precision) * 1e12 * ce), param_bytes / bandwidth)
    launches = KERNELS.get(s.kind, 10) * LAUNCH_S
    fwd = matmul_s + elementwise / bandwidth + launches
    bwd = fwd + 2 * matmul_s + elementwise / bandwidth + 2 * launches  # recompute, then backward
    acc = s.param_count * ACC_BYTES_PER_PARAM / bandwidth + 2 * LAUNCH_S if elem < 4 else 0.0
    return UnitCost(name=s.name, kind=s.kind, signature=s.signature, param_count=s.param_count, fwd_s=fwd,
                    bwd_s=bwd, param_bytes=param_bytes, grad_bytes=param_bytes, in_bytes=in_bytes,
                    act_bytes=act_bytes, saved_bytes=saved, work_bytes=work, acc_s=acc)


# ---------------------------------------------------------------------------------- measure
def _dtype(precision: str) -> Any:
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def profile_units(specs: Sequence[Any], micro_batch_size: int, seq_len: int, precision: str,
                  device: str = "auto", reps: int = 5, warmup: int = 2) -> ModelProfile:
    """Measure every distinct unit once (one at a time) and expand to all units."""
    import torch

    dev = _resolve_device(device)
    dtype = _dtype(precision)
    t0 = time.perf_counter()
    by_sig: dict[str, UnitCost] = {}
    distinct = list({s.signature: s for s in specs}.values())
    for k, spec in enumerate(distinct, 1):
        log.info("profiling unit %d/%d: %s (%s, %.0fM parameters) on %s", k, len(distinct), spec.name, spec.kind,
                 spec.param_count / 1e6, dev)
        by_sig[spec.signature] = _measure(spec, micro_batch_size, seq_len, precision, dtype, dev, reps, warmup)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    units = [_rename(by_sig[s.signature], s) for s in specs]
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    notes = {"reps": reps, "warmup": warmup, "distinct_units": len(distinct)}
    return ModelProfile(units, micro_batch_size, seq_len, precision, name, "measured", time.perf_counter() - t0, notes)


def _resolve_device(device: str):
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise NotAvailableError("profiling on cuda was asked for but torch sees no CUDA device")
    return torch.device(device)


def _rename(cost: UnitCost, spec: Any) -> UnitCost:
    from dataclasses import replace

    return replace(cost, name=spec.name, param_count=spec.param_count)


def _measure(spec: Any, mbs: int, seq: int, precision: str, dtype, dev, reps: int, warmup: int) -> UnitCost:
    """Time forward and recompute+backward of one unit; count its saved and working memory."""
    import torch

    elem = precision_bytes(precision)
    module = spec.build().to(device=dev, dtype=dtype).train()
    x = spec.make_input(mbs, seq, dev, dtype)
    targets = torch.randint(0, spec.vocab_size, (mbs, seq), device=dev) if spec.kind == "head" else None
    step = _unit_step(spec.kind, module, x, targets)
    fwd = _time(lambda: step(False), dev, reps, warmup)
    bwd = _time(lambda: step(True), dev, reps, warmup)
    saved, largest = _saved_bytes(module, x, step)
    work = _peak_work(step, dev, saved, spec.param_count * elem) if dev.type == "cuda" else None
    out_bytes = int(spec.out_numel(mbs, seq)) * elem
    # at least the output and its gradient; on the CPU also the largest saved tensor (its gradient)
    work = max(work or 0, 2 * out_bytes + (largest if dev.type != "cuda" else 0))
    del module
    acc = _accumulate_s(spec.param_count, dtype, dev, reps, warmup) if elem < 4 else 0.0
    return UnitCost(name=spec.name, kind=spec.kind, signature=spec.signature, param_count=spec.param_count,
                    fwd_s=fwd, bwd_s=bwd, param_bytes=spec.param_count * elem, grad_bytes=spec.param_count * elem,
                    in_bytes=x.numel() * x.element_size(), act_bytes=out_bytes, saved_bytes=saved, work_bytes=work,
                    acc_s=acc)


def _accumulate_s(numel: int, dtype, dev, reps: int, warmup: int) -> float:
    """Seconds to add one micro-batch's half-precision gradients into fp32 sums and zero them (what
    the pipeline does after every backward in bf16/fp16)."""
    import torch

    grads = torch.zeros(numel, dtype=dtype, device=dev)
    acc = torch.zeros(numel, dtype=torch.float32, device=dev)
    return _time(lambda: (acc.add_(grads), grads.zero_()), dev, reps, warmup)


# ---------------------------------------------------------------------------------- the CPU update
CPU_UPDATE_NUMEL = 1 << 24  # parameters in the timed AdamW step (large enough to leave the caches)


def measure_cpu_update(threads: int, precision: str, numel: int = CPU_UPDATE_NUMEL, reps: int = 3,
                       half_grads: bool = False) -> float:
    """Parameters per second of the pipeline's CPU update on this machine with ``threads`` threads:
    the runtime's own :class:`~mobius.optim.FlatAdamW` on a flat fp32 master copy, writing the
    half-precision copy (bf16/fp16) in the same pass, from fp32 gradients or (``half_grads``)
    half-precision ones -- what each pipeline worker's optimizer thread runs."""
    import torch

    from mobius.config import TrainSection
    from mobius.optim import FlatAdamW

    before = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        dtype = _dtype(precision)
        half = torch.empty(numel, dtype=dtype) if precision != "fp32" else None
        grad = torch.full((numel,), 1e-3, dtype=dtype if half_grads else torch.float32)
        opt = FlatAdamW(torch.zeros(numel), half, [(0, numel, True)], TrainSection(weight_decay=0.1))
        return numel / _time(lambda: opt.step(grad, 1e-4, 0.5), torch.device("cpu"), reps, 1)
    finally:
        torch.set_num_threads(before)


CPU_UPDATE_IN_STEP = 0.68  # the CPU AdamW's rate inside a training step / its rate measured alone, until a run
# on this machine has measured it (:func:`record_in_step_rate`): with uploads, downloads and kernel dispatch
# sharing the host's memory bandwidth and cores, an H100 box ran 0.71 (1.42B) and 0.66 (3.94B) of the
# isolated rate in clipped steps
IN_STEP = "in-step"


def _update_cache(cache_dir: str | Path | None, threads: int, precision: str, half_grads: bool,
                  kind: str) -> Path | None:
    import platform

    key = hashlib.sha1(json.dumps([_cpu_name(), platform.machine(), threads, precision, half_grads,
                                   kind]).encode()).hexdigest()[:16]
    return Path(cache_dir) / "cpu_update" / f"{key}.json" if cache_dir is not None else None


def _read_rate(path: Path | None) -> float | None:
    if path is None or not path.is_file():
        return None
    try:
        return float(json.loads(path.read_text())["params_per_s"])
    except (OSError, ValueError, KeyError):
        return None


def _write_rate(path: Path, rate: float, **about: Any) -> None:
    write_text_atomic(path, json.dumps({"params_per_s": rate, "cpu": _cpu_name(), **about}))


def cpu_update_rate(threads: int, precision: str, cache_dir: str | Path | None = None,
                    half_grads: bool = False) -> float:
    """:func:`measure_cpu_update`, cached per CPU model, thread count, precision and gradient dtype."""
    path = _update_cache(cache_dir, threads, precision, half_grads, "flat-v2")
    rate = _read_rate(path)
    if rate is not None:
        return rate
    rate = measure_cpu_update(threads, precision, half_grads=half_grads)
    log.info("CPU AdamW%s%s: %.2f G params/s with %d thread(s)", "" if precision == "fp32" else " + half copy",
             " from half gradients" if half_grads else "", rate / 1e9, threads)
    if path is not None:
        _write_rate(path, rate, threads=threads, precision=precision, half_grads=half_grads)
    return rate


def record_in_step_rate(threads: int, precision: str, cache_dir: str | Path, device: str, half_grads: bool,
                        rate: float) -> None:
    """Keep the CPU AdamW rate a run measured inside its training steps (``device``: its workers'
    device type), for the next plan on this machine."""
    _write_rate(_update_cache(cache_dir, threads, precision, half_grads, f"{IN_STEP}-{device}"), rate,
                threads=threads, precision=precision, half_grads=half_grads, device=device)


def cpu_update_rate_in_step(threads: int, precision: str, cache_dir: str | Path | None, device: str,
                            half_grads: bool = False) -> tuple[float, str]:
    """The CPU AdamW rate to plan with, and where it comes from: what a run on this machine measured
    inside its steps, or ``CPU_UPDATE_IN_STEP`` times the rate measured alone."""
    rate = _read_rate(_update_cache(cache_dir, threads, precision, half_grads, f"{IN_STEP}-{device}"))
    if rate is not None:
        return rate, "measured inside training steps on this machine"
    alone = cpu_update_rate(threads, precision, cache_dir, half_grads)
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


def _unit_step(kind: str, module, x, targets):
    """A closure running the unit's forward (no grad) or its forward with grad plus backward."""
    import torch

    from mobius.models.base import lm_loss

    def step(backward: bool) -> None:
        if not backward:
            with torch.no_grad():
                out = module(x)
                if targets is not None:
                    lm_loss(out, targets)
            return
        inp = x if kind == "embed" else x.detach().requires_grad_(True)
        out = module(inp)
        if targets is not None:
            lm_loss(out, targets).backward()
        else:
            out.backward(torch.ones_like(out))
        module.zero_grad(set_to_none=True)

    return step


def _time(fn, dev, reps: int, warmup: int) -> float:
    """Median seconds of ``fn`` over ``reps`` runs after ``warmup`` runs."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if dev.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def _saved_bytes(module, x, step) -> tuple[int, int]:
    """Bytes autograd saves during the unit's forward (parameters and the input excluded), and
    the largest single saved tensor."""
    import torch

    skip = {p.untyped_storage().data_ptr() for p in module.parameters()} | {x.untyped_storage().data_ptr()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step(True)
    return sum(seen.values()), max(seen.values(), default=0)


def _peak_work(step, dev, saved: int, grad_bytes: int) -> int:
    """Peak CUDA memory of forward+backward beyond what was allocated, the saved activations and
    the parameter gradients."""
    import torch

    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    step(True)
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev)
    return max(0, peak - base - saved - grad_bytes)


# ---------------------------------------------------------------------------------- dispatch and cache
def profile_key(specs: Sequence[Any], micro_batch_size: int, seq_len: int, precision: str, device_name: str) -> str:
    """Cache key: model shape (the units' signatures), micro-batch, sequence, precision, device."""
    blob = json.dumps({"shape": [s.signature for s in specs], "mbs": micro_batch_size, "seq": seq_len,
                       "precision": precision, "device": device_name})
    return hashlib.sha1(blob.encode()).hexdigest()[:20]


def load_cached(path: Path) -> ModelProfile | None:
    try:
        return ModelProfile.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError, KeyError):
        return None


def get_profile(specs: Sequence[Any], micro_batch_size: int, seq_len: int, precision: str, mode: str = "auto",
                gpu: str | dict | GPUSpec | None = None, device: str = "auto",
                cache_dir: str | Path | None = None, threads: int | None = None) -> ModelProfile:
    """A measured profile (``mode="measured"``, or ``auto`` with a CUDA device and no ``gpu`` named)
    or an estimated one (``mode="estimated"``, or ``auto`` otherwise; needs ``gpu``). ``threads``:
    measure on the CPU with this many threads (what each CPU worker of a run will have)."""
    precision_bytes(precision)
    if mode not in ("auto", "measured", "estimated"):
        raise ConfigError(f"partition.profile must be auto, measured or estimated, got {mode!r}")
    if mode == "auto":
        mode = "measured" if _local_gpu_matches(gpu) else "estimated"
    if mode == "estimated":
        if gpu is None:
            raise ConfigError("an estimated profile needs the GPU model: set partition.gpu (e.g. rtx3090, rtx4090, "
                              "a100-40gb, h100) or give a topology whose GPU names are in the catalogue")
        return estimate_units(specs, micro_batch_size, seq_len, precision, gpu)
    return _measured_cached(specs, micro_batch_size, seq_len, precision, device, cache_dir, threads)


def _local_gpu_matches(gpu: str | dict | GPUSpec | None) -> bool:
    """True when a CUDA device is here and is the GPU planned for (or none was named)."""
    try:
        import torch
    except ImportError:
        return False
    if not torch.cuda.is_available():
        return False
    if gpu is None:
        return True
    from partition.gpus import lookup_gpu

    local = lookup_gpu(torch.cuda.get_device_name(0))
    return local is not None and local.name == gpu_spec(gpu).name


def _measured_cached(specs: Sequence[Any], mbs: int, seq: int, precision: str, device: str,
                     cache_dir: str | Path | None, threads: int | None) -> ModelProfile:
    import torch

    dev = _resolve_device(device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    if dev.type == "cpu" and threads:
        name = f"cpu ({threads} thread{'s' if threads > 1 else ''})"
    path = None
    if cache_dir is not None:
        path = Path(cache_dir) / "profiles" / f"{profile_key(specs, mbs, seq, precision, name)}.json"
        cached = load_cached(path) if path.is_file() else None
        if cached is not None:
            log.info("using cached profile %s", path)
            return cached
    before = torch.get_num_threads()
    if dev.type == "cpu" and threads:
        torch.set_num_threads(threads)
    try:
        prof = profile_units(specs, mbs, seq, precision, str(dev))
    finally:
        torch.set_num_threads(before)
    prof.device_name = name
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(prof.dumps())
    return prof
