"""Errors a user can act on. The CLI prints them as one line and exits with code 2."""

from __future__ import annotations


class MobiusError(ValueError):
    """A problem with the user's input, files or machine, worded so they can fix it."""


class ConfigError(MobiusError):
    """A bad configuration file, key or value."""


class CheckpointError(MobiusError):
    """A checkpoint directory that is missing, incomplete or does not match the model."""


class DataError(MobiusError):
    """Training data that cannot be read as text."""


class NotAvailableError(MobiusError):
    """A feature that this build or this machine cannot provide."""


def size_text(nbytes: float) -> str:
    """Bytes for a message: GiB, or MiB below one GiB (so that small figures do not read 0.00 GiB)."""
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.2f} MiB"
