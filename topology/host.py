"""The host's memory as the planner and the runtimes' stores count it."""

from __future__ import annotations


HOST_USABLE_FRACTION = 0.85  # of MemAvailable: the rest for the process itself (a stage's fp32 weights at start,
# CUDA and Python) and the page cache; pinned memory cannot be swapped out, so overshooting is fatal


def available_host_bytes() -> int | None:
    """What the stores may take: ``HOST_USABLE_FRACTION`` of MemAvailable from /proc/meminfo (None
    where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(HOST_USABLE_FRACTION * int(line.split()[1]) * 1024)
    except OSError:
        return None
    return None
