"""Zero mode's predicted step time beside the measured one on CPU worker processes (no GPU needed): the check of
its simulator's fidelity on machines without a GPU, as ``cpu_pipeline_bench.py`` is the pipeline's.

    python bench/cpu_zero_bench.py --out bench_out                # ~3 minutes on 2 cores
    python bench/cpu_zero_bench.py --out bench_out --repeats 2    # ~6 minutes

The same model as the pipeline's bench (GPT-2 style, hidden 256, 8 blocks, sequence 128, 4 micro-batches of 4), trained
from scratch with ``mobius train`` in zero mode (``parallel.mode: zero``) on 2 CPU worker processes (gloo), in several
variants: as planned; with clipping; with activation checkpointing; every chunk offloaded (the CPU optimizer thread's
AdamW); without prefetch; with clipping and the delayed update; on one worker. For each: the plan's predicted step
(``plan.json``), the median measured step of the steady steps (``metrics.jsonl``), the same plan from the profile
alone, and ``calibrated``: the plan simulated again with the compute, the reduce-scatters and the spreads the run
itself measured (:func:`partition.calibrate.fit_scale`); and the phases, predicted / measured: the forward and backward
compute, and the dispatch thread's waits for gathers and reduce-scatters. ``--repeats R`` runs the set R times,
interleaved, each time with a fresh cache; within a repeat the variants run in order on one cache, every plan after
the first made with what the earlier runs measured (:mod:`partition.calibrate`: each setting learns apart, so a
variant's first run of a repeat is planned from the profile alone). Prints the table and writes
``<out>/cpu_zero_bench.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cpu_pipeline_bench import check_variants, checkpoint, matrix_arguments, variant_raw  # noqa: E402
from mobius.app.launch import measured_compute, steady_rows, zero_phases  # noqa: E402
from mobius.app.run import train  # noqa: E402
from mobius.config import config_from_dict  # noqa: E402

PHASES = ("forward", "backward", "gather_wait", "reduce_scatter")  # [predicted, measured] in each row
VARIANTS = {
    "as planned": {},
    "clipping (grad_clip 1.0)": {"train": {"grad_clip": 1.0}},
    "activation checkpointing": {"model": {"activation_checkpointing": True}},
    "every chunk offloaded": {"zero": {"gpu_chunks": 0}},
    "no prefetch": {"parallel": {"prefetch": False}},
    "delayed update (clipping)": {"train": {"grad_clip": 1.0, "update": "delayed"}},
    "one worker": {"parallel": {"devices": 1}},
}


def run_variant(name: str, ck: Path, root: Path, repeat: int, args: argparse.Namespace) -> dict:
    from partition.zero import ZeroPlan

    cfg = config_from_dict(variant_raw(name, ck, root, repeat, args.steps, args.workers, VARIANTS[name], "zero"), name)
    t0 = time.perf_counter()
    train(cfg)
    wall = time.perf_counter() - t0
    out = Path(cfg.output.dir)
    plan = ZeroPlan.from_json(json.loads((out / "plan.json").read_text()))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steady = steady_rows(rows, args.warmup)
    measured = statistics.median(r["step_s"] for r in steady)
    split = zero_phases(plan, rows, args.warmup) or {}
    return {**{f"{p}_s": [round(a, 4), round(b, 4)] for p, (a, b) in split.items() if p in PHASES},
            "variant": name, "repeat": repeat, "chunks": plan.num_chunks, "cache_blocks": plan.cache_blocks,
            "gpu_chunks": plan.gpu_chunks, "predicted_s": round(plan.predicted_step_s, 4),
            "measured_s": round(measured, 4), "error": round(plan.predicted_step_s / measured - 1, 4),
            "spread_s": round(plan.spread_s, 4), "wall_s": round(wall, 1), **replayed(cfg, plan, steady)}


def replayed(cfg, plan, steady: list[dict]) -> dict:
    """The plan's step simulated again with the profile as measured (``profile_only_s``) and with the compute, the
    reduce-scatters and the spreads the run measured fitted to it (``calibrated_s``; ``forward_x``, ``backward_x``,
    ``reduce_scatter_x``)."""
    from mobius.app.planning import hardware, profile, zero_hardware
    from mobius.app.settings import Machine, resolve
    from mobius.assemble import planned_architecture
    from mobius.models import unit_specs
    from mobius.models.params import model_params
    from partition.calibrate import ComputeScale, fit_scale
    from partition.zero import replay

    machine = Machine.detect(cfg)
    model_cfg = planned_architecture(cfg)
    settings = resolve(cfg, machine, "zero", "")
    hw = hardware(cfg, settings, machine)
    measured = profile(cfg, model_cfg, settings, machine, hw)
    zhw = zero_hardware(cfg, settings, machine, hw)
    params, units = model_params(model_cfg), len(unit_specs(model_cfg))
    again = (lambda p: replay(plan, params, units, p, zhw))
    fit = fit_scale(measured, again, measured_compute(steady, waits=True))
    learnt = ComputeScale(**plan.compute_scale)
    return {"as_planned_s": round(again(learnt.apply(measured)).step_s, 4),
            "profile_only_s": round(again(measured).step_s, 4),
            "calibrated_s": round(again(fit.apply(measured)).step_s, 4),
            "forward_x": round(fit.forward, 3), "backward_x": round(fit.backward, 3),
            "reduce_scatter_x": round(fit.reduce_scatter_x, 3), "worker_spread": round(fit.worker_spread, 3),
            "compute_spread": round(fit.compute_spread, 3), "learnt_runs": learnt.runs}


def summarize(rows: list[dict]) -> list[dict]:
    """Per variant (in the order run): the medians of the predicted and measured step, of the errors
    (predicted / measured - 1; as planned, calibrated, from the profile alone) and of the phases."""
    by: dict[str, list[dict]] = {}
    for r in rows:
        by.setdefault(r["variant"], []).append(r)

    def median(key: str, rs: list[dict]) -> float:
        return round(statistics.median(r[key] for r in rs), 4)

    def error(key: str, rs: list[dict]) -> float:
        return round(statistics.median(r[key] / r["measured_s"] - 1 for r in rs), 4)

    return [{"variant": name, "repeats": len(rs), "predicted_s": median("predicted_s", rs),
             "measured_s": median("measured_s", rs), "error": median("error", rs),
             "error_min": min(r["error"] for r in rs), "error_max": max(r["error"] for r in rs),
             "calibrated_error": error("calibrated_s", rs), "profile_only_error": error("profile_only_s", rs),
             "learnt_runs": [r["learnt_runs"] for r in rs],
             **{f"{p}_s": [round(statistics.median(r[f"{p}_s"][i] for r in rs), 4) for i in (0, 1)]
                for p in PHASES if all(f"{p}_s" in r for r in rs)}}
            for name, rs in by.items()]


def print_summary(summary: list[dict]) -> None:
    print(f"\n{'variant':26s} {'predicted s':>11s} {'measured s':>10s} {'error':>7s} {'range':>15s} "
          f"{'calibrated':>10s} "
          f"{'profile alone':>13s} {'runs learnt':>11s}   {', '.join(PHASES)}: predicted / measured s")
    for r in summary:
        split = ", ".join(f"{r[f'{p}_s'][0]:.3f} / {r[f'{p}_s'][1]:.3f}" for p in PHASES if f"{p}_s" in r)
        print(f"{r['variant']:26s} {r['predicted_s']:11.3f} {r['measured_s']:10.3f} {100 * r['error']:+6.1f}% "
              f"{100 * r['error_min']:+6.1f}..{100 * r['error_max']:+.1f}% {100 * r['calibrated_error']:+9.1f}% "
              f"{100 * r['profile_only_error']:+12.1f}% {','.join(map(str, r['learnt_runs'])):>11s}   {split}")


def main() -> None:
    p = matrix_arguments(__doc__, VARIANTS)
    args = p.parse_args()
    check_variants(p, args.variants, VARIANTS)
    logging.basicConfig(level=logging.WARNING)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        ck = checkpoint(Path(tmp), args.width, args.blocks)
        for repeat in range(args.repeats):
            for name in args.variants.split(","):
                rows.append(run_variant(name, ck, Path(tmp), repeat, args))
                print(json.dumps(rows[-1]), flush=True)
    summary = summarize(rows)
    print_summary(summary)
    out = Path(args.out) / "cpu_zero_bench.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "cpus": os.cpu_count(), "rows": rows, "summary": summary},
                              indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
