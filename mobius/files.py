"""Files a user keeps (plans, metrics, traces, caches) are never half-written."""

from __future__ import annotations

import os
from pathlib import Path


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
