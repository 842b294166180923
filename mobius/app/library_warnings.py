"""Python warnings that libraries (torch, transformers, ...) issue reach a user as one logged line each, not
as Python's two (the message, then the source line that issued it); ``-v`` adds where it came from. The
``mobius`` command and every worker it starts install this (:func:`one_line_warnings`); a warning mobius
handles the case of is silenced where it is handled instead (e.g. torch's note on a pickle's protocol, when
mobius refuses or reads the file: :func:`mobius.models.hf._load_bin`)."""

from __future__ import annotations

import logging
import sys
import warnings
from typing import TextIO

log = logging.getLogger(__name__)


def one_line_warnings() -> None:
    """From now on, show each warning in this process as one line through :mod:`logging`."""
    warnings.showwarning = show_one_line


def show_one_line(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                  file: TextIO | None = None, line: str | None = None) -> None:
    """``warnings.showwarning``'s signature: log ``message``'s first line, naming its category and the library
    that issued it."""
    text = str(message).strip().splitlines()
    log.warning("%s from %s: %s", category.__name__, issuer(), text[0] if text else "")
    log.debug("(issued for %s:%d)", filename, lineno)


def issuer() -> str:
    """The top-level package of the code that called ``warnings.warn`` (the first frame outside :mod:`warnings`
    and this module): the library itself, where the warning's ``filename`` may name a caller it blames (its
    ``stacklevel``)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__") in (__name__, "warnings"):
        frame = frame.f_back
    name = frame.f_globals.get("__name__", "") if frame is not None else ""
    return name.split(".")[0] or "Python"
