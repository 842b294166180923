"""Files a user keeps (plans, metrics, traces, caches) are never half-written; a write that fails for
want of space or permission is told in words."""

from __future__ import annotations

import os
import re
from pathlib import Path

REPLACED_DIR = ".mobius-replaced"  # in output.dir: the run --overwrite replaces, kept until the new one's first checkpoint


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` under a temporary name beside ``path``, then rename it into place: a reader sees
    the old file or the new one, and two processes writing at once never share the temporary."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_failure(e: BaseException) -> str | None:
    """Why a write failed, in words (``No space left on device``), when ``e`` is the operating system's
    refusal -- an :class:`OSError`, or safetensors' error wrapping one; None for anything else."""
    if isinstance(e, OSError):
        return e.strerror or str(e)
    if type(e).__name__ != "SafetensorError":
        return None
    text = str(e)  # safetensors >= 0.5: "... I/O error: No space left on device (os error 28)"; before: IoError(Os {
    code = re.search(r"\(os error (\d+)\)|code: (\d+)", text)  # code: 28, kind: StorageFull, message: "No space ..." })
    if code is not None:
        return os.strerror(int(code.group(1) or code.group(2)))
    if "IoError" in text or "I/O error" in text:
        return text.splitlines()[0]
    return None


def drop_replaced(out: Path) -> None:
    """Remove the run ``--overwrite`` set aside in ``out``: the new run has a checkpoint of its own."""
    import shutil

    if (out / REPLACED_DIR).is_dir():
        shutil.rmtree(out / REPLACED_DIR, ignore_errors=True)
