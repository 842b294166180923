"""What the bench scripts share: the benchmark workload's options, config, batches and architecture, the
steady-state timing of an engine, the throughput arithmetic, peak GPU memory, and the JSON a GPU bench
writes."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import time
from pathlib import Path

import torch

from mobius.app.launch import expandable_segments
from mobius.batch import MicroBatch
from mobius.config import Config, config_from_dict
from mobius.models import ModelConfig, get_preset

OUT = os.environ.get("OUT", "bench_out")  # where a bench writes unless --out says otherwise
LR = 1e-5  # every system's learning rate (the benches time steps; they do not train to a loss)


# ---- the workload ------------------------------------------------------------------------------------
def add_workload_args(p: argparse.ArgumentParser, steps_default: int = 5) -> None:
    """The workload's options every GPU bench takes: model, batches, precision, GPU cap, steps, output."""
    p.add_argument("--preset", default="gpt-1.4b")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--mbs", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--precision", default="bf16")
    p.add_argument("--cap-gib", type=float, default=24.0)
    p.add_argument("--steps", type=int, default=steps_default)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default=OUT)
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU (checks the script)")


def add_sweep_args(p: argparse.ArgumentParser, clip_default: str) -> None:
    """What pipeline_bench and its peers (bench/peers.py) also vary: blocks, LoRA, a list of clip settings."""
    p.add_argument("--layers", type=int, default=0, help="blocks instead of the preset's (0: the preset's)")
    p.add_argument("--grad-clip", default=clip_default, help="clip setting(s), a comma list (0,1.0): each system "
                   "runs at each; 0: no clipping")
    p.add_argument("--lora-rank", type=int, default=0, help="LoRA rank on every linear layer (0: full fine-tuning)")


def parse_workload(p: argparse.ArgumentParser) -> argparse.Namespace:
    """The command line, with what every GPU bench does next: the allocator mobius's workers use (every
    system in the table runs with it), the tiny workload under ``--smoke``, ``--out`` made."""
    args = p.parse_args()
    expandable_segments()
    if args.smoke:
        smoke_workload(args)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    return args


def clip_list(args: argparse.Namespace) -> list[float]:
    """``--grad-clip``'s settings."""
    return [float(c) for c in str(args.grad_clip).split(",") if c.strip()]


def smoke_workload(args: argparse.Namespace) -> None:
    """``--smoke``: a tiny fp32 model of the workload's family and two short steps on the CPU."""
    tiny = "llama-tiny" if get_preset(args.preset).family in ("llama", "mistral", "qwen2", "qwen3") else "gpt2-tiny"
    vars(args).update(preset=tiny, seq=32, mbs=2, micro_batches=2, steps=2, warmup=1, precision="fp32")
    if "layers" in vars(args):
        args.layers = 0  # the tiny model's own blocks


def workload_config(args: argparse.Namespace, mode: str, source: str, **sections: dict) -> Config:
    """The workload as a config in parallel ``mode`` (on the CPU under ``--smoke``, written under
    ``<out>/<mode>``); ``sections`` add keys to the config's sections."""
    raw = {"model": {"preset": args.preset, "dropout": 0.0},
           "data": {"seq_len": args.seq},
           "train": {"micro_batch_size": args.mbs, "micro_batches": args.micro_batches, "precision": args.precision,
                     "lr": LR, "warmup_steps": 0, "grad_clip": args.grad_clip, "max_steps": 1000},
           "parallel": {"mode": mode, "device": "cpu" if args.smoke else "cuda"},
           "partition": {"gpu_memory_gib": args.cap_gib},
           "output": {"dir": str(Path(args.out) / mode), "plot": False}}
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return config_from_dict(raw, source)


def architecture(preset: str, layers: int = 0) -> ModelConfig:
    """The preset's architecture, with ``layers`` blocks when given (0: the preset's): the same widths and
    per-block costs in fewer blocks, for a host whose memory cannot take the whole model's states."""
    mc = get_preset(preset)
    return dataclasses.replace(mc, **{mc.FIELDS["layers"]: layers}) if layers else mc


def batches(args: argparse.Namespace, vocab: int, step: int) -> list[MicroBatch]:
    """Step ``step``'s ``--micro-batches`` of ``--mbs`` x ``--seq`` random tokens, every one a target (seeded by
    the step: every system trains on the same)."""
    g = torch.Generator().manual_seed(step)
    out = []
    for _ in range(args.micro_batches):
        t = torch.randint(0, vocab, (args.mbs, args.seq + 1), generator=g)
        out.append(MicroBatch(t[:, :-1], t[:, 1:]))
    return out


def step_tokens(args: argparse.Namespace) -> int:
    """Tokens a step trains on."""
    return args.micro_batches * args.mbs * args.seq


# ---- timing and memory -------------------------------------------------------------------------------
def cuda_sync() -> None:
    """Wait for the GPU's queued kernels (nothing without one)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_steps(engine, args: argparse.Namespace, vocab: int) -> tuple[float, list]:
    """Steady-state seconds per step and the timed steps' stats: ``--steps`` back to back after
    ``--warmup`` (CPU updates overlap the next step, as in training), all work finished at both ends."""
    stats = []
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            engine.sync()
            cuda_sync()
            t0 = time.perf_counter()
        st = engine.train_step(step, batches(args, vocab, step), LR)
        if step >= args.warmup:
            stats.append(st)
    engine.sync()
    cuda_sync()
    return (time.perf_counter() - t0) / args.steps, stats


def cap_gpu(args: argparse.Namespace) -> None:
    """Cap this process's GPU memory at ``--cap-gib`` (a smaller card); nothing on the CPU."""
    if torch.cuda.is_available() and not args.smoke:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * 2**30 / total), 0)


def reset_peak() -> None:
    """Start peak GPU memory afresh (nothing without a GPU)."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def peak_gib() -> float:
    """Peak GPU memory allocated since :func:`reset_peak`, GiB (0 without a GPU)."""
    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else 0.0


def free_gpu() -> None:
    """Hand what a finished run held back to the GPU, before the next run."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- rows and output ---------------------------------------------------------------------------------
def rates(tokens: int, flops: float, seconds: float) -> dict:
    """A step's throughput: tokens/s and model TFLOP/s (``flops``: the step's model FLOPs)."""
    return {"tokens_per_s": round(tokens / seconds), "tflops": round(flops / seconds / 1e12, 1)}


def result_row(name: str, t: float, n_params: int, tokens: int, stats: list, flops_per_param: float = 6,
               **extra) -> dict:
    """An engine's row: step seconds ``t``, throughput (``flops_per_param`` x N per token), peak GPU memory,
    the last loss, the runtime's counters averaged over the timed steps, and ``extra``."""
    row = {"name": name, "step_s": round(t, 4), **rates(tokens, flops_per_param * n_params * tokens, t),
           "peak_gib": peak_gib(), "loss": round(stats[-1].loss, 4)}
    if stats and stats[-1].extra:
        keys = ("h2d_bytes", "d2h_bytes", "p2p_bytes", "traffic_x_params", "stall_s", "upload_wait_s", "cpu_adam_s")
        row.update({k: round(sum(s.extra[k] for s in stats) / len(stats), 4) for k in keys if k in stats[-1].extra})
    row.update(extra)
    return row


def write_json(path: Path, args: argparse.Namespace, rows: list[dict], **extra) -> None:
    """A GPU bench's JSON: its arguments, the device, the rows and ``extra``."""
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    path.write_text(json.dumps({"args": vars(args), "device": device, "rows": rows, **extra}, indent=2))
