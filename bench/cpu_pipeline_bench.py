"""The planner's predicted step time beside the measured one, for the pipeline on CPU worker
processes (no GPU needed): the check of the simulator's fidelity on machines without a GPU.

    python bench/cpu_pipeline_bench.py --out bench_out               # ~2.5 minutes on 2 cores
    python bench/cpu_pipeline_bench.py --out bench_out --repeats 2   # ~5 minutes
    python bench/cpu_pipeline_bench.py --variants "as planned" --trace-step 10 --out bench_out  # a step's trace
    python bench/cpu_pipeline_bench.py --replay --out bench_out   # those runs simulated again by the code as it is now

A GPT-2 style model (hidden 256, 8 blocks, sequence 128, 4 micro-batches of 4) is trained from scratch on the
standard library's docstrings with ``mobius train`` as a user runs it, on 2 CPU worker processes (mailboxes in
shared memory between them, gloo for collectives), in several variants: as planned; with clipping; with one device
slot (no prefetch); with 8 even stages; with boundary inputs in host memory; with no kept activations (every
backward recomputes its forward); with clipping and the delayed update (``train.update: delayed``, the CPU update
off the step's critical path), and both again with 2 micro-batches, where the CPU update weighs more; and the
round-robin schedule (``parallel.schedule: round_robin``) in five of those settings.
For each: the plan's predicted step time (``plan.json``, the simulator) and the measured median step time
of the steady-state steps (``metrics.jsonl``); and the plan's step simulated again with every unit's forward and
backward scaled to the compute phases the run measured, and the dispatch thread's own time per compute fitted to
the dispatch it measured (``calibrated``: the simulator's schedule given the compute the run really took, apart
from the profile's error). ``--repeats R`` runs the whole set R times,
interleaved, each time with a fresh cache (the units profiled, the CPU update rate and the compute inside the
steps learnt anew, as on a new machine), so a slow spell of a shared machine does not fall on one variant; the
table gives each variant's median error and its range. Within a repeat the variants run in order on one
cache, as a user's runs on one machine: every plan after the first is made with what the earlier runs measured
in their steps (the schedule's own runs, or the other schedule's until it has some; ``runs learnt``: how many,
per repeat; :mod:`partition.calibrate`), and ``profile
alone`` gives the same plan's step from the profile as measured. Prints the table and writes
``<out>/cpu_pipeline_bench.json``; with ``--trace-step N`` every run also writes the Chrome trace of its step N
(left out of its median) into its directory under ``<out>/runs``.
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

from common import OUT  # noqa: E402
from mobius.app.launch import measured_compute, phases, steady_rows  # noqa: E402
from mobius.app.run import train  # noqa: E402
from mobius.checkpoint import save_model  # noqa: E402
from mobius.config import config_from_dict  # noqa: E402
from mobius.data import byte_tokenizer  # noqa: E402
from mobius.models import build_model  # noqa: E402
from mobius.models.gpt2 import GPT2Config  # noqa: E402

PHASE_KEYS = ("forward_s", "backward_s", "upload_wait_s", "dispatch_s")  # [predicted, measured] in each row
VARIANTS = {
    "as planned": {},
    "clipping (grad_clip 1.0)": {"train": {"grad_clip": 1.0}},
    "one device slot (no prefetch)": {"parallel": {"prefetch": False}},
    "8 even stages": {"parallel": {"stages": 8}},
    "inputs in host memory": {"parallel": {"offload_inputs": "on"}},
    "no kept activations": {"parallel": {"kept_stages": []}},
    "delayed update (clipping)": {"train": {"grad_clip": 1.0, "update": "delayed"}},
    "2 micro-batches with clipping": {"train": {"grad_clip": 1.0, "micro_batches": 2}},
    "2 micro-batches with clipping and delayed update": {"train": {"grad_clip": 1.0, "micro_batches": 2,
                                                                   "update": "delayed"}},
    "round-robin": {"parallel": {"schedule": "round_robin"}},
    "round-robin with clipping": {"train": {"grad_clip": 1.0}, "parallel": {"schedule": "round_robin"}},
    "round-robin with clipping and delayed update": {"train": {"grad_clip": 1.0, "update": "delayed"},
                                       "parallel": {"schedule": "round_robin"}},
    "round-robin 2 micro-batches with clipping": {"train": {"grad_clip": 1.0, "micro_batches": 2},
                                               "parallel": {"schedule": "round_robin"}},
    "round-robin 2 micro-batches with clipping and delayed update": {"train": {"grad_clip": 1.0, "micro_batches": 2,
                                                                  "update": "delayed"},
                                                        "parallel": {"schedule": "round_robin"}},
}


def checkpoint(root: Path, width: int, blocks: int) -> Path:
    """A fresh GPT-2 checkpoint with the byte-level tokenizer (257 tokens, vocabulary 320)."""
    d = root / f"gpt2-h{width}-l{blocks}"
    cfg = GPT2Config(vocab_size=320, n_positions=256, n_embd=width, n_layer=blocks, n_head=width // 64,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=256, eos_token_id=256)
    save_model(build_model(cfg, 0), d)
    byte_tokenizer().save(d)
    return d


def variant_raw(name: str, ck: Path, root: Path, repeat: int, steps: int, workers: int, overrides: dict | None = None,
                mode: str = "pipeline") -> dict:
    """Variant ``name``'s run configuration (raw sections; ``overrides``: its sections' values, by default this
    matrix's), its output in ``root``/<name>-<repeat>."""
    cache = str(root / f"cache-{repeat}")
    raw = {"model": {"checkpoint": str(ck)},
           "data": {"seq_len": 128, "cache_dir": cache},
           "train": {"max_steps": steps, "micro_batch_size": 4, "micro_batches": 4, "lr": 1e-3,
                     "warmup_steps": 2, "grad_clip": 0.0, "eval_every": 0, "eval_batches": 1},
           "parallel": {"mode": mode, "devices": workers, "device": "cpu"},
           "partition": {"cache_dir": cache},
           "output": {"dir": str(root / f"{name.replace(' ', '_')}-{repeat}"), "plot": False}}
    for section, values in (VARIANTS[name] if overrides is None else overrides).items():
        raw.setdefault(section, {}).update(values)
    return raw


def run_variant(name: str, ck: Path, root: Path, repeat: int, args: argparse.Namespace) -> dict:
    raw = variant_raw(name, ck, root, repeat, args.steps, args.workers)
    if args.trace_step is not None:
        raw["parallel"]["trace_step"] = args.trace_step
    assert "," not in name, "variant names go in the comma list of --variants"
    cfg = config_from_dict(raw, name)
    t0 = time.perf_counter()
    train(cfg)
    wall = time.perf_counter() - t0
    out = Path(cfg.output.dir)
    plan = json.loads((out / "plan.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    measured = statistics.median(r["step_s"] for r in steady_rows(rows, args.warmup))  # a traced step left out
    rr = plan.get("round_robin", {})
    runs = bool(rr.get("runs"))  # the round-robin schedule ran: its prediction and ops
    predicted = rr["step_s"] if runs else plan["predicted_step_s"]
    split = phases(predicted, rr["time_split"] if runs else plan["time_split"], rows, args.warmup) or {}
    stages = f"{len(rr['forward']) - 1}+1+{len(rr['backward']) - 1} ops" if runs else plan["num_stages"]
    return {**{f"{phase}_s": [round(a, 4), round(b, 4)] for phase, (a, b) in split.items() if phase != "step"},
            "variant": name, "repeat": repeat, "stages": stages, "num_slots": plan["num_slots"],
            "offload_inputs": plan["offload_inputs"], "barrier": plan["barrier"],
            "resident": plan["resident"], "kept": plan["kept"], "predicted_s": round(predicted, 4),
            "measured_s": round(measured, 4), "error": round(predicted / measured - 1, 4),
            "model_s": round(plan["model_step_s"], 4), "cpu_adam_params_per_s": plan["cpu_adam_params_per_s"],
            "compute_spread": round(statistics.median(r["compute_spread"] for r in steady_rows(rows, args.warmup)), 4),
            "wall_s": round(wall, 1), **replayed(cfg, plan, rows, args.warmup)}


def replayed(cfg, plan: dict, rows: list[dict], warmup: int) -> dict:
    """The plan's step simulated again with the profile it was planned with (``as_planned_s``: it must equal
    the plan's prediction) and with the profile as measured (``profile_only_s``: the prediction without what
    earlier runs on the machine taught the planner, ``learnt_runs`` of them, :mod:`partition.calibrate`), then
    with every unit's forward and backward scaled until the simulated forward and backward phases equal the
    ones the run measured, and the dispatch thread's own time per compute until the dispatch phase does
    (``calibrated_s``): the simulator's schedule given the compute the run really took, apart from the profile's
    error on this machine (``forward_x``, ``backward_x``: the scales against the profile as measured;
    ``action_ms``: the dispatch per compute)."""
    from mobius.app.planning import hardware, profile
    from mobius.app.settings import Machine, resolve
    from mobius.assemble import planned_architecture
    from partition.calibrate import ComputeScale, fit_scale
    from partition import ScheduleComparison

    machine = Machine.detect(cfg)
    settings = resolve(cfg, machine, "pipeline", "")
    hw = hardware(cfg, settings, machine)
    measured = profile(cfg, planned_architecture(cfg), settings, machine, hw)
    learnt = ComputeScale(**plan["compute_scale"])
    planned = ScheduleComparison.from_json(plan).runs
    steady = steady_rows(rows, warmup)
    fit = fit_scale(measured, lambda p: planned.replay(p, hw), measured_compute(steady, dispatch=True))
    return {"as_planned_s": round(planned.replay(learnt.apply(measured), hw).step_s, 4),
            "profile_only_s": round(planned.replay(measured, hw).step_s, 4),
            "calibrated_s": round(planned.replay(fit.apply(measured), hw).step_s, 4),
            "forward_x": round(fit.forward, 3), "backward_x": round(fit.backward, 3),
            "action_ms": round(fit.action_s * 1e3, 3),
            "learnt_runs": learnt.runs, "learnt_x": [round(learnt.forward, 3), round(learnt.backward, 3)]}


def summarize(rows: list[dict]) -> list[dict]:
    """Per variant (in the order run): the median predicted and measured step, the median error
    (predicted / measured - 1) and its range over the repeats."""
    by: dict[str, list[dict]] = {}
    for r in rows:
        by.setdefault(r["variant"], []).append(r)
    def both(key: str, rs: list[dict]) -> list[float]:
        return [round(statistics.median(r[key][i] for r in rs), 4) for i in (0, 1)]

    return [{"variant": name, "repeats": len(rs), **{k: both(k, rs) for k in PHASE_KEYS},
             "predicted_s": round(statistics.median(r["predicted_s"] for r in rs), 4),
             "measured_s": round(statistics.median(r["measured_s"] for r in rs), 4),
             "error": round(statistics.median(r["error"] for r in rs), 4),
             "error_min": min(r["error"] for r in rs), "error_max": max(r["error"] for r in rs),
             "calibrated_error": round(statistics.median(r["calibrated_s"] / r["measured_s"] - 1 for r in rs), 4),
             "profile_only_error": round(statistics.median(r["profile_only_s"] / r["measured_s"] - 1 for r in rs), 4),
             "learnt_runs": [r["learnt_runs"] for r in rs],
             "compute_spread": round(statistics.median(r["compute_spread"] for r in rs), 4)}
            for name, rs in by.items()]


def replay_kept(out: Path) -> list[dict]:
    """The runs an earlier ``--trace-step`` bench kept in ``out``, simulated again as the code now simulates them:
    per variant the medians over its repeats of the errors (predicted / measured - 1) then and now, as planned
    (with the compute the earlier runs had taught), calibrated and from the profile alone."""
    runs, table = out / "runs", out / "cpu_pipeline_bench.json"
    if not (table.is_file() and runs.is_dir()):
        raise SystemExit(f"{runs if table.is_file() else table} does not exist: --replay reads what a --trace-step "
                         f"bench wrote and kept in --out")
    data = json.loads(table.read_text())
    a = data["args"]
    ck, by = next(runs.glob("gpt2-*")), {}
    for row in data["rows"]:
        cfg = config_from_dict(variant_raw(row["variant"], ck, runs, row["repeat"], a["steps"], a["workers"]),
                               row["variant"])
        d = Path(cfg.output.dir)
        rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
        now = replayed(cfg, json.loads((d / "plan.json").read_text()), rows, a["warmup"])
        m = row["measured_s"]
        by.setdefault(row["variant"], []).append(
            [row["error"], now["as_planned_s"] / m - 1, row["calibrated_s"] / m - 1, now["calibrated_s"] / m - 1,
             row["profile_only_s"] / m - 1, now["profile_only_s"] / m - 1])
    keys = ("planned_then", "planned_now", "calibrated_then", "calibrated_now", "profile_then", "profile_now")
    return [{"variant": name, **{k: round(statistics.median(r[i] for r in rs), 4) for i, k in enumerate(keys)}}
            for name, rs in by.items()]


def print_replay(rows: list[dict]) -> None:
    print(f"{'variant':32s} {'as planned: then':>16s} {'now':>7s} {'calibrated: then':>16s} {'now':>7s} "
          f"{'profile alone: then':>19s} {'now':>7s}   (predicted / measured - 1, medians of the repeats)")
    for r in rows:
        print(f"{r['variant']:32s} {100 * r['planned_then']:+15.1f}% {100 * r['planned_now']:+6.1f}% "
              f"{100 * r['calibrated_then']:+15.1f}% {100 * r['calibrated_now']:+6.1f}% "
              f"{100 * r['profile_then']:+18.1f}% {100 * r['profile_now']:+6.1f}%")


def matrix_arguments(doc: str, variants: dict) -> argparse.ArgumentParser:
    """The arguments a CPU bench matrix takes (this one's and ``cpu_zero_bench.py``'s)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=OUT)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--warmup", type=int, default=4, help="steps left out of the measured median")
    p.add_argument("--variants", default=",".join(variants))
    p.add_argument("--repeats", type=int, default=1, help="run every variant this many times, interleaved")
    return p


def check_variants(p: argparse.ArgumentParser, names: str, variants: dict) -> None:
    unknown = [name for name in names.split(",") if name not in variants]
    if unknown:
        p.error(f"unknown variant(s) {', '.join(map(repr, unknown))}; the variants: {', '.join(map(repr, variants))}")


def main() -> None:
    p = matrix_arguments(__doc__, VARIANTS)
    p.add_argument("--trace-step", type=int, default=None,
                   help="trace this step (1-based) of every run (parallel.trace_step; the step after it waits to write "
                        "the trace and is left out of the median) and keep the runs' directories under <out>/runs")
    p.add_argument("--replay", action="store_true", help="run nothing: simulate the runs a --trace-step bench kept in "
                   "--out again with the simulator as it is now, beside the errors they were run with")
    args = p.parse_args()
    if args.replay:
        rows = replay_kept(Path(args.out))
        print_replay(rows)
        (Path(args.out) / "cpu_pipeline_bench_replay.json").write_text(json.dumps(rows, indent=2))
        return
    check_variants(p, args.variants, VARIANTS)
    logging.basicConfig(level=logging.WARNING)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.out) / "runs" if args.trace_step is not None else Path(tmp)
        ck = checkpoint(root, args.width, args.blocks)
        for repeat in range(args.repeats):
            for name in args.variants.split(","):
                rows.append(run_variant(name, ck, root, repeat, args))
                print(json.dumps(rows[-1]), flush=True)
    summary = summarize(rows)
    print(f"\n{'variant':32s} {'predicted s':>12s} {'measured s':>11s} {'error':>7s} {'range':>16s} {'calibrated':>10s} "
          f"{'profile alone':>13s} {'runs learnt':>11s} {'spread':>6s}   forward, backward, upload wait, dispatch: "
          f"predicted / measured s")
    for r in summary:
        split = ", ".join(f"{r[k][0]:.3f} / {r[k][1]:.3f}" for k in PHASE_KEYS)
        print(f"{r['variant']:32s} {r['predicted_s']:12.3f} {r['measured_s']:11.3f} {100 * r['error']:+6.1f}% "
              f"{100 * r['error_min']:+7.1f}..{100 * r['error_max']:+.1f}% {100 * r['calibrated_error']:+9.1f}% "
              f"{100 * r['profile_only_error']:+12.1f}% {','.join(map(str, r['learnt_runs'])):>11s} "
              f"{100 * r['compute_spread']:5.1f}%   {split}")
    out = Path(args.out) / "cpu_pipeline_bench.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "cpus": os.cpu_count(), "rows": rows, "summary": summary},
                              indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
