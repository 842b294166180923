"""Every GPU benchmark docs/perf-gpu.md reports, in parts that each fit one sitting of
a lent GPU (about 10 minutes), and one report of all their rows.

    python bench/gpu_suite.py --parts all --out runs/suite           # again until done: each call stops at --budget-s
    python bench/gpu_suite.py --report runs/suite                    # the tables, from every part's JSON
    python bench/gpu_suite.py --parts all --smoke --out /tmp/suite   # tiny models on the CPU: checks the suite

Parts, in the order a short GPU session should take them (``--parts all`` runs them in this order):

=========  ==================================================================================================
tests      the tests marked ``gpu`` (bench/gpu_tests.py: ``python -m pytest -m gpu``, its JUnit XML and counts); 26
           tests, all passing on one H100 on 2026-11-27 in 144 s
packing    attention over packed documents on the GPU (bench/packed_attention_bench.py): varlen flash attention,
           one SDPA call per document, a dense block-diagonal mask and compiled flex attention, forward and
           backward at 512-8192 tokens of about 400-token documents, Llama-3.1-8B's heads (32 / 8 of 128), bf16;
           which kernel ``mobius.models.packing.pick_kernel`` should pick on CUDA (varlen until measured; 1 min)
moe        one MoE layer's expert compute (bench/moe_experts_bench.py): mobius's grouped matmuls (tokens sorted by
           expert, ``torch._grouped_mm`` per projection) against its loop over experts and against transformers' experts
           modules (its loop and its grouped_mm), Qwen3-30B-A3B / GPT-OSS-20B / Mixtral-8x7B widths, 2048 and 8192
           tokens, routed evenly and skewed, bf16, forward and forward + backward; which kernel
           ``mobius.models.experts`` should pick on CUDA (grouped until measured; not yet run: about 3 min)
calls      what the host pays per CUDA call the pipeline's dispatch thread makes (bench/cuda_calls.py): timing
           events, reading them, reading a device scalar, a synchronize, a launch; on 2026-11-27 the end of an
           OPT-2.7B pipeline step took about 0.15 s after its last gradient was down (10 s)
delayed    OPT-2.7B all-in-GPU, then its pipeline and zero mode at 24 GiB in sync and with ``train.update: delayed``,
           6 steps each (the pipeline's last traced, left out of the step): on 2026-11-27 the pipeline's one
           untraced step after the first measured 1.297 s delayed and 1.905 s sync against 0.977 s all-in-GPU (0.886 s
           and 1.388 s planned); zero mode delayed, planned at 1.035 s (0.907 s before its compute copies
           were counted on the CPU thread), has not run on a GPU; ``reduce_s`` in each
           pipeline row says how much of the step its end takes (about 6 min)
train      ``mobius train`` as a user runs it (bench/train_bench.py): OPT-2.7B and Llama-3.2-3B from checkpoints written
           on the machine, all-in-GPU (single, uncapped) against the pipeline and zero mode at 24 GiB; ready time and
           its split, step, predicted beside measured, a trace of one pipeline step (5.6 min on one H100)
learnt     OPT-2.7B's pipeline at 24 GiB twice in a row (8 steps each, the last traced): the second run is planned with
           the compute and the CPU AdamW rate the first measured inside its steps (``partition/calibrate.py``; the rate
           after 7 steps); is its prediction within 10% (about 3 min)?
roundrobin OPT-2.7B on two workers sharing the GPU (24 GiB each) through ``mobius train``: the round-robin
           schedule sync and delayed beside the swapped pipeline on the same two workers, a trace of one step of
           each (``overflow_bytes``: messages that found their mailbox full); on 2026-11-27 its sync run measured
           3.22 s against 6.25 s planned, no overflow (about 6 min)
threads    OPT-2.7B's pipeline at 24 GiB, sync and delayed, each with its CPU AdamW's threads placed by the OS and
           pinned off the cores of the threads that launch the kernels (``parallel.cpu_pinning``), planned with one CPU
           AdamW rate (``partition.cpu_update_rate``: one plan per update rule): does the CPU AdamW starve the thread
           that launches the kernels, and does pinning stop it? On 2026-11-27 (one untraced step each, each with its
           own plan): 1.905 s with the default 14 threads, 1.607 s with 8, 2.423 s with 4 (about 8 min)
omp        OPT-2.7B's pipeline at 24 GiB, sync and delayed, each with OpenMP's threads spinning while they wait for
           work (its default) and sleeping (``OMP_WAIT_POLICY=PASSIVE``): do the CPU AdamW's 14 waiting threads take
           the cores of the thread that launches the kernels? On 2 CPU cores two processes side by side ran 8x
           slower with spinning threads (about 8 min)
states     ``train.optimizer_states``: the tests marked ``gpu`` run their GPU half (tests/test_optimizer_states_gpu.py);
           here the host's CPU update of the three rules beside torch's fused AdamW on the GPU box's cores
           (bench/cpu_update_bench.py, 128M parameters: is the update bound by the memory there, and int8 then
           faster than bf16?) and OPT-2.7B's pipeline at 24 GiB with bf16 and with int8 moments (its step, its host
           memory against fp32's 18 bytes per parameter); not run on a GPU yet (about 6 min)
train-lora the same for Llama-3.1-8B LoRA (rank 16, all linear layers), single and pipeline (2 min)
pipeline   1.42B, all-in-GPU and the pipeline as planned and all swapped, without and with clipping
zero       1.42B zero mode as planned and its rCache-min / rCache-max / all-offload alternatives; clipped
large      3.94B pipeline (planned, all swapped; both clip settings) and zero mode
opt        OPT-6.7B pipeline, as planned (the host-memory row)
llama      Llama-3.2-1B all-in-GPU vs the pipeline; Llama-3.1-8B's widths in 20 of its 32 blocks (5.4B: the 8B's
           states, 113-135 GiB, do not fit a 128 GB host; all-in-GPU needs 128 GB of GPU memory), through the pipeline;
           both at 8 micro-batches of 1 x 2048 tokens, clipped, as the shipped Llama configs
lora       Llama-3.1-8B LoRA (rank 16, all linear layers) on one GPU capped at 24 GiB: transformers + PEFT all in
           the GPU (plain and with gradient checkpointing) vs the pipeline (frozen weights swapped from host
           memory in bf16), beside mobius's uncapped all-in-GPU LoRA; 8 micro-batches of 1 x 2048, clipped
peers      FSDP2 CPU offload (its best setting, 1 x 16 with activation checkpointing) and DeepSpeed ZeRO-3
           offload, both clip settings
=========  ==================================================================================================

Each benchmark runs as its own process with a time limit; its JSON, its log and its exit status land
under ``<out>/<name>/``, and ``<out>/suite.json`` records what ran. ``--budget-s`` stops before a
benchmark whose limit would overrun it (the next call picks up there). ``--report`` prints, for every
row of every JSON under a folder, step time, tokens/s, TFLOP/s, peak GPU memory, host<->GPU bytes, the
ratio to all-in-GPU training of the same model and clip setting, and predicted beside measured.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLIPS = ["--grad-clip", "0,1.0"]
LLAMA = ["--seq", "2048", "--mbs", "1", "--micro-batches", "8", "--grad-clip", "1.0"]  # the shipped Llama configs'


def _pipe(*extra: str) -> list[str]:
    return ["bench/pipeline_bench.py", *extra]


def _zero(*extra: str) -> list[str]:
    return ["bench/zero_bench.py", *extra]


# part -> [(benchmark name, script and arguments, time limit in seconds)]
PARTS: dict[str, list[tuple[str, list[str], int]]] = {
    "tests": [("gpu-tests", ["bench/gpu_tests.py"], 300)],
    "packing": [("packed-attention", ["bench/packed_attention_bench.py"], 120)],
    "moe": [("moe-experts", ["bench/moe_experts_bench.py"], 300)],
    "calls": [("cuda-calls", ["bench/cuda_calls.py"], 60)],
    "delayed": [("opt-2.7b-sync", ["bench/train_bench.py", "--presets", "opt-2.7b", "--modes", "single,pipeline,zero"],
                 300),
                ("opt-2.7b-delayed", ["bench/train_bench.py", "--presets", "opt-2.7b", "--modes", "pipeline,zero",
                                      "--set=--train.update=delayed"], 240)],
    "train": [("train-opt-2.7b-llama-3.2-3b", ["bench/train_bench.py", "--presets", "opt-2.7b,llama-3.2-3b", "--modes",
                                                "single,pipeline,zero"], 480)],
    "learnt": [("learnt-opt-2.7b", ["bench/train_bench.py", "--presets", "opt-2.7b", "--modes", "pipeline,pipeline",
                                    "--steps", "8"], 330)],
    "roundrobin": [(f"roundrobin-opt-2.7b-{name}", ["bench/train_bench.py", "--presets", "opt-2.7b", "--modes",
                                                  "pipeline", "--set=--parallel.devices=2", *extra], 180)
                   for name, extra in (("round-robin", ["--set=--parallel.schedule=round_robin"]),
                                       ("round-robin-delayed", ["--set=--parallel.schedule=round_robin",
                                                                "--set=--train.update=delayed"]),
                                       ("swapped", []))],
    "threads": [(f"threads-{name}", ["bench/train_bench.py", "--presets", "opt-2.7b", "--modes", "pipeline",
                                     "--set=--partition.cpu_update_rate=4.0",  # one plan per update rule
                                     *[f"--set=--{kv}" for kv in extra]], 150)
                for name, extra in (("auto", []), ("pinned", ["parallel.cpu_pinning=true"]),
                                    ("delayed", ["train.update=delayed"]),
                                    ("delayed-pinned", ["train.update=delayed", "parallel.cpu_pinning=true"]))],
    "omp": [(f"omp-{name}", ["bench/train_bench.py", "--presets", "opt-2.7b", "--modes", "pipeline",
                             "--set=--partition.cpu_update_rate=4.0", *extra], 150)  # one plan per update rule
            for name, extra in (("spin", []), ("passive", ["--env=OMP_WAIT_POLICY=PASSIVE"]),
                                ("delayed-spin", ["--set=--train.update=delayed"]),
                                ("delayed-passive", ["--set=--train.update=delayed",
                                                     "--env=OMP_WAIT_POLICY=PASSIVE"]))],
    "states": [("states-cpu-update", ["bench/cpu_update_bench.py", "--numel", str(1 << 27), "--reps", "7"], 150),
               *[(f"states-opt-2.7b-{rule}", ["bench/train_bench.py", "--presets", "opt-2.7b", "--modes", "pipeline",
                                              f"--set=--train.optimizer_states={rule}"], 150)
                 for rule in ("bf16", "int8")]],
    "train-lora": [("train-lora-llama-3.1-8b", ["bench/train_bench.py", "--presets", "llama-3.1-8b", "--lora-rank",
                                                "16"], 480)],
    "pipeline": [("pipeline-1.4b", _pipe("--what", "ref,mobius", "--variants", "plain", *CLIPS, "--steps", "5"), 480)],
    "zero": [("zero-1.4b", _zero("--what", "zero", "--variants", "rcache-min,rcache-max,all-offload", "--steps", "4"),
              360),
             ("zero-1.4b-clip", _zero("--what", "zero", "--grad-clip", "1.0", "--steps", "4"), 180)],
    "large": [("pipeline-3.9b", _pipe("--what", "mobius", "--preset", "gpt-3.9b", "--variants", "plain", *CLIPS,
                                      "--steps", "3", "--warmup", "1"), 420),
              ("zero-3.9b", _zero("--what", "zero", "--preset", "gpt-3.9b", "--steps", "3", "--warmup", "1"), 240)],
    "opt": [("pipeline-opt-6.7b", _pipe("--what", "mobius", "--preset", "opt-6.7b", "--grad-clip", "1.0",
                                        "--steps", "2", "--warmup", "1"), 540)],
    "llama": [("pipeline-llama-3.2-1b", _pipe("--what", "ref,mobius", *LLAMA, "--preset", "llama-3.2-1b", "--steps", "3"),
               420),
              ("pipeline-llama-3.1-8b", _pipe("--what", "mobius", *LLAMA, "--preset", "llama-3.1-8b", "--layers", "20",
                                              "--steps", "2", "--warmup", "1"), 560)],
    "lora": [("lora-llama-3.1-8b", _pipe("--what", "ref,peft,peft:gc,mobius", *LLAMA, "--preset", "llama-3.1-8b",
                                         "--lora-rank", "16", "--steps", "3", "--warmup", "1"), 540)],
    "peers": [("fsdp2", ["bench/peers.py", "--what", "fsdp2", "--fsdp-settings", "1x16:ac", *CLIPS, "--steps", "3"],
               300),
              ("deepspeed", ["bench/peers.py", "--what", "deepspeed", *CLIPS, "--steps", "3"], 300)],
}


def run_parts(parts: list[str], out: Path, budget_s: float, smoke: bool) -> list[dict]:
    """Run the parts' benchmarks in order, skipping those already done; returns this call's records."""
    out.mkdir(parents=True, exist_ok=True)
    log = out / "suite.json"
    done = json.loads(log.read_text()) if log.exists() else []
    finished = {r["name"] for r in done if r["rc"] == 0}
    t0, records = time.monotonic(), []
    for part in parts:
        for name, argv, limit in PARTS[part]:
            if name in finished:
                continue
            if time.monotonic() - t0 + limit > budget_s:
                print(f"suite: stopping before {name} (its {limit} s limit would pass the {budget_s:.0f} s budget)")
                return records
            records.append(_run_one(name, argv + (["--smoke"] if smoke else []), limit, out / name))
            done = [r for r in done if r["name"] != name] + [records[-1]]
            log.write_text(json.dumps(done, indent=2))
    return records


def _run_one(name: str, argv: list[str], limit: int, where: Path) -> dict:
    where.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, *argv, "--out", str(where)]
    print(f"suite: {name}: {' '.join(argv)}", flush=True)
    t0 = time.monotonic()
    with open(where / "log.txt", "w") as f:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=limit,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"}).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    wall = time.monotonic() - t0
    print(f"suite: {name}: exit {rc} after {wall:.0f} s", flush=True)
    return {"name": name, "argv": argv, "rc": rc, "wall_s": round(wall, 1)}


# ---- the report -------------------------------------------------------------------------------------
def collect(folder: Path) -> list[dict]:
    """Every row of every benchmark JSON under ``folder``, with its model and clip setting."""
    rows = []
    for path in sorted(folder.rglob("*.json")):
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or "rows" not in data:
            continue
        preset = data.get("args", {}).get("preset", "?")
        if data.get("args", {}).get("layers"):
            preset += f" ({data['args']['layers']} blocks)"
        if data.get("args", {}).get("lora_rank"):
            preset += f" LoRA r{data['args']['lora_rank']}"
        for r in data["rows"]:
            clip = float(r.get("grad_clip", data["args"].get("grad_clip", 0)))
            rows.append({**r, "preset": r.get("preset", preset), "clip": clip})
    return rows


def report(rows: list[dict]) -> str:
    """One markdown table: the rows by model and clip setting, all-in-GPU first."""
    ref = {(r["preset"], r["clip"]): r["step_s"] for r in rows if r["name"].startswith("all-in-GPU") and "step_s" in r}
    lines = ["| model | system | clip | step (s) | tokens/s | TFLOP/s | peak GiB | h2d / d2h GB | host GiB planned / "
             "measured | vs all-in-GPU | predicted (s) | measured / predicted |", "|" + "---|" * 12]
    for r in sorted(rows, key=lambda r: (r["preset"], r["clip"], not r["name"].startswith("all-in-GPU"))):
        base = ref.get((r["preset"], r["clip"]))
        if "step_s" not in r:  # a run that failed (e.g. a plan that does not fit): its reason
            lines.append(f"| {r['preset']} | {r['name']} | {r['clip']:g} | {r.get('error', 'failed')} |" + " |" * 8)
            continue
        t, pred = r["step_s"], r.get("predicted_step_s")
        traffic = f"{r['h2d_bytes'] / 1e9:.1f} / {r['d2h_bytes'] / 1e9:.1f}" if "h2d_bytes" in r else ""
        host = f"{r['host_gib']} / {r.get('host_rss_gib', '?')}" if "host_gib" in r else ""
        vs = f"{base / t:.2f}" if base else ""
        predicted = f"{pred:.3f} | {t / pred:.2f}" if pred else " | "
        lines.append(f"| {r['preset']} | {r['name']} | {r['clip']:g} | {t:.3f} | {r['tokens_per_s']:,} | "
                     f"{r['tflops']:.0f} | {r['peak_gib']:.1f} | {traffic} | {host} | {vs} | {predicted} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="", help="comma list of " + ", ".join(PARTS) + ", or all")
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    p.add_argument("--budget-s", type=float, default=570.0, help="start no benchmark that could end after this")
    p.add_argument("--smoke", action="store_true", help="each benchmark's --smoke (tiny models, CPU)")
    p.add_argument("--report", default="", help="a folder of benchmark JSON to tabulate (no runs)")
    args = p.parse_args()
    if args.parts:
        parts = list(PARTS) if args.parts == "all" else args.parts.split(",")
        unknown = [x for x in parts if x not in PARTS]
        if unknown:
            p.error(f"unknown part(s) {', '.join(unknown)}; choose from {', '.join(PARTS)}")
        run_parts(parts, Path(args.out), args.budget_s, args.smoke)
    folder = Path(args.report or args.out)
    if folder.exists():
        print(report(collect(folder)))


if __name__ == "__main__":
    main()
