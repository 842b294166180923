"""Which unit costs a plan uses, and the cache of measured ones.

:func:`get_profile` takes an estimated profile (:mod:`partition.estimate`, datasheet figures) or a
measured one (:mod:`partition.measure`, on this machine), and caches measured profiles as JSON keyed
by model shape, micro-batch size, sequence length, precision and device name. ``mode="auto"``
measures when a CUDA device is here and it is the GPU planned for (or none is named), and estimates
otherwise; ``mobius train`` and ``mobius plan`` (``mobius.app.planning.profile``) measure on the CPU
for CPU workers whatever the mode, pass ``partition.profile`` through on a detected machine, and
estimate for a saved topology.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any, Sequence

from mobius.errors import ConfigError
from partition.costs import ModelProfile
from partition.estimate import estimate_units, precision_bytes
from partition.gpus import GPUSpec, gpu_spec
from partition.measure import _resolve_device, profile_units

log = logging.getLogger(__name__)


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
