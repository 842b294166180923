"""What a simulation reports: the last (steady-state) step's time, bytes, memory peaks, stage timings and
timeline (:class:`SimResult`)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from partition.sim.timeline import SimEvent, ascii_grid, chrome_trace


@dataclass
class StageTiming:
    """When a stage ran in the reported step, and how long its compute waited for its uploads."""

    fwd_start: float = math.nan
    fwd_end: float = math.nan
    bwd_start: float = math.nan
    bwd_end: float = math.nan
    upload_wait_s: float = 0.0


@dataclass
class SimResult:
    """Outcome of simulating a run of steps (figures of the last, steady-state step)."""

    step_s: float
    compute_end_s: float
    peak_bytes: list[int]  # per physical GPU (the memory model's peak of its worker)
    h2d_bytes: list[float]  # per GPU, host->GPU (stage uploads, checkpoints, activation second hops)
    d2h_bytes: list[float]  # per GPU, GPU->host (gradients, activation first hops, checkpoint offloads)
    p2p_bytes: list[float]  # per GPU, sent peer-to-peer
    rc_h2d_bytes: list[float]  # per root complex
    rc_d2h_bytes: list[float]
    bytes_by_kind: dict[str, float]
    stages: list[StageTiming]
    events: list[SimEvent] = field(repr=False, default_factory=list)
    gpu_names: list[str] = field(default_factory=list)
    step_ends: list[float] = field(default_factory=list)  # REDUCE time of every simulated step
    busy_s: dict[str, float] | None = None  # a program's compute and upload waits in its reported step per GPU, by
    # event category (its events are the step's period, which with a delayed update holds part of the step before's
    # compute instead of the next step's)
    spread_s: float = 0.0  # of ``step_s``, what the workers' and the computes' speeds varying add (:func:`with_spread`;
    # the time split counts it as idle: a hand-over waits for the slower side)

    def total_bytes(self) -> float:
        """All bytes moved over host links (P2P counted once)."""
        return sum(self.h2d_bytes) + sum(self.d2h_bytes) + sum(self.p2p_bytes)

    def time_split(self) -> dict[str, float]:
        """Where the reported step's time goes, in seconds per GPU averaged over the GPUs that compute:
        forward, backward (recompute included), device AdamW, the dispatch thread's messages and own time
        (``Hardware.message_s``, ``ModelProfile.action_s``), waiting for uploads, and idle (pipeline
        fill and drain, waiting for activations); ``tail``: the step's end after the last compute
        (global norm, CPU AdamW, reduce). Needs the recorded events (``record=True``), but for a program's."""
        busy = self.busy_s
        if busy is None:
            n = max(len({e.gpu for e in self.events if e.track == "compute"}), 1)
            busy = {"fwd": 0.0, "bwd": 0.0, "dadam": 0.0, "dispatch": 0.0,
                    "upload_wait": sum(t.upload_wait_s for t in self.stages) / n}
            for e in self.events:
                if e.track == "compute":
                    busy[e.cat] += (e.end - e.start) / n
        split = {"forward": busy["fwd"], "backward": busy["bwd"], "device_adamw": busy["dadam"],
                 "dispatch": busy["dispatch"], "upload_wait": busy["upload_wait"]}
        split["idle"] = max(0.0, self.compute_end_s + self.spread_s - sum(split.values()))
        split["tail"] = max(0.0, self.step_s - self.spread_s - self.compute_end_s)
        return split

    def to_ascii(self, width: int = 100) -> str:
        """The timeline as a text grid: per GPU a compute row and its two link rows, then the CPU."""
        return ascii_grid(self.events, self.step_s, width)

    def to_chrome_trace(self) -> dict:
        """The timeline in Chrome trace format (open in https://ui.perfetto.dev)."""
        return chrome_trace(self.events, self.gpu_names, self.step_s)

    def write_chrome_trace(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_chrome_trace(), f)
