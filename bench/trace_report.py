"""A traced step beside its plan: where the step went on each worker's tracks, and each pipeline stage's compute
against the plan's (the profile it was planned with: scaled by the compute earlier runs on the machine measured).

    mobius train run.yaml --parallel.trace_step=6 --train.max_steps=7   # writes trace-step6.json beside plan.json
    python bench/trace_report.py runs/my-run                            # the run's output.dir

Per worker: the step's span, each track's busy time by kind of span (compute: forwards, backwards, the last
stage's fused forward and backward; h2d: uploads and prefetches; d2h: gradient downloads and offloaded inputs;
cpu: AdamW ``O`` and the delayed update's compute copies ``K``; dispatch: the dispatch thread's own time on each
action but compute, by its letter: ``T`` the tied ends' sum, ``R`` the reduce), and the compute stream's idle
time, the longest gaps with the spans on either side. Per stage (the swapped pipeline): the measured forward and
backward seconds beside the plan's, and the compute stream's wait for the stage's uploads beside the simulated
one. A traced step runs as the others (the step after it waits to write the trace), and its ``cpu`` track holds
its own updates, drawn where they ran (beside the next step's compute, which the trace leaves out). Prints the
tables and writes ``trace_report.json`` into the run directory.
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass
from pathlib import Path

NAME = re.compile(r"^(FB|F|B|U|P|D|H|L|O|K)(\d+)")  # a span's kind and stage (the runtime's names)


@dataclass(frozen=True)
class Span:
    name: str
    start: float  # seconds from the step's origin
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


def load_trace(path: Path) -> dict[str, dict[str, list[Span]]]:
    """worker -> track -> its spans in start order, from a trace the runtime wrote (``parallel.trace_step``)."""
    events = json.loads(path.read_text())["traceEvents"]
    workers = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
    tracks = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
              if e.get("ph") == "M" and e["name"] == "thread_name"}
    out: dict[str, dict[str, list[Span]]] = {}
    for e in events:
        if e.get("ph") == "X":
            track = out.setdefault(workers[e["pid"]], {}).setdefault(tracks[(e["pid"], e["tid"])], [])
            track.append(Span(e["name"], e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6))
    for tracks_of in out.values():
        for spans in tracks_of.values():
            spans.sort(key=lambda s: s.start)
    return out


def kind_of(name: str) -> str:
    """A span's kind: the letters before its stage (``FB``, ``F``, ``B``, ``U``, ``D``, ``O``, ``K``, ...), or a
    dispatch action's leading letter (``T``, ``R``, ``s`` a send, ``r`` a receive, ``X`` a free, ...)."""
    m = NAME.match(name)
    return m.group(1) if m else name[:1]


def worker_summary(tracks: dict[str, list[Span]], gaps: int = 3) -> dict:
    """The worker's span of the step, each track's busy seconds by kind, and the compute stream's idle time with
    its ``gaps`` longest gaps (seconds, the span before, the span after)."""
    every = [s for spans in tracks.values() for s in spans]
    out: dict = {"start_s": min(s.start for s in every), "end_s": max(s.end for s in every), "tracks": {}}
    for track, spans in tracks.items():
        by: dict[str, float] = {}
        for s in spans:
            by[kind_of(s.name)] = by.get(kind_of(s.name), 0.0) + s.seconds
        out["tracks"][track] = {k: round(v, 6) for k, v in sorted(by.items(), key=lambda kv: -kv[1])}
    compute = tracks.get("compute", [])
    holes = [(b.start - a.end, a.name, b.name) for a, b in zip(compute, compute[1:]) if b.start > a.end]
    if compute:
        holes.append((compute[0].start - out["start_s"], "(step start)", compute[0].name))
        holes.append((out["end_s"] - compute[-1].end, compute[-1].name, "(step end)"))
    out["compute_idle_s"] = round(sum(h[0] for h in holes), 6)
    out["longest_gaps"] = [(round(h[0], 6), h[1], h[2]) for h in sorted(holes, reverse=True)[:gaps]]
    return out


def stage_rows(trace: dict[str, dict[str, list[Span]]], plan: dict) -> list[dict]:
    """Per stage of a swapped-pipeline plan: measured forward and backward seconds beside the plan's (its
    per-micro-batch figures, from the profile it was planned with, scaled already by what earlier runs taught
    it, times the micro-batches; the last stage's fused forward and backward is its backward, as in the plan),
    and the compute's wait for the stage's uploads."""
    M = plan["micro_batches"]
    spans = [s for tracks in trace.values() for s in tracks.get("compute", [])]
    rows = []
    for st in plan["stages"]:
        j = st["index"]
        mine = [s for s in spans if _stage(s.name) == j]
        fused = any(kind_of(s.name) == "FB" for s in mine)
        fwd = sum(s.seconds for s in mine if kind_of(s.name) == "F")
        bwd = sum(s.seconds for s in mine if kind_of(s.name) in ("B", "FB"))
        rows.append({"stage": j, "units": st["units"],
                     "forward_s": [0.0 if fused else round(st["fwd_s"] * M, 6), round(fwd, 6)],
                     "backward_s": [round(st["bwd_s"] * M, 6), round(bwd, 6)],
                     "upload_wait_s": [round(st["upload_wait_s"], 6), round(_upload_wait(trace, j), 6)]})
    return rows


def _upload_wait(trace: dict[str, dict[str, list[Span]]], j: int) -> float:
    """The compute stream's time waiting for stage j's uploads: of each gap before a compute of stage j, the part
    during which an upload of the stage was still running (the compute may have waited for its input as well:
    the trace does not draw arrivals)."""
    total = 0.0
    for tracks in trace.values():
        compute = tracks.get("compute", [])
        uploads = [u for u in tracks.get("h2d", []) if kind_of(u.name) in ("U", "P") and _stage(u.name) == j]
        origin = min(x.start for spans in tracks.values() for x in spans)
        for i, s in enumerate(compute):
            if _stage(s.name) != j:
                continue
            before = compute[i - 1].end if i else origin
            ends = [u.end for u in uploads if before < u.end <= s.start + 1e-4]
            total += max(0.0, min(max(ends), s.start) - before) if ends else 0.0
    return total


def _stage(name: str) -> int:
    m = NAME.match(name)
    return int(m.group(2)) if m else -1


def report(run_dir: Path) -> dict:
    traces = sorted(run_dir.glob("trace-step*.json"))
    if not traces:
        raise SystemExit(f"{run_dir}: no trace-step*.json (run with --parallel.trace_step=N)")
    trace = load_trace(traces[-1])
    plan = json.loads((run_dir / "plan.json").read_text())
    rr = bool(plan.get("round_robin", {}).get("runs"))
    return {"trace": traces[-1].name, "predicted_step_s": plan["round_robin"]["step_s"] if rr else
            plan["predicted_step_s"], "workers": {w: worker_summary(t) for w, t in trace.items()},
            "stages": [] if rr else stage_rows(trace, plan)}


def _print(out: dict) -> None:
    print(f"{out['trace']}: predicted step {out['predicted_step_s']:.3f} s")
    for w, s in out["workers"].items():
        print(f"\n{w}: {s['end_s'] - s['start_s']:.3f} s from its first span to its last; compute idle "
              f"{s['compute_idle_s']:.3f} s")
        for track, by in s["tracks"].items():
            print(f"  {track:9s} " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in by.items()))
        print("  longest compute gaps: " + "; ".join(f"{g * 1e3:.1f} ms {a} -> {b}" for g, a, b in s["longest_gaps"]))
    if out["stages"]:
        print("\nstage  units                    forward s (plan / trace)  backward s (plan / trace)  upload wait s "
              "(plan / trace)")
        for r in out["stages"]:
            print(f"{r['stage']:5d}  {r['units']:24s} {r['forward_s'][0]:10.4f} / {r['forward_s'][1]:.4f}"
                  f"       {r['backward_s'][0]:10.4f} / {r['backward_s'][1]:.4f}"
                  f"       {r['upload_wait_s'][0]:.4f} / {r['upload_wait_s'][1]:.4f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path, help="the run's output.dir (trace-step*.json and plan.json)")
    args = p.parse_args()
    out = report(args.run_dir)
    _print(out)
    path = args.run_dir / "trace_report.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
