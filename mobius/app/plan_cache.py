"""Pipeline plans kept under ``partition.cache_dir``, so that a plan is searched once.

A pipeline plan (:class:`~partition.ScheduleComparison`: the swapped pipeline's, and the round-robin family's
beside it when asked for) is a pure function of the unit profile, the machine as the planner sees it
(:class:`~partition.Hardware`), the request and the planner's code (:func:`partition.plan_schedules`). Its
search takes seconds to tens of seconds (the configs' time limits, what a solve overruns them by, the
residency pass), and a search stopped by its limit may land elsewhere the next time. So ``mobius plan``
and ``mobius train`` keep each plan under ``partition.cache_dir``, named by a hash of those inputs (the
code as the hash of mobius's own source files: a plan kept by other code, in whatever format, is never read),
and a later run with the same inputs runs the same plan at once: ``mobius plan`` then ``mobius train``, a
resumed run, a second run of a config.
``partition.reuse_plan: false`` searches again (and keeps the new plan).

The host's free memory is an input that moves from minute to minute: it is left out of the hash, and a
kept plan is reused while the memory now is within ``MEMORY_DRIFT`` of what it was planned with and
holds the plan's host stores."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable

from partition import Hardware, ModelProfile, PlanRequest, ScheduleComparison
from partition.swapped_plan import PlanReuse

log = logging.getLogger(__name__)

PLANS_KEPT = 64  # the newest plans kept; older ones are deleted when a plan is added
MEMORY_DRIFT = 0.02  # of the host memory a plan was made with (at least MEMORY_DRIFT_BYTES): reused within it
MEMORY_DRIFT_BYTES = 2**30
_PACKAGES = ("mobius", "partition", "topology", "scheduler")  # the code a plan depends on


@functools.lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """A hash of mobius's own Python source files: any change to the code invalidates the plans kept."""
    import partition

    return source_hash(Path(partition.__file__).resolve().parent.parent)


def source_hash(root: Path) -> str:
    """A hash of the ``.py`` files of mobius's packages under ``root`` (their paths and bytes)."""
    h = hashlib.sha256()
    for package in _PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:20]


def plan_key(profile: ModelProfile, hardware: Hardware, request: PlanRequest) -> str | None:
    """The hash a plan is kept under; None when the request holds a function (a mapping of no fixed value)."""
    if callable(request.mapping):
        return None
    prof = {k: v for k, v in dataclasses.asdict(profile).items() if k != "profile_s"}  # 0 on a profile's cache hit
    hw = {k: v for k, v in dataclasses.asdict(hardware).items() if k != "host_memory_bytes"}
    inputs = {"profile": prof, "hardware": hw, "request": dataclasses.asdict(request), "code": code_fingerprint()}
    text = json.dumps(inputs, sort_keys=True, default=_plain)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _plain(obj: Any) -> Any:
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    return repr(obj)


def reuse_or_plan(cache_dir: str | os.PathLike, profile: ModelProfile, hardware: Hardware, request: PlanRequest,
                  make: Callable[[], ScheduleComparison], reuse: bool = True) -> ScheduleComparison:
    """The plan kept for these inputs (its swapped plan's ``mip.reused`` says when it was made), else ``make()``'s,
    which is kept for the next run."""
    key = plan_key(profile, hardware, request)
    if key is None:
        return make()
    path = Path(cache_dir) / "plans" / f"{key}.json"
    kept = _read(path, hardware.host_memory_bytes) if reuse else None
    if kept is not None:
        return kept
    log.info("searching the pipeline's plan: %d units on %d GPU(s), partition.time_limit_s=%g, then the resident "
             "and kept stages ...", profile.num_units, hardware.num_gpus, request.time_limit_s)
    t0 = time.perf_counter()
    plan = make()
    took = time.perf_counter() - t0
    log.info("planned in %.1f s; kept for the next run with the same inputs (%s)", took, path.parent)
    _write(path, plan, took)
    return plan


def _read(path: Path, memory: int | None) -> ScheduleComparison | None:
    """The plan kept at ``path`` when it is readable and still fits ``memory`` (see :func:`_memory_holds`)."""
    try:
        entry = json.loads(path.read_text())
        plan = ScheduleComparison.from_json(entry["plan"])
        made, search_s, then = entry["made"], float(entry["search_s"]), entry["plan"].get("host_memory_bytes")
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("ignoring the kept plan %s (%s); planning again", path, e)
        return None
    if not _memory_holds(then, memory, plan.swapped.host_bytes):
        log.info("the host's memory moved since the kept plan %s was made; planning again", path.name)
        return None
    plan.swapped.host_memory_bytes = memory
    plan.swapped.mip.reused = PlanReuse(made, search_s, str(path.resolve()))
    with contextlib.suppress(OSError):
        os.utime(path)  # the newest used are the last pruned
    return plan


def _memory_holds(then: int | None, now: int | None, needed: int) -> bool:
    """Whether a plan made with ``then`` bytes of host memory may run with ``now``: both unknown, or ``now``
    within ``MEMORY_DRIFT`` of ``then`` and at least the ``needed`` bytes of its stores."""
    if then is None or now is None:
        return then is None and now is None
    return abs(now - then) <= max(MEMORY_DRIFT * then, MEMORY_DRIFT_BYTES) and needed <= now


def _write(path: Path, plan: ScheduleComparison, search_s: float) -> None:
    """Keep ``plan`` at ``path`` (whole or not at all), then prune the oldest beyond ``PLANS_KEPT``."""
    entry = {"made": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "search_s": round(search_s, 3), "plan": plan.to_json()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entry))
        os.replace(tmp, path)
        kept = sorted(path.parent.glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
        for old in kept[PLANS_KEPT:]:
            old.unlink(missing_ok=True)
    except OSError as e:  # a cache: a run goes on without it
        log.warning("could not keep the plan in %s (%s)", path.parent, e)
