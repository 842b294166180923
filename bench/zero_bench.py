"""GPU benchmark of zero mode (chunked ZeRO with rCache) against all-in-GPU training, on the pipeline
benchmark's workload: a GPT-style 1.42B model (hidden 2048, 24 layers, 16 heads, sequence 1024),
4 micro-batches of 4, bf16, activation checkpointing; and the 3.94B model (``--preset gpt-3.9b``:
hidden 3072, 32 layers) under the same cap.

    python bench/zero_bench.py --what ref,zero --cap-gib 24 --steps 5 --out bench_out
    python bench/zero_bench.py --what zero --variants rcache-min,rcache-max,all-offload,no-prefetch --cap-gib 24
    python bench/zero_bench.py --what zero --preset gpt-3.9b --cap-gib 24 --steps 3 --warmup 1

``ref``: mobius's reference engine, whole model and AdamW states on the GPU (uncapped).
``zero``: the zero engine on one GPU capped at ``--cap-gib`` (``--devices N``: N ranks, one GPU each),
planned by the search engine (``mobius plan``'s zero plan) unless ``--chunk-size`` / ``--cache-blocks``
/ ``--gpu-chunks`` force it; ``--variants`` runs the plan's alternatives too. Prints a table and
writes ``<out>/zero_bench.json``: step time, tokens/s, TFLOPs (6 N tokens / t), peak GPU memory, bytes
host->GPU / GPU->host / all-gathered / reduce-scattered per step (the engine's counters), CPU AdamW
seconds, and the search engine's predicted step time beside the measured one. ``--peers`` adds
measured step times of other systems (``name=seconds,...``) for the speed-up columns. ``--smoke``
runs a tiny model on CPU worker processes to check the script itself.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (add_workload_args, parse_workload, reset_peak, result_row, step_tokens,  # noqa: E402
                    time_steps, workload_config, write_json)
from mobius.config import Config  # noqa: E402
from mobius.models import get_preset, param_count  # noqa: E402
from pipeline_bench import run_ref  # noqa: E402

ZERO_KEYS = ("allgather_bytes", "reduce_scatter_bytes", "replaced_bytes", "gathers")


def make_cfg(args: argparse.Namespace, variant: dict) -> Config:
    """The workload in zero mode: the search's choices unless ``--chunk-size`` etc. or ``variant`` force them."""
    return workload_config(args, "zero", "zero_bench", model={"activation_checkpointing": not args.no_ac},
                           parallel={"devices": args.devices, "prefetch": variant.get("prefetch", True)},
                           zero={"chunk_size": variant.get("chunk_size", args.chunk_size),
                                 "cache_blocks": variant.get("cache_blocks", args.cache_blocks),
                                 "gpu_chunks": variant.get("gpu_chunks", args.gpu_chunks)})


def _zero_worker(rank: int, world: int, port: int, args: argparse.Namespace, variant: dict, out) -> None:
    import torch.distributed as dist

    from mobius.app.launch import open_device
    from mobius.app.planning import plan_zero
    from mobius.app.settings import Machine, resolve
    from scheduler.zero import ZeroEngine

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg, mc = make_cfg(args, variant), get_preset(args.preset)
    t_plan = time.perf_counter()
    machine = Machine.detect(cfg)
    settings = resolve(cfg, machine)
    plan, _, _ = plan_zero(cfg, mc, settings, machine)
    plan_s = time.perf_counter() - t_plan
    device = open_device(settings, rank)
    reset_peak()
    engine = ZeroEngine(cfg, mc, plan, settings, device, None)
    t, stats = time_steps(engine, args, mc.vocab_size)  # (the first warm-up step records the chunk trace)
    engine.close()
    if rank == 0:
        name = f"mobius zero, {args.cap_gib:g} GiB cap, {world} GPU(s)" + (f" [{variant['name']}]" if variant else "")
        row = result_row(name, t, param_count(mc), step_tokens(args), stats,
                         predicted_step_s=round(plan.predicted_step_s, 4), chunk_size=plan.chunk_size,
                         cache_blocks=plan.cache_blocks, gpu_chunks=plan.gpu_chunks, num_chunks=plan.num_chunks,
                         predicted_peak_gib=round(plan.peak_bytes / 2**30, 2), plan_s=round(plan_s, 2))
        row.update({k: round(sum(s.extra[k] for s in stats) / len(stats)) for k in ZERO_KEYS})
        row["alternatives"] = plan.alternatives
        out.put(row)
    dist.destroy_process_group()


def run_zero(args: argparse.Namespace, variant: dict | None = None) -> dict:
    """One zero run in ``--devices`` fresh processes (one per rank); rank 0's row."""
    import torch.multiprocessing as mp

    from mobius.app.launch import free_port

    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    procs = mp.start_processes(_zero_worker, args=(args.devices, free_port(), args, variant or {}, out),
                               nprocs=args.devices, join=False, start_method="spawn")
    while not procs.join(timeout=1.0):
        pass
    return out.get()


def variant_settings(name: str, planned: dict) -> dict:
    """A plan's alternative (or the plan without prefetch) as forced zero.* values."""
    if name == "no-prefetch":
        return {"name": name, "prefetch": False}
    alt = planned["alternatives"].get(name)
    if alt is None:
        raise SystemExit(f"variant {name}: the plan says it does not fit")
    return {"name": name, "chunk_size": planned["chunk_size"], "cache_blocks": alt["cache_blocks"],
            "gpu_chunks": alt["gpu_chunks"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--what", default="ref,zero")
    add_workload_args(p, steps_default=5)
    p.add_argument("--grad-clip", type=float, default=0.0, help="0 as in the peers' runs (no clipping)")
    p.add_argument("--no-ac", action="store_true", help="without activation checkpointing")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--chunk-size", type=int, default=0, help="0: the search decides")
    p.add_argument("--cache-blocks", type=int, default=0, help="0: the search decides")
    p.add_argument("--gpu-chunks", type=int, default=-1, help="-1: the search decides")
    p.add_argument("--variants", default="", help="rcache-min, rcache-max, all-offload (the plan's alternatives), "
                                                  "no-prefetch")
    p.add_argument("--peers", default="", help="measured peers as name=seconds,... (speed-up columns)")
    args = parse_workload(p)
    rows = []
    for what in args.what.split(","):
        rows.append(run_ref(args) if what == "ref" else run_zero(args))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "alternatives"}), flush=True)
    planned = next((r for r in rows if "alternatives" in r), None)
    for name in filter(None, args.variants.split(",")):
        if planned is None:
            planned = run_zero(args)
        rows.append(run_zero(args, variant_settings(name, planned)))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "alternatives"}), flush=True)
    report(rows, args)


def report(rows: list[dict], args: argparse.Namespace) -> None:
    peers = {n: float(s) for n, s in (kv.split("=") for kv in filter(None, args.peers.split(",")))}
    ref = next((r for r in rows if r["name"].startswith("all-in-GPU")), None)
    head = f"{'system':52s} {'step s':>7s} {'pred s':>7s} {'tok/s':>8s} {'TFLOPs':>7s} {'peak GiB':>9s} " \
           f"{'h2d GB':>7s} {'d2h GB':>7s}"
    print("\n" + head + "".join(f" {'vs ' + n:>14s}" for n in (["all-in-GPU"] if ref else []) + list(peers)))
    for r in rows:
        pred = f"{r['predicted_step_s']:7.3f}" if "predicted_step_s" in r else f"{'-':>7s}"
        line = (f"{r['name']:52s} {r['step_s']:7.3f} {pred} {r['tokens_per_s']:8d} {r['tflops']:7.1f} "
                f"{r['peak_gib']:9.2f} {r.get('h2d_bytes', 0) / 1e9:7.2f} {r.get('d2h_bytes', 0) / 1e9:7.2f}")
        if ref:
            line += f" {ref['step_s'] / r['step_s']:13.2f}x"
        line += "".join(f" {s / r['step_s']:13.2f}x" for s in peers.values())
        print(line)
    out = Path(args.out) / "zero_bench.json"
    write_json(out, args, rows, peers_s=peers)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
