"""bench/trace_report.py on a hand-made two-worker trace: each track's busy time by kind, the compute stream's
idle time and gaps, and each stage's compute and upload wait beside the plan's."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _module():
    spec = importlib.util.spec_from_file_location("trace_report", ROOT / "bench" / "trace_report.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclass looks its module up
    spec.loader.exec_module(mod)
    return mod


def _trace(spans: dict[int, list[tuple[str, str, float, float]]]) -> dict:
    """Per worker (pid), (track, name, start ms, end ms) spans in the runtime's trace format."""
    tracks = ("compute", "h2d", "d2h", "p2p", "cpu", "dispatch")
    events = []
    for pid, rows in spans.items():
        events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"worker {pid - 1} (cpu)"}})
        events += [{"name": "thread_name", "ph": "M", "pid": pid, "tid": t, "args": {"name": n}}
                   for t, n in enumerate(tracks)]
        events += [{"name": name, "ph": "X", "ts": a * 1e3, "dur": (b - a) * 1e3, "pid": pid,
                    "tid": tracks.index(track)} for track, name, a, b in rows]
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def test_a_trace_is_summed_by_track_and_set_beside_its_plan(tmp_path: Path) -> None:
    """Worker 0 runs stages 0 and 2 (the last, fused), worker 1 stage 1, two micro-batches. Stage 0's upload ends
    at 10 ms, so its first forward waits 10 ms for it; stage 2's upload ends 5 ms after the forward before it, and
    its first fused step starts then; stage 1's upload runs for the first 3 ms of the 12 its first forward waits
    (for its input too: the trace cannot tell, and counts the 3 ms)."""
    w0 = [("h2d", "U0", 0, 10), ("compute", "F0,0", 10, 12), ("compute", "F0,1", 12, 14), ("h2d", "U2", 12, 19),
          ("compute", "FB2,0", 19, 39), ("compute", "FB2,1", 39, 59), ("compute", "B0,0", 70, 74),
          ("compute", "B0,1", 74, 78), ("d2h", "D0", 78, 80), ("dispatch", "T", 80, 83), ("dispatch", "R", 83, 84),
          ("cpu", "O0", 84, 90), ("cpu", "K2", 60, 61)]
    w1 = [("h2d", "U1", 0, 3), ("compute", "F1,0", 12, 16), ("compute", "F1,1", 16, 20),
          ("compute", "B1,0", 59, 67), ("compute", "B1,1", 67, 75), ("d2h", "D1", 75, 76)]
    (tmp_path / "trace-step3.json").write_text(json.dumps(_trace({1: w0, 2: w1})))
    def stage(j: int, f: float, b: float) -> dict:
        return {"index": j, "units": f"u{j}", "fwd_s": f, "bwd_s": b, "upload_wait_s": 0.001 * j}

    plan = {"predicted_step_s": 0.09, "micro_batches": 2, "round_robin": {},
            "stages": [stage(0, 0.001, 0.002), stage(1, 0.002, 0.004), stage(2, 0.0, 0.011)]}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    out = _module().report(tmp_path)
    w = out["workers"]["worker 0 (cpu)"]
    assert (w["start_s"], w["end_s"]) == pytest.approx((0.0, 0.090))
    assert w["tracks"]["compute"] == pytest.approx({"FB": 0.040, "B": 0.008, "F": 0.004})
    assert w["tracks"]["dispatch"] == pytest.approx({"T": 0.003, "R": 0.001})
    assert w["tracks"]["cpu"] == pytest.approx({"O": 0.006, "K": 0.001})
    # idle: 10 ms before the first forward, 5 before stage 2, 11 between the fused steps and B0, 12 after B0
    assert w["compute_idle_s"] == pytest.approx(0.038)
    assert w["longest_gaps"][0] == (pytest.approx(0.012), "B0,1", "(step end)")
    rows = {r["stage"]: r for r in out["stages"]}
    assert rows[0]["forward_s"] == pytest.approx([0.002, 0.004])
    assert rows[0]["backward_s"] == pytest.approx([0.004, 0.008])
    assert rows[2]["forward_s"] == pytest.approx([0.0, 0.0])  # the fused stage's forward is in its backward
    assert rows[2]["backward_s"] == pytest.approx([0.022, 0.040])
    assert rows[0]["upload_wait_s"] == pytest.approx([0.0, 0.010])  # its upload ended at 10 ms, the forward began then
    assert rows[2]["upload_wait_s"] == pytest.approx([0.002, 0.005])  # U2 ended 5 ms after F0,1
    assert rows[1]["upload_wait_s"] == pytest.approx([0.001, 0.003])  # the upload ran for 3 ms of the 12 before F1,0


def _replay_module():
    _module()  # bench/trace_replay.py imports trace_report as a sibling module
    spec = importlib.util.spec_from_file_location("trace_replay", ROOT / "bench" / "trace_replay.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_replay_counts_each_gap_between_computes_beyond_the_simulators() -> None:
    """bench/trace_replay.py: a traced compute is matched to the simulated one of the same kind, op and micro-batch
    of the step (the simulator numbers micro-batches across its steps); each gap between consecutive traced computes
    less the simulated gap between the same two, by whether the next one is another op's (a switch) or not."""
    tr = _replay_module()
    report = _module()
    assert tr.compute_key("B6,1", 4) == ("B", 6, 1) and tr.compute_key("B6.13", 4) == ("B", 6, 1)
    assert tr.compute_key("FB4.2", 4) == ("FB", 4, 2) and tr.compute_key("sg4,0", 4) is None
    traced = [report.Span(n, a / 1e3, b / 1e3) for n, a, b in
              [("F0,0", 0, 10), ("F0,1", 11, 21), ("U2", 21, 22), ("F2,0", 25, 35), ("F2,1", 35.5, 45)]]
    simulated = {("F", 0, 0): (0.0, 0.010), ("F", 0, 1): (0.0101, 0.0201), ("F", 2, 0): (0.0211, 0.0311),
                 ("F", 2, 1): (0.0312, 0.0412)}
    out = tr.gap_residuals(traced, simulated, 4)
    assert [round(x * 1e3, 3) for x in out["same"]] == [0.9, 0.4]  # 1 - 0.1 and 0.5 - 0.1 ms
    assert [round(x * 1e3, 3) for x in out["switch"]] == [3.0]  # 4 ms traced (the upload between) - 1 simulated
