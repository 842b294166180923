"""The run directory (``output.dir``) a training run claims, and gives back however the run ends.

* **One run at a time.** A run holds an exclusive lock on ``.mobius-lock`` in the directory for its
  whole life (``flock``: the kernel releases it when the process ends, however it ends, so a crashed
  run never blocks the next); a second run into the directory stops with one line naming the first
  one's pid, host and start.
* **Results are never replaced by accident.** A directory that holds a run's results (a checkpoint,
  a non-empty ``metrics.jsonl``, the loss plot, step traces) is refused unless the run resumes it or
  ``--overwrite`` replaces it. What a run that never finished a step leaves (``plan.json``, an empty
  ``metrics.jsonl``) is not a run: a plain rerun takes the directory.
* **--overwrite loses nothing before it has something new.** The old run's files stay where they are
  until every check of the new run passed (inputs, data, model, plan); then they move into
  ``.mobius-replaced`` and are removed when the new run writes its first checkpoint. A new run that
  ends before that -- an error, a signal, a kill -9 (then at the next claim) -- gets the old run put
  back.
* A directory the claim created is removed again when the run ends having written nothing into it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from mobius.checkpoint import stale_temporaries
from mobius.errors import ConfigError
from mobius.files import REPLACED_DIR
from mobius.trainer import step_checkpoints

log = logging.getLogger(__name__)
LOCK_FILE = ".mobius-lock"
PLAN_FILE = "plan.json"  # the plan a pipeline or zero run runs, as `mobius plan --json` prints it
RESULTS = ("metrics.jsonl", "final", "merged", "checkpoints", "loss.png")  # and trace-step*.json


def results(out: Path) -> list[str]:
    """The results of a run that ``out`` holds: complete checkpoints, metrics lines, the plot, traces."""
    found = []
    for name in RESULTS:
        path = out / name
        if name == "checkpoints":
            found += [name] if step_checkpoints(out) else []
        elif name == "metrics.jsonl":
            found += [name] if path.is_file() and path.stat().st_size > 0 else []
        elif path.exists():
            found.append(name)
    return found + sorted(p.name for p in out.glob("trace-step*.json"))


def has_checkpoint(out: Path) -> bool:
    return (out / "final").is_dir() or bool(step_checkpoints(out))


@dataclass
class RunDir:
    """``output.dir``, claimed by this process (:meth:`claim`) until :meth:`release`."""

    path: Path
    lock_fd: int
    created: list[Path] = field(default_factory=list)  # directories the claim made, the outermost first
    replaced: list[str] = field(default_factory=list)  # the old run's files --overwrite replaces

    @classmethod
    def claim(cls, out: Path, resume: str | None, overwrite: bool) -> "RunDir":
        """Lock ``out`` (made if missing) for this run, put back a run an earlier ``--overwrite`` left
        set aside, and refuse a directory holding results unless resuming or overwriting it."""
        created = _make_dirs(out)
        try:
            run = cls(out, _lock(out), created)
        except BaseException:
            _remove_empty(created)
            raise
        try:
            recover(out)
            for stale in stale_temporaries(out) + stale_temporaries(out / "checkpoints"):
                shutil.rmtree(stale, ignore_errors=True)
                log.info("removed %s, left by an interrupted checkpoint write", stale)
            held = results(out)
            if held and resume is None:
                if not overwrite:
                    raise ConfigError(_held_message(out, held))
                run.replaced = held + ([PLAN_FILE] if (out / PLAN_FILE).exists() else [])
                log.info("--overwrite: %s in %s will be replaced once this run's checks pass, and kept until its "
                         "first checkpoint", ", ".join(held), out)
        except BaseException:
            run.release()
            raise
        return run

    def set_aside(self) -> None:
        """(Every check passed) move the run ``--overwrite`` replaces into ``.mobius-replaced``."""
        if not self.replaced:
            return
        aside = self.path / REPLACED_DIR
        aside.mkdir()
        for name in self.replaced:
            os.replace(self.path / name, aside / name)
        log.info("--overwrite: moved %s into %s; removed when this run writes its first checkpoint, put back if it "
                 "ends before", ", ".join(self.replaced), aside)
        self.replaced = []

    def release(self) -> None:
        """The run ended (any way): settle a set-aside run, drop the lock, remove what the claim made
        if the run left nothing in it."""
        recover(self.path)
        lock = self.path / LOCK_FILE
        lock.unlink(missing_ok=True)  # before closing: whoever locks next makes a fresh file
        os.close(self.lock_fd)
        _remove_empty(self.created)


def recover(out: Path) -> None:
    """A run set aside by ``--overwrite``: removed when the new run has a checkpoint of its own, else
    put back in place of what the new run wrote."""
    aside = out / REPLACED_DIR
    if not aside.is_dir():
        return
    if has_checkpoint(out):
        shutil.rmtree(aside, ignore_errors=True)
        return
    names = sorted(p.name for p in aside.iterdir())
    for name in names:
        target = out / name
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()
        os.replace(aside / name, target)
    aside.rmdir()
    log.warning("put back the run that --overwrite was replacing in %s (%s): the new run ended before its first "
                "checkpoint", out, ", ".join(names))


def _held_message(out: Path, held: list[str]) -> str:
    if step_checkpoints(out):
        return (f"output.dir {out} already holds a run ({', '.join(held)}); pass --resume to continue it, --overwrite "
                f"to replace it, or choose another output.dir")
    return (f"output.dir {out} already holds a run ({', '.join(held)}) with no step checkpoint to resume; pass "
            f"--overwrite to replace it, or choose another output.dir")


def _make_dirs(out: Path) -> list[Path]:
    """Make ``out`` and its missing parents; the ones made, the outermost first. One line when it cannot
    be a directory (a file is in the way, a read-only filesystem, no permission)."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output.dir {out} is a file, not a directory")
    missing = [p for p in [out, *out.parents] if not p.exists()][::-1]
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        _remove_empty([p for p in missing if p.is_dir()])
        raise ConfigError(f"output.dir {out}: cannot create it ({e.strerror or e})") from None
    return missing


def _lock(out: Path) -> int:
    """Take ``out``'s lock (made fresh if gone), or say which run holds it; the open descriptor."""
    path = out / LOCK_FILE
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise ConfigError(f"output.dir {out} is not writable ({e.strerror or e})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                log.warning("output.dir %s: its filesystem cannot lock files (%s); a second run into it would not "
                            "be noticed", out, e.strerror)
                break
            os.close(fd)
            raise ConfigError(f"output.dir {out} is in use by another mobius run ({_holder(path)}); wait for it to "
                              f"end or choose another output.dir") from None
        if _same_file(fd, path):  # not a file its last holder removed while we opened it
            break
        os.close(fd)
    holder = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        os.ftruncate(fd, 0)
        os.write(fd, (json.dumps(holder) + "\n").encode())
    except OSError as e:
        os.close(fd)
        raise ConfigError(f"output.dir {out} is not writable ({e.strerror or e})") from None
    return fd


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


def _holder(path: Path) -> str:
    """Who holds a lock, as its file says (its pid and host where known)."""
    try:
        h = json.loads(path.read_text())
        return f"pid {h['pid']} on host {h['host']}, started {h['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "its pid and host are not known yet"


def _remove_empty(dirs: list[Path]) -> None:
    """Remove the directories of ``dirs`` (the outermost first) that are empty, innermost first."""
    for d in reversed(dirs):
        try:
            d.rmdir()
        except OSError:
            return
