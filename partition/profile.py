"""Which unit costs a plan uses, and the cache of measured ones.

:func:`get_profile` takes an estimated profile (:mod:`partition.estimate`, datasheet figures) or a
measured one (:mod:`partition.measure`, on this machine), and caches measured profiles as JSON keyed
by model shape, micro-batch size, sequence length, precision and device name. ``mode="auto"``
measures when a CUDA device is here and it is the GPU planned for (or none is named), and estimates
otherwise. ``mobius train`` and ``mobius plan`` decide for themselves (``mobius.app.planning.profile_mode``:
they measure the devices a run is planned on when they are here, whatever ``partition.gpu`` names)
and ask for ``measured`` or ``estimated``; a profile file (``partition.profile_file``) replaces the
times of the unit kinds it names (:func:`apply_profile_file`).
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


PROFILE_METHOD = "autocast"  # how units are run when measured (a profile measured otherwise is not reused)


def profile_key(specs: Sequence[Any], micro_batch_size: int, seq_len: int, precision: str, device_name: str,
                doc_tokens: int | None = None) -> str:
    """Cache key: model shape (the units' signatures), micro-batch, sequence, packed documents' length,
    precision, device, and how the units were run (:data:`PROFILE_METHOD`)."""
    row = {"seq": seq_len} if doc_tokens is None else {"seq": seq_len, "doc": doc_tokens}  # (old keys stay valid)
    blob = json.dumps({"shape": [s.signature for s in specs], "mbs": micro_batch_size, **row,
                       "precision": precision, "device": device_name, "method": PROFILE_METHOD})
    return hashlib.sha1(blob.encode()).hexdigest()[:20]


def load_cached(path: Path) -> ModelProfile | None:
    try:
        return ModelProfile.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError, KeyError):
        return None


def get_profile(specs: Sequence[Any], micro_batch_size: int, seq_len: int, precision: str, mode: str = "auto",
                gpu: str | dict | GPUSpec | None = None, device: str = "auto",
                cache_dir: str | Path | None = None, threads: int | None = None,
                doc_tokens: int | None = None) -> ModelProfile:
    """A measured profile (``mode="measured"``, or ``auto`` with a CUDA device and no ``gpu`` named)
    or an estimated one (``mode="estimated"``, or ``auto`` otherwise; needs ``gpu``). ``threads``:
    measure on the CPU with this many threads (what each CPU worker of a run will have); ``doc_tokens``:
    rows packed with documents of that many tokens (None: one sequence per row)."""
    precision_bytes(precision)
    if mode not in ("auto", "measured", "estimated"):
        raise ConfigError(f"partition.profile must be auto, measured or estimated, got {mode!r}")
    if mode == "auto":
        mode = "measured" if _local_gpu_matches(gpu) else "estimated"
    if mode == "estimated":
        if gpu is None:
            raise ConfigError("an estimated profile needs the GPU model: set partition.gpu (e.g. rtx3090, rtx4090, "
                              "a100-40gb, h100) or give a topology whose GPU names are in the catalogue")
        return estimate_units(specs, micro_batch_size, seq_len, precision, gpu, doc_tokens=doc_tokens)
    return _measured_cached(specs, micro_batch_size, seq_len, precision, device, cache_dir, threads, doc_tokens)


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
                     cache_dir: str | Path | None, threads: int | None, doc_tokens: int | None = None) -> ModelProfile:
    import torch

    dev = _resolve_device(device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    if dev.type == "cpu" and threads:
        name = f"cpu ({threads} thread{'s' if threads > 1 else ''})"
    path = None
    if cache_dir is not None:
        path = Path(cache_dir) / "profiles" / f"{profile_key(specs, mbs, seq, precision, name, doc_tokens)}.json"
        cached = load_cached(path) if path.is_file() else None
        if cached is not None:
            log.info("using cached profile %s", path)
            cached.profile_s = 0.0  # nothing was measured now (the plan says "cached")
            return cached
    before = torch.get_num_threads()
    if dev.type == "cpu" and threads:
        torch.set_num_threads(threads)
    try:
        prof = profile_units(specs, mbs, seq, precision, str(dev), doc_tokens=doc_tokens)
    finally:
        torch.set_num_threads(before)
    prof.device_name = name
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(prof.dumps())
    return prof


# ---- profile files: unit times measured elsewhere --------------------------------------------------
PROFILE_FILE_KEYS = {"gpu", "micro_batch_size", "seq_len", "precision", "units"}
UNIT_KINDS = ("embed", "block", "head")


def read_profile_file(path: str | Path) -> dict:
    """A profile file (``mobius profile`` writes one): the GPU the times were measured on, the setting,
    and per unit kind the forward and the backward alone of one micro-batch, in milliseconds::

        {"gpu": "rtx4090", "micro_batch_size": 4, "seq_len": 2048, "precision": "bf16",
         "units": {"block": {"forward_ms": 18.5037, "backward_ms": 41.2066},
                   "head": {"forward_ms": 37.2255, "backward_ms": 74.501}}}

    Checked whole: unknown keys, a missing key (``gpu`` may be left out), a kind other than embed /
    block / head, a time that is not a positive number (a backward may be 0) are errors naming the
    file and the key."""
    where = f"partition.profile_file {path}"
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"{where}: {e.strerror or e}") from None
    except ValueError as e:
        raise ConfigError(f"{where}: not JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: must be a JSON object with the keys {sorted(PROFILE_FILE_KEYS)}")
    unknown, missing = sorted(set(data) - PROFILE_FILE_KEYS), sorted(PROFILE_FILE_KEYS - set(data) - {"gpu"})
    if unknown or missing:
        raise ConfigError(f"{where}: " + (f"unknown key(s) {unknown}" if unknown else f"missing key(s) {missing}"))
    units = data["units"]
    if not isinstance(units, dict) or not units or set(units) - set(UNIT_KINDS):
        raise ConfigError(f"{where}: units must map some of {list(UNIT_KINDS)} to times, got {units!r}")
    for kind, times in units.items():
        if not isinstance(times, dict) or set(times) != {"forward_ms", "backward_ms"}:
            raise ConfigError(f"{where}: units.{kind} must hold forward_ms and backward_ms, got {times!r}")
        for key, v in times.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v > 0 or key == "backward_ms" and v == 0):
                raise ConfigError(f"{where}: units.{kind}.{key} must be a positive number of milliseconds (a "
                                  f"backward may be 0), got {v!r}")
    return data


def apply_profile_file(base: ModelProfile, data: dict, path: str | Path) -> ModelProfile:
    """``base`` (the run's units, estimated) with the file's times for the kinds it names: forward, and
    recompute plus backward (the forward again, then the backward alone). The file must be of the run's
    setting (micro-batch, sequence, precision); memory and bytes stay the model's."""
    import dataclasses

    for key, ours in (("micro_batch_size", base.micro_batch_size), ("seq_len", base.seq_len),
                      ("precision", base.precision)):
        if data[key] != ours:
            raise ConfigError(f"partition.profile_file {path} was measured with {key} {data[key]!r}, the run has "
                              f"{ours!r}; measure again with the run's setting (mobius profile), or plan the run "
                              f"with the file's")
    times = data["units"]
    units = [dataclasses.replace(u, fwd_s=times[u.kind]["forward_ms"] / 1e3,
                                 bwd_s=(times[u.kind]["forward_ms"] + times[u.kind]["backward_ms"]) / 1e3)
             if u.kind in times else u for u in base.units]
    kept = sorted({u.kind for u in base.units} - set(times))
    notes = {**base.notes, "profile_file": str(path), "estimated_kinds": kept}
    return dataclasses.replace(base, units=units, device_name=data.get("gpu") or base.device_name, source="file",
                               profile_s=0.0, notes=notes)


def profile_file_json(prof: ModelProfile) -> dict:
    """A measured profile as a profile file: each kind's first unit (the blocks are alike); the GPU by
    its catalogue name when it has one."""
    from partition.gpus import lookup_gpu

    units: dict[str, dict] = {}
    for u in prof.units:
        if u.kind not in units:
            backward = max(0.0, u.bwd_s - u.fwd_s)  # (a frozen embedding has none)
            units[u.kind] = {"forward_ms": round(u.fwd_s * 1e3, 4), "backward_ms": round(backward * 1e3, 4)}
    known = lookup_gpu(prof.device_name)
    return {"gpu": known.name if known else prof.device_name, "micro_batch_size": prof.micro_batch_size,
            "seq_len": prof.seq_len,
            "precision": prof.precision, "units": units}
