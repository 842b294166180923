"""The simulation's time and step, which each of its mechanisms reads."""

from __future__ import annotations

from dataclasses import dataclass

EPS_T = 1e-12  # seconds: a time this close to now is now


@dataclass
class Clock:
    """Now, the step being simulated and when it began; and a count of what may let a waiting upload start."""

    t: float = 0.0
    step: int = 0  # a program of several steps (round-robin) runs as one: 0
    step_start: float = 0.0
    unheld: int = 0  # counts what may let a waiting upload start (updates, copies, slots freed, sums, steps)

    def due(self, at: float) -> bool:
        """Whether ``at`` is now (or past)."""
        return at <= self.t + EPS_T
