"""What a simulation records of a step: its spans (``record=True``), the bytes each link and root complex moved,
when each stage ran and waited, a program's compute by category; and the :class:`SimResult` made of them."""

from __future__ import annotations

import dataclasses

from partition.hardware import Hardware
from partition.sim.clock import Clock
from partition.sim.flows import Flow
from partition.sim.result import SimResult, StageTiming
from partition.sim.timeline import SimEvent


class Recorder:
    """The figures of the step being simulated (begun again at each step: :meth:`new_step`)."""

    def __init__(self, hw: Hardware, stages: int, record: bool, clock: Clock):
        self.hw, self.stages, self.record, self.clock = hw, stages, record, clock
        self.new_step()

    def new_step(self) -> None:
        hw = self.hw
        self.timing = [StageTiming() for _ in range(self.stages)]
        self.bytes = {"h2d": [0.0] * hw.num_gpus, "d2h": [0.0] * hw.num_gpus, "p2p": [0.0] * hw.num_gpus,
                      "rc_h2d": [0.0] * len(hw.groups), "rc_d2h": [0.0] * len(hw.groups)}
        self.by_kind: dict[str, float] = {}
        self.events: list[SimEvent] = []
        self.busy = dict.fromkeys(("fwd", "bwd", "dadam", "dispatch"), 0.0)  # a program's last step's compute
        # (the time split's: SimResult.busy_s)
        self.compute_end_s = 0.0

    def event(self, gpu: int, track: str, name: str, start: float, end: float, cat: str, nbytes: float = 0.0) -> None:
        """A span from ``start`` to ``end`` (times of the run; kept from the step's start)."""
        if self.record:
            s0 = self.clock.step_start
            self.events.append(SimEvent(gpu, track, name, start - s0, end - s0, cat, nbytes))

    def flow_done(self, f: Flow) -> None:
        """A transfer has ended now: its bytes on its GPU's link, its root complex and its kind, and its span."""
        self.by_kind[f.kind] = self.by_kind.get(f.kind, 0.0) + f.total
        self.bytes[f.track][f.gpu] += f.total
        if f.track in ("h2d", "d2h"):
            self.bytes[f"rc_{f.track}"][self.hw.group_of(f.gpu)] += f.total
        self.event(f.gpu, f.track, f.label, f.start, self.clock.t, {"upload": "upload", "act": "act", "grad": "grad",
                                                                    "ckpt": "ckpt"}[f.kind], f.total)

    def result(self, step_ends: list[float], peaks: list[int]) -> SimResult:
        """The last step's figures (``step_ends``: every step's end; ``peaks``: each GPU's memory peak)."""
        ends = step_ends
        step = ends[-1] - ends[-2] if len(ends) > 1 else ends[-1]
        return SimResult(step_s=step, compute_end_s=self.compute_end_s, peak_bytes=peaks,
                         h2d_bytes=self.bytes["h2d"], d2h_bytes=self.bytes["d2h"], p2p_bytes=self.bytes["p2p"],
                         rc_h2d_bytes=self.bytes["rc_h2d"], rc_d2h_bytes=self.bytes["rc_d2h"],
                         bytes_by_kind=self.by_kind, stages=self.timing, events=self.events,
                         gpu_names=list(self.hw.gpu_names), step_ends=list(ends))

    def program_result(self, step_ends: list[float], steps: int, workers: int) -> SimResult:
        """A program's figures (its ``steps`` steps on ``workers`` workers): bytes per step (its steps move the
        same), the last step's period and the events in it, and that step's compute wherever it fell (``busy_s``:
        the time split's)."""
        ends = step_ends
        step = ends[-1] - ends[-2] if len(ends) > 1 else ends[-1]
        lo = ends[-2] if steps > 1 else 0.0
        per = {k: [x / steps for x in v] for k, v in self.bytes.items()}
        events = [dataclasses.replace(e, start=e.start - lo, end=e.end - lo) for e in self.events if e.end > lo
                  and e.start < ends[-1]]
        busy = {k: v / workers for k, v in self.busy.items()}
        busy["upload_wait"] = sum(t.upload_wait_s for t in self.timing) / workers
        return SimResult(step_s=step, compute_end_s=step, peak_bytes=[0] * self.hw.num_gpus, h2d_bytes=per["h2d"],
                         d2h_bytes=per["d2h"], p2p_bytes=per["p2p"], rc_h2d_bytes=per["rc_h2d"],
                         rc_d2h_bytes=per["rc_d2h"], bytes_by_kind={k: v / steps for k, v in self.by_kind.items()},
                         stages=self.timing, events=events, gpu_names=list(self.hw.gpu_names),
                         step_ends=list(ends), busy_s=busy)
