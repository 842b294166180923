"""scheduler.zero: the runtime of ``parallel.mode: zero`` (see README.md)."""

from scheduler.zero.zero_engine import ZeroEngine, share

__all__ = ["ZeroEngine", "share"]
