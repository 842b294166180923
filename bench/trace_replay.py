"""A traced step of a ``bench/cpu_pipeline_bench.py`` run, replayed in the simulator with each compute's traced
duration: what is left between the two is the schedule's own error (the dispatch thread's work and the waits the
simulator does not draw), with the compute taken as it ran.

    python bench/cpu_pipeline_bench.py --variants "round-robin" --repeats 1 --trace-step 10 --out bench_out
    python bench/trace_replay.py bench_out "round-robin" --step 10

Prints the traced step (the run's metrics row) beside the simulated one given the run's mean compute (the bench's
``calibrated_s``; both with the step's dispatch time per compute fitted to its ``dispatch_s``) and given each
compute's traced duration, then per worker the gaps between consecutive computes
beyond the simulator's (traced gap less simulated gap): at a switch to another op or stage, and between the
micro-batches of one. Works for the bench's runs (it rebuilds their configuration from the variant's name).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Iterator

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trace_report import Span, load_trace  # noqa: E402

COMPUTE = re.compile(r"^(FB|F|C|B)(\d+)[,.](\d+)$")  # a compute's kind, stage (op) and micro-batch


def compute_key(name: str, micro_batches: int) -> tuple[str, int, int] | None:
    """(kind, stage, micro-batch of the step) of a traced (``B6,1``) or simulated (``B6.13``) compute."""
    m = COMPUTE.match(name)
    return None if m is None else (m.group(1), int(m.group(2)), int(m.group(3)) % micro_batches)


def gap_residuals(traced: list[Span], simulated: dict[tuple, tuple[float, float]],
                  micro_batches: int) -> dict[str, list[float]]:
    """Per kind of gap (``switch``: the next compute is another op's or stage's; ``same``: another micro-batch of
    the same one), each traced gap between consecutive computes of one worker less the simulated gap between the
    same two computes (seconds). ``simulated``: compute key -> (start, end)."""
    out: dict[str, list[float]] = {"switch": [], "same": []}
    prev = None
    for span in traced:
        key = compute_key(span.name, micro_batches)
        if key is None or key not in simulated:
            continue
        if prev is not None:
            (pkey, pspan) = prev
            sim_gap = simulated[key][0] - simulated[pkey][1]
            out["switch" if key[1] != pkey[1] else "same"].append((span.start - pspan.end) - sim_gap)
        prev = (key, span)
    return out


@contextlib.contextmanager
def traced_durations(durations: dict[tuple[str, int, int], float], micro_batches: int) -> Iterator[None]:
    """While open, the simulator takes each compute's duration from ``durations`` (key: :func:`compute_key`'s)
    where it has one."""
    from partition.schedule.pipeline import Kind
    from partition.sim.compute_streams import ComputeTimes

    letter = {Kind.FORWARD: "F", Kind.RECOMPUTE: "C", Kind.BACKWARD: "B", Kind.FB: "FB"}
    modelled = ComputeTimes.duration

    def duration(self, task, gpu: int, step: int) -> float:
        key = (letter.get(task.kind), task.stage, task.micro % micro_batches)
        return durations.get(key, modelled(self, task, gpu, step)) if key[0] else modelled(self, task, gpu, step)

    ComputeTimes.duration = duration
    try:
        yield
    finally:
        ComputeTimes.duration = modelled


def _config(out: Path, variant: str):
    """The bench run's configuration, as bench/cpu_pipeline_bench.py made it (its defaults: the first repeat)."""
    import cpu_pipeline_bench as bench
    from mobius.config import config_from_dict

    runs = out / "runs"
    return config_from_dict(bench.variant_raw(variant, next(runs.glob("gpt2-*")), runs, 0, 14, 2), variant)


def replay(out: Path, variant: str, step: int) -> dict:
    from mobius.app.launch import measured_compute
    from mobius.app.planning import hardware, profile
    from mobius.app.settings import Machine, resolve
    from mobius.assemble import planned_architecture
    from partition.calibrate import fit_scale
    from partition import ScheduleComparison

    run = out / "runs" / f"{variant.replace(' ', '_')}-0"
    cfg = _config(out, variant)
    M = cfg.train.micro_batches
    machine = Machine.detect(cfg)
    settings = resolve(cfg, machine, "pipeline", "")
    hw = hardware(cfg, settings, machine)
    measured = profile(cfg, planned_architecture(cfg), settings, machine, hw)
    plan = ScheduleComparison.from_json(json.loads((run / "plan.json").read_text())).runs
    row = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][step - 1]
    fit = fit_scale(measured, lambda p: plan.replay(p, hw), measured_compute([row], dispatch=True))
    scaled = fit.apply(measured)  # with this step's dispatch time per compute
    trace = load_trace(run / f"trace-step{step}.json")
    durations = {compute_key(s.name, M): s.seconds for w in trace.values() for s in w["compute"]}
    with traced_durations(durations, M):
        sim = plan.replay(scaled, hw)
    workers = {}
    for gpu, (name, tracks) in enumerate(sorted(trace.items())):
        simulated = {compute_key(e.name, M): (e.start, e.end) for e in sim.events
                     if e.gpu == gpu and e.track == "compute" and compute_key(e.name, M)}
        workers[name] = gap_residuals(tracks["compute"], simulated, M)
    return {"variant": variant, "step": step, "traced_s": row["step_s"], "mean_compute_s": plan.replay(scaled, hw).step_s,
            "traced_compute_s": sim.step_s, "workers": workers}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="the bench's --out directory")
    p.add_argument("variant", help="the variant's name, as --variants had it")
    p.add_argument("--step", type=int, default=10, help="the traced step (--trace-step)")
    args = p.parse_args()
    r = replay(args.out, args.variant, args.step)
    print(f"{r['variant']}, step {r['step']}: traced {r['traced_s']:.4f} s; simulated with the run's mean compute "
          f"{r['mean_compute_s']:.4f} s, with each compute's traced duration {r['traced_compute_s']:.4f} s")
    for name, kinds in r["workers"].items():
        for kind, gaps in kinds.items():
            if gaps:
                print(f"  {name}, {kind:6s}: {len(gaps):3d} gaps beyond the simulator's: {sum(gaps) * 1e3:6.1f} ms "
                      f"in all, median {statistics.median(gaps) * 1e3:.2f} ms")
    path = args.out / f"trace_replay-{args.variant.replace(' ', '_')}.json"
    path.write_text(json.dumps(r, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
