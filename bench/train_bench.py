"""``mobius train`` as a user runs it, on one GPU: each model starts from a Hugging Face checkpoint
written on this machine (the preset's architecture with seeded random weights, in bf16: a fine-tune's
start), and runs all-in-GPU (``parallel.mode=single``, uncapped) and as the pipeline or zero mode capped
at 24 GiB (``partition.gpu_memory_gib=24``, the planner's choice; zero with activation checkpointing,
which its activations need there); all at 8 micro-batches of 1 x 2048 tokens,
bf16, clipping at 1.0, as the shipped configs. Per run: time to the first step and its split (what
``mobius train`` logs as "ready in ..."), the step (mean of the steps after the first, but the last), tokens/s,
model TFLOP/s, peak GPU memory (rank 0), bytes moved, the plan's predicted step beside the measured one, the
run's wall time, and a Chrome trace of the last pipeline step (``parallel.trace_step``: a traced step waits
for its CPU updates, so it is no steady step).

    python bench/train_bench.py --presets opt-2.7b,llama-3.2-3b --out runs/train-bench
    python bench/train_bench.py --presets llama-3.1-8b --lora-rank 16 --modes single,pipeline
    python bench/train_bench.py --smoke --out /tmp/train-bench      # tiny models on CPU workers: checks the script

Writes ``<out>/train_bench.json`` (rows in the form ``bench/gpu_suite.py --report`` reads) and prints
the table; each run's directory (metrics, plan, trace, log) stays under ``<out>/runs/``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from common import OUT, architecture, rates

ROOT = Path(__file__).resolve().parents[1]
CAP_GIB = 24


def write_checkpoint(preset: str, where: Path, layers: int = 0) -> float:
    """The preset's architecture with seeded weights as a bf16 Hugging Face checkpoint (seconds taken;
    0 when it is already there)."""
    if (where / "config.json").is_file():
        return 0.0
    import torch

    from mobius.checkpoint import save_model
    from mobius.models import build_model

    mc = architecture(preset, layers)
    t0 = time.perf_counter()
    save_model(build_model(mc, seed=0), where, dtype=torch.bfloat16)
    return time.perf_counter() - t0


def run_file(args: argparse.Namespace, checkpoint: Path, mode: str, out: Path) -> dict:
    """The run's config: the shipped Llama configs' workload on this checkpoint."""
    parallel = {"mode": mode, "devices": 2 if args.smoke and mode == "pipeline" else 1,  # the last step traced: a
                "device": "cpu" if args.smoke else "cuda", "trace_step": args.steps if mode == "pipeline" else 0}
    # traced step waits for its CPU updates
    partition = {"cache_dir": str(args.out / "cache")}
    if mode != "single" and not args.smoke:
        partition["gpu_memory_gib"] = CAP_GIB
    lora = {"rank": args.lora_rank, "alpha": 2 * args.lora_rank, "targets": ["all-linear"]} if args.lora_rank else {}
    model = {"checkpoint": str(checkpoint), "activation_checkpointing": mode == "zero"}  # (zero's activations: 24 GiB)
    return {"model": model, "lora": lora,
            "data": {"path": "builtin:stdlib-docs", "seq_len": args.seq, "cache_dir": str(args.out / "cache")},
            "train": {"max_steps": args.steps, "micro_batch_size": 1, "micro_batches": args.micro_batches,
                      "precision": "fp32" if args.smoke else "bf16", "grad_clip": 1.0, "lr": 1e-5,
                      "warmup_steps": 1, "eval_every": 0, "eval_batches": 1},
            "parallel": parallel, "partition": partition,
            "output": {"dir": str(out), "plot": False, "save_dtype": "fp32" if args.smoke else "bf16"}}


def train(args: argparse.Namespace, preset: str, checkpoint: Path, mode: str) -> dict:
    """One ``mobius train`` run in its own process; its row."""
    out = args.out / "runs" / f"{preset}{f'-lora{args.lora_rank}' if args.lora_rank else ''}-{mode}"
    cfg, log_file = out.parent / f"{out.name}.yaml", out.parent / f"{out.name}.log"
    cfg.parent.mkdir(parents=True, exist_ok=True)
    cfg.write_text(json.dumps(run_file(args, checkpoint, mode, out)))
    t0 = time.perf_counter()
    with open(log_file, "w") as log:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **dict(kv.split("=", 1) for kv in args.env)}
        rc = subprocess.run([sys.executable, "-m", "mobius", "train", str(cfg), "--overwrite", *args.set], cwd=ROOT,
                            stdout=log, stderr=subprocess.STDOUT, env=env).returncode
    wall = time.perf_counter() - t0
    name = "all-in-GPU (mobius train, single)" if mode == "single" else f"mobius train {mode}, {CAP_GIB} GiB"
    name += "".join(f" {x.lstrip('-')}" for x in args.set + args.env)
    if rc != 0:
        tail = log_file.read_text().strip().splitlines()[-1:] or ["?"]
        return {"name": name, "error": tail[0][:200], "wall_s": round(wall, 1)}
    return summarise(args, preset, name, out, wall)


def summarise(args: argparse.Namespace, preset: str, name: str, out: Path, wall: float) -> dict:
    """The row of a finished run, from its metrics.jsonl and plan.json."""
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    timed = [r for r in lines[1:] if not r.get("traced")] or lines  # the first warms up (allocator, kernels)
    step = sum(r["step_s"] for r in timed) / len(timed)
    tokens = args.micro_batches * args.seq
    row = {"name": name, "step_s": round(step, 4), **rates(tokens, model_flops(args, preset), step),
           "peak_gib": max(r.get("gpu_peak_gib", 0.0) for r in lines), "ready_s": lines[0]["ready_s"],
           "ready": lines[0]["ready"], "wall_s": round(wall, 1), "loss": lines[-1]["loss"]}
    for key in ("h2d_bytes", "d2h_bytes", "overflow_bytes", "upload_wait_s", "cpu_adam_s", "forward_s", "backward_s",
                "dispatch_s", "launch_s", "compute_spread", "reduce_s", "reduce_wait_s"):
        if key in timed[-1]:
            row[key] = round(sum(r[key] for r in timed) / len(timed), 4)
    plan = out / "plan.json"
    if plan.is_file():
        planned = json.loads(plan.read_text())
        rr = planned.get("round_robin", {})
        ran = rr if rr.get("runs") else planned  # the schedule that ran: its prediction
        row["schedule"] = "round_robin" if rr.get("runs") else "swapped"
        row["predicted_step_s"] = ran["step_s"] if ran is rr else planned["predicted_step_s"]
        row["predicted_split"] = ran.get("time_split", {})  # beside forward_s, backward_s, upload_wait_s
        row["learnt_runs"] = planned.get("compute_scale", {}).get("runs", 0)  # earlier runs' compute it was planned with
        if row["learnt_runs"]:
            row["name"] += f" (planned with the compute of {row['learnt_runs']} earlier run(s))"
    traces = sorted(out.glob("trace-step*.json"))
    if traces:
        row["trace"] = str(traces[0])
    return row


def model_flops(args: argparse.Namespace, preset: str) -> float:
    """A step's model FLOPs: three times the forward (its backward twice), twice under LoRA (no weight
    gradients of the frozen base; the adapters' are negligible); recompute not counted."""
    from mobius.models import unit_specs

    mc = architecture(preset, args.layers)
    return (2 if args.lora_rank else 3) * args.micro_batches * sum(s.fwd_flops(1, args.seq) for s in unit_specs(mc))


def table(rows: list[dict]) -> str:
    lines = ["| model | system | ready (s) | where the start went | step (s) | tokens/s | TFLOP/s | peak GiB | "
             "vs all-in-GPU | predicted (s) | measured / predicted | forward, backward, dispatch, step's end: "
             "measured (predicted) s | launching the compute (s) | compute spread |", "|" + "---|" * 14]
    base = {r["preset"]: r["step_s"] for r in rows if r["name"].startswith("all-in-GPU") and "step_s" in r}
    for r in rows:
        if "step_s" not in r:
            lines.append(f"| {r['preset']} | {r['name']} | failed: {r['error']} |" + " |" * 11)
            continue
        split = ", ".join(f"{k} {v:.1f}" for k, v in r["ready"].items())
        pred = r.get("predicted_step_s")
        vs = f"{base[r['preset']] / r['step_s']:.2f}" if r["preset"] in base else ""
        lines.append(f"| {r['preset']} | {r['name']} | {r['ready_s']:.1f} | {split} | {r['step_s']:.3f} | "
                     f"{r['tokens_per_s']:,} | {r['tflops']:.0f} | {r['peak_gib']:.1f} | {vs} | "
                     + (f"{pred:.3f} | {r['step_s'] / pred:.2f} |" if pred else " | |") + f" {phases(r)} | "
                     + (f"{r['launch_s']:.3f} | {r['compute_spread']:.1%} |" if "launch_s" in r else " | |"))
    return "\n".join(lines)


def phases(row: dict) -> str:
    """The step's compute, dispatch and end per worker, measured beside the plan's split (pipeline runs; the end,
    ``reduce_s``, where the runtime measures it, beside the plan's tail)."""
    if "forward_s" not in row:
        return ""
    split = row.get("predicted_split", {})
    return ", ".join(f"{row[key]:.3f} ({split.get(phase, 0.0):.3f})" for phase, key in
                     (("forward", "forward_s"), ("backward", "backward_s"), ("dispatch", "dispatch_s"),
                      ("tail", "reduce_s")) if key in row)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", default="opt-2.7b,llama-3.2-3b")
    p.add_argument("--modes", default="single,pipeline")
    p.add_argument("--layers", type=int, default=0, help="blocks per model (0: the preset's)")
    p.add_argument("--steps", type=int, default=None, help="steps per run, the last traced (default 6; 4 with --smoke)")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--lora-rank", type=int, default=0, help="LoRA adapters of this rank on all linear layers (0: "
                                                             "full fine-tuning)")
    p.add_argument("--out", type=Path, default=Path(OUT) / "train")
    p.add_argument("--set", action="append", default=[], metavar="--SECTION.KEY=VALUE",
                   help="a config override for every run (e.g. --set=--parallel.cpu_threads=8); the runs' rows are "
                        "named with it")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="an environment variable of every run (e.g. --env=OMP_WAIT_POLICY=PASSIVE); the runs' rows are "
                        "named with it")
    p.add_argument("--smoke", action="store_true", help="tiny models on 2 CPU workers")
    args = p.parse_args()
    if bad := [kv for kv in args.env if "=" not in kv[1:]]:
        p.error(f"--env takes NAME=VALUE, got {bad[0]!r}")
    args.steps = args.steps or (4 if args.smoke else 6)
    if args.smoke:
        args.presets, args.seq, args.micro_batches = "gpt2-tiny,opt-125m", 64, 2
        args.layers = args.layers or 2
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for preset in args.presets.split(","):
        ck = args.out / "checkpoints" / preset
        written = write_checkpoint(preset, ck, args.layers)
        print(f"{preset}: checkpoint {'written in %.1f s' % written if written else 'found'} at {ck}", flush=True)
        for mode in args.modes.split(","):
            label = preset + (f" LoRA r{args.lora_rank}" if args.lora_rank else "")
            rows.append({"preset": label, **train(args, preset, ck, mode)})
            print(json.dumps(rows[-1]), flush=True)
            (args.out / "train_bench.json").write_text(json.dumps(
                {"args": {"preset": args.presets, "grad_clip": 1.0, "layers": args.layers, "lora_rank": args.lora_rank},
                 "rows": rows}, indent=1))
    print(table(rows))


if __name__ == "__main__":
    main()
