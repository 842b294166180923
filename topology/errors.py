"""Errors raised by the topology package (all are :class:`mobius.errors.MobiusError`)."""

from __future__ import annotations

from mobius.errors import MobiusError, NotAvailableError


class TopologyUnavailable(NotAvailableError):
    """No GPU, no NVML and no ``nvidia-smi`` here (or no CUDA for a benchmark)."""


class TopologyFileError(MobiusError):
    """A topology or bandwidth file that cannot be read; the message names the file and the problem."""
