"""GPU benchmark of the swapped pipeline against all-in-GPU training (and, through the shared peer
scripts, FSDP2 and DeepSpeed offload), on the benchmark workload: a GPT-style 1.42B model (hidden
2048, 24 layers, 16 heads, sequence 1024), 4 micro-batches of 4, bf16.

    python bench/pipeline_bench.py --what ref,mobius --cap-gib 24 --steps 5 --out bench_out
    python bench/pipeline_bench.py --what ref,mobius --grad-clip 0,1.0 --cap-gib 24 --steps 5 --out bench_out

``ref``: mobius's reference engine, whole model and AdamW states on the GPU (uncapped).
``mobius``: the pipeline engine on one GPU capped at ``--cap-gib`` (a 24 GB consumer card), one
worker, stages planned by partition/ (or ``--stages N`` split evenly), CPU AdamW.
Prints a table and writes ``<out>/pipeline_bench.json``: step time, tokens/s, TFLOPs (6 N tokens / t),
peak GPU memory, bytes host->GPU / GPU->host per step (the runtime's counters), upload stalls, and
the planner's predicted step time beside the measured one, and the plan's choices (resident and kept
stages, gradient download dtype, device slots), and host memory: the plan's figure (``host_gib``)
beside what the engine's process grew by (``host_rss_gib``, page-locked buffers included). ``--grad-clip`` takes a comma list (``0,1.0``): every
system runs at each clip setting, and "vs all-in-GPU" compares with the reference row of the same
setting. ``--smoke`` runs a tiny model on the CPU to check the script itself.

``--lora-rank R`` trains rank-R adapters on every linear layer of the blocks (alpha 2R) with the base
weights frozen, in every system; ``peft`` (in ``--what``) is the peer for it: Hugging Face transformers
+ PEFT with the whole model on the GPU in bf16 (fp32 adapters, PEFT's default), capped at
``--cap-gib``, plain and with gradient checkpointing (``peft:gc``). TFLOPs count 4 N per token for a
LoRA run (no weight gradients for the frozen base) and 6 N otherwise.

    python bench/pipeline_bench.py --what ref,peft,peft:gc,mobius --preset llama-3.1-8b --lora-rank 16 \
        --seq 2048 --mbs 1 --micro-batches 8 --grad-clip 1.0 --cap-gib 24 --steps 3 --warmup 1
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import (LR, add_sweep_args, add_workload_args, architecture, cap_gpu, clip_list,  # noqa: E402
                    free_gpu, parse_workload, peak_gib, reset_peak, result_row, step_tokens, time_steps,
                    workload_config, write_json)
from mobius.assemble import with_adapters  # noqa: E402
from mobius.config import Config  # noqa: E402
from mobius.engine import DTYPES  # noqa: E402
from mobius.errors import MobiusError  # noqa: E402
from mobius.models import ModelConfig, build_model, param_count  # noqa: E402

if TYPE_CHECKING:
    from partition import SwappedPlan
    from scheduler.pipeline_engine import PipelineEngine


def make_cfg(args: argparse.Namespace, mode: str) -> Config:
    """The workload's config in ``mode`` (``single`` or ``pipeline``, with the stage options), with the run's
    LoRA adapters (none for zero_bench's reference row: its arguments have no ``--lora-rank``)."""
    parallel = {"stages": args.stages, "prefetch": not args.no_prefetch, "resident_stages": stage_list(args.resident),
                "kept_stages": stage_list(args.kept)} if mode == "pipeline" else {}
    rank = getattr(args, "lora_rank", 0)
    return workload_config(args, mode, "pipeline_bench", parallel=parallel, partition={"time_limit_s": 20},
                           lora={"rank": rank, "alpha": 2.0 * max(rank, 1), "targets": ["all-linear"]})


def bench_model(args: argparse.Namespace, cfg: Config | None = None) -> ModelConfig:
    """The workload's architecture (``--layers`` blocks when given), with the run's LoRA adapters when
    ``cfg`` has them."""
    mc = architecture(args.preset, getattr(args, "layers", 0))
    return with_adapters(mc, cfg) if cfg is not None else mc


def flops_per_token(args: argparse.Namespace, n_params: int) -> float:
    """Model FLOPs per token: 6 N (forward, input and weight gradients), 4 N under LoRA (the frozen
    base computes no weight gradients; the adapters' are negligible)."""
    return (4 if getattr(args, "lora_rank", 0) else 6) * n_params


def stage_list(text: str) -> list[int] | None:
    """``auto`` (the planner chooses), ``none`` (no stage) or a comma list of stage indices."""
    if text == "auto":
        return None
    return [] if text == "none" else [int(v) for v in text.split(",")]


def clip_tag(args: argparse.Namespace) -> str:
    return f" [clip {args.grad_clip:g}]"


def rss_gib() -> float:
    """This process's resident host memory (page-locked buffers included), from /proc (0 elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 2**20
    except (OSError, StopIteration):
        return 0.0


def timed_row(name: str, args: argparse.Namespace, mc: ModelConfig, build: Callable[[], object]) -> dict:
    """The row of the engine that ``build()`` makes, timed; a row that says so when the run does not fit
    in GPU memory."""
    reset_peak()
    try:
        t, stats = time_steps(build(), args, mc.vocab_size)  # the engine goes with time_steps' frame
    except torch.OutOfMemoryError:
        row = {"name": name, "step_s": None, "error": "out of GPU memory", "grad_clip": args.grad_clip,
               "peak_gib": peak_gib()}
    else:
        row = result_row(name, t, param_count(mc), step_tokens(args), stats, flops_per_token(args, 1),
                         grad_clip=args.grad_clip)
    free_gpu()
    return row


def run_ref(args: argparse.Namespace) -> dict:
    """Mobius's reference engine, the whole model and its AdamW states on the GPU, uncapped."""
    from scheduler.single_engine import SingleEngine

    cfg = make_cfg(args, "single")
    mc = bench_model(args, cfg)
    device = torch.device("cpu" if args.smoke else "cuda")
    if torch.cuda.is_available():
        torch.cuda.set_per_process_memory_fraction(1.0)  # a pipeline run before this one capped the process
    return timed_row("all-in-GPU (mobius reference engine)" + clip_tag(args), args, mc,
                     lambda: SingleEngine(build_model(mc, 0), cfg, device))


class PeftSteps:
    """A transformers + PEFT model's training step, as the engines' ``train_step``: micro-batches
    accumulated, the gradients clipped by mobius's rule, AdamW."""

    def __init__(self, model, opt: torch.optim.Optimizer, device: torch.device, grad_clip: float):
        self.model, self.opt, self.device, self.grad_clip = model, opt, device, grad_clip
        self.trainable = [p for p in model.parameters() if p.requires_grad]

    def train_step(self, step: int, micro: list, lr: float):
        from mobius.engine import StepStats
        from mobius.optim import clip_coefficient
        from scheduler.single_engine import sum_of_squares

        total = 0.0
        for b in micro:
            logits = self.model(input_ids=b.inputs.to(self.device)).logits  # [B, T, V]
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), b.targets.to(self.device).flatten())
            (loss / len(micro)).backward()
            total += float(loss.detach())
        grads = [p.grad for p in self.trainable if p.grad is not None]
        norm = math.sqrt(sum_of_squares(grads))
        coef = clip_coefficient(norm, self.grad_clip)
        if coef < 1.0:
            torch._foreach_mul_(grads, coef)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return StepStats(total / len(micro), norm, False, 1.0)

    def sync(self) -> None:
        """Nothing runs beside the step (:func:`common.time_steps` waits for the GPU's kernels)."""


def run_peft(args: argparse.Namespace, checkpointing: bool) -> dict:
    """The LoRA peer: transformers + PEFT, the whole model on the device in the training dtype (fp32
    adapters), AdamW on the adapters, micro-batches accumulated, clipped as the others; capped at
    ``--cap-gib`` as a 24 GB card would be."""
    import peft
    from transformers import AutoModelForCausalLM

    from transformers import AutoConfig

    from mobius.models.hf import config_to_hf

    if not args.lora_rank:
        raise SystemExit("--what peft needs --lora-rank")
    cfg = make_cfg(args, "single")
    mc = bench_model(args)
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = DTYPES[args.precision]
    cap_gpu(args)

    def build() -> PeftSteps:
        with device:
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config_to_hf(mc, dtype)), dtype=dtype)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model = peft.get_peft_model(model, peft.LoraConfig(r=args.lora_rank, lora_alpha=2.0 * args.lora_rank,
                                                           target_modules="all-linear", lora_dropout=0.0))
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR,
                                weight_decay=cfg.train.weight_decay, fused=device.type == "cuda")
        return PeftSteps(model, opt, device, args.grad_clip)

    name = f"PEFT all-in-GPU, {args.cap_gib:g} GiB cap{', grad. ckpt' if checkpointing else ''}" + clip_tag(args)
    return timed_row(name, args, mc, build)


def run_mobius(args: argparse.Namespace, variant: str = "") -> dict:
    import torch.distributed as dist

    from mobius.app.launch import free_port, open_device
    from mobius.app.planning import plan_pipeline
    from mobius.app.settings import Machine, resolve
    from scheduler.pipeline_engine import PipelineEngine

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    cfg = make_cfg(args, "pipeline")
    mc = bench_model(args, cfg)
    t_plan = time.perf_counter()
    machine = Machine.detect(cfg)
    settings = resolve(cfg, machine)
    name = f"mobius pipeline, {args.cap_gib:g} GiB cap" + clip_tag(args) + (f" [{variant}]" if variant else "")
    try:
        plan = plan_pipeline(cfg, mc, settings, machine)[0].swapped
    except MobiusError as exc:  # no plan fits (GPU or host memory): a row with the planner's reason
        dist.destroy_process_group()
        return {"name": name, "step_s": None, "error": f"no plan: {exc}", "grad_clip": args.grad_clip}
    plan_s = time.perf_counter() - t_plan
    device = open_device(settings, 0)
    reset_peak()
    opts = plan.options
    print(f"{name}: plan stages {plan.num_stages} resident {sorted(opts.resident)} kept {sorted(opts.kept)} grads "
          f"{opts.grad_dtype} slots {opts.num_slots} predicted {plan.predicted_step_s:.3f} s, peak "
          f"{[round(b / 2**30, 2) for b in plan.peak_bytes]} GiB, profile {plan.profile_source}", flush=True)
    engine, rss0 = None, rss_gib()
    try:
        engine = PipelineEngine(cfg, mc, plan, settings, device, None, skip_updates=variant == "no-update")
        t, stats = time_steps(engine, args, mc.vocab_size)
    except Exception as exc:  # noqa: BLE001 - a failed plan is a row (with the plan's choices)
        import traceback
        traceback.print_exc()
        oom = isinstance(exc, torch.OutOfMemoryError)
        row = {"name": name, "step_s": None, "error": "out of GPU memory" if oom else f"{type(exc).__name__}: {exc}"[:500],
               "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else 0.0,
               "grad_clip": args.grad_clip, **plan_fields(plan), "host_rss_gib": round(rss_gib() - rss0, 1)}
        _end(engine)
        return row
    tokens = args.mbs * args.micro_batches * args.seq
    row = result_row(name, t, param_count(mc), tokens, stats, flops_per_token(args, 1), grad_clip=args.grad_clip,
                     plan_s=round(plan_s, 2), **plan_fields(plan), host_rss_gib=round(rss_gib() - rss0, 1),
                     model_step_s=round(plan.model_step_s, 4), predicted_h2d_bytes=plan.traffic.get("h2d_bytes"),
                     predicted_d2h_bytes=plan.traffic.get("d2h_bytes"),
                     cpu_adam_params_per_s=plan.cpu_adam_params_per_s, baselines=plan.baselines)
    row["measured_over_predicted"] = round(t / plan.predicted_step_s, 3) if plan.predicted_step_s else None
    _end(engine)
    return row


def plan_fields(plan: SwappedPlan) -> dict:
    """What a row says of the plan it ran: stages, the runtime's settings (``PipelineOptions``), the
    predicted step, GPU peaks and host memory."""
    options = plan.options.to_json()
    return {"stages": plan.num_stages, "boundaries": list(plan.boundaries),
            "predicted_step_s": round(plan.predicted_step_s, 4),
            **{k: options[k] for k in ("resident", "kept", "grad_dtype", "num_slots", "offload_inputs", "barrier")},
            "grad_choice": plan.grad_choice, "profile_source": plan.profile_source,
            "predicted_peak_gib": [round(b / 2**30, 2) for b in plan.peak_bytes],
            "host_gib": round(plan.host_bytes / 2**30, 1)}


def _end(engine: PipelineEngine | None) -> None:
    """Close the engine (if it was made), leave the one-rank group and give the GPU's memory back."""
    import torch.distributed as dist

    if engine is not None:
        engine.close()
    dist.destroy_process_group()
    free_gpu()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--what", default="ref,mobius")
    add_workload_args(p, steps_default=5)
    add_sweep_args(p, clip_default="0")
    p.add_argument("--stages", type=int, default=0, help="0: planned by partition/")
    p.add_argument("--no-prefetch", action="store_true")
    p.add_argument("--resident", default="auto", help="auto | none | comma list: parallel.resident_stages")
    p.add_argument("--kept", default="auto", help="auto | none | comma list: parallel.kept_stages")
    p.add_argument("--variants", default="", help="extra pipeline runs for a profile: no-update (no CPU AdamW: "
                   "the GPU side alone), no-prefetch, stages=N")
    args = parse_workload(p)
    rows = []
    for clip in clip_list(args):
        a = argparse.Namespace(**{**vars(args), "grad_clip": clip})
        for what in args.what.split(","):
            rows.append(run_peft(a, what == "peft:gc") if what.startswith("peft")
                        else {"ref": run_ref, "mobius": run_mobius}[what](a))
            print(json.dumps(rows[-1]), flush=True)
            report(rows, args, quiet=True)  # what has run so far survives a later failure
        for variant in filter(None, args.variants.split(",")):
            v = argparse.Namespace(**vars(a))
            if variant == "no-prefetch":
                v.no_prefetch = True
            elif variant.startswith("stages="):
                v.stages = int(variant.split("=")[1])
            elif variant == "plain":  # swapped stages only, recompute everywhere (no resident, no kept)
                v.resident, v.kept = "none", "none"
            rows.append(run_mobius(v, variant))
            print(json.dumps(rows[-1]), flush=True)
            report(rows, args, quiet=True)
    report(rows, args)


def report(rows: list[dict], args: argparse.Namespace, quiet: bool = False) -> None:
    """The table (``vs all-in-GPU``: the reference row of the same clip setting) and the JSON."""
    out = Path(args.out) / "pipeline_bench.json"
    write_json(out, args, rows)
    if quiet:
        return
    refs = {r.get("grad_clip"): r for r in rows if r["name"].startswith("all-in-GPU") and r.get("step_s")}
    print(f"\n{'system':62s} {'step s':>7s} {'pred s':>7s} {'meas/pred':>9s} {'tok/s':>7s} {'TFLOPs':>7s} "
          f"{'peak GiB':>8s} {'h2d GB':>7s} {'d2h GB':>7s} {'adam s':>7s} {'vs all-in-GPU':>13s}  plan")
    for r in rows:
        if r.get("step_s") is None:
            print(f"{r['name']:62s} {'-':>7s} {r.get('predicted_step_s', '-'):>7}  {r.get('error')}  resident "
                  f"{r.get('resident')} kept {r.get('kept')} grads {r.get('grad_dtype')} predicted peak "
                  f"{r.get('predicted_peak_gib')} GiB, measured peak {r.get('peak_gib')} GiB")
            continue
        ref = refs.get(r.get("grad_clip"))
        rel = f"{ref['step_s'] / r['step_s']:.2f}x" if ref else "-"
        pred = r.get("predicted_step_s")
        plan = (f"resident {r['resident']} kept {r['kept']} grads {r['grad_dtype']} slots {r['num_slots']} "
                f"stages {r['stages']} host {r['host_gib']} GiB planned, {r.get('host_rss_gib')} GiB "
                f"measured") if "resident" in r else ""
        print(f"{r['name']:62s} {r['step_s']:7.3f} {pred if pred is not None else '-':>7} "
              f"{r.get('measured_over_predicted') or '-':>9} {r['tokens_per_s']:7d} {r['tflops']:7.1f} "
              f"{r['peak_gib']:8.2f} {r.get('h2d_bytes', 0) / 1e9:7.2f} {r.get('d2h_bytes', 0) / 1e9:7.2f} "
              f"{r.get('cpu_adam_s', 0):7.3f} {rel:>13s}  {plan}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
