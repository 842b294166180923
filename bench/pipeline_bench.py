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
import dataclasses
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mobius.app.launch import expandable_segments  # noqa: E402
from mobius.assemble import with_adapters  # noqa: E402
from mobius.config import Config, config_from_dict  # noqa: E402
from mobius.errors import MobiusError  # noqa: E402
from mobius.models import build_model, get_preset, param_count  # noqa: E402


def make_cfg(args: argparse.Namespace, mode: str) -> Config:
    raw = {"model": {"preset": args.preset, "dropout": 0.0},
           "data": {"seq_len": args.seq},
           "train": {"micro_batch_size": args.mbs, "micro_batches": args.micro_batches, "precision": args.precision,
                     "lr": 1e-5, "warmup_steps": 0, "grad_clip": args.grad_clip, "max_steps": 1000},
           "parallel": {"mode": mode, "device": "cpu" if args.smoke else "cuda", "stages": args.stages,
                        "prefetch": not args.no_prefetch, "resident_stages": stage_list(args.resident),
                        "kept_stages": stage_list(args.kept)},
           "partition": {"gpu_memory_gib": args.cap_gib, "time_limit_s": 20},
           "lora": {"rank": args.lora_rank, "alpha": 2.0 * max(args.lora_rank, 1), "targets": ["all-linear"]},
           "output": {"dir": str(Path(args.out) / mode), "plot": False}}
    return config_from_dict(raw, "pipeline_bench")


def bench_model(args: argparse.Namespace, cfg: Config | None = None):
    """The workload's architecture: the preset, with ``--layers`` blocks when given (the same widths and
    per-block costs in fewer blocks, for a host whose memory cannot take the whole model's states), and
    the run's LoRA adapters when ``cfg`` has them."""
    mc = get_preset(args.preset)
    if getattr(args, "layers", 0):
        mc = dataclasses.replace(mc, **{"n_layer" if mc.family == "gpt2" else "num_hidden_layers": args.layers})
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


def batches(args: argparse.Namespace, vocab: int, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(step)
    out = []
    for _ in range(args.micro_batches):
        t = torch.randint(0, vocab, (args.mbs, args.seq + 1), generator=g)
        out.append((t[:, :-1], t[:, 1:]))
    return out


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_engine(engine, args: argparse.Namespace, vocab: int) -> tuple[float, list]:
    """Steady-state seconds per step: ``--steps`` back to back after ``--warmup`` (the pipeline's
    CPU updates overlap the next step, as in training), all work finished at the end."""
    stats = []
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            if hasattr(engine, "ex"):
                engine.ex.sync()
            sync()
            t0 = time.perf_counter()
        st = engine.train_step(step, batches(args, vocab, step), 1e-5)
        if step >= args.warmup:
            stats.append(st)
    if hasattr(engine, "ex"):
        engine.ex.sync()
    sync()
    return (time.perf_counter() - t0) / args.steps, stats


def result_row(name: str, t: float, n_params: int, tokens: int, stats: list, flops_per_param: float = 6,
               **extra) -> dict:
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
    row = {"name": name, "step_s": round(t, 4), "tokens_per_s": round(tokens / t),
           "tflops": round(flops_per_param * n_params * tokens / t / 1e12, 1),
           "peak_gib": round(peak, 2), "loss": round(stats[-1].loss, 4)}
    if stats and stats[-1].extra:
        keys = ("h2d_bytes", "d2h_bytes", "p2p_bytes", "traffic_x_params", "stall_s", "upload_wait_s", "cpu_adam_s")
        row.update({k: round(sum(s.extra[k] for s in stats) / len(stats), 4) for k in keys if k in stats[-1].extra})
    row.update(extra)
    return row


def clip_tag(args: argparse.Namespace) -> str:
    return f" [clip {args.grad_clip:g}]"


def rss_gib() -> float:
    """This process's resident host memory (page-locked buffers included), from /proc (0 elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 2**20
    except (OSError, StopIteration):
        return 0.0


def free_gpu() -> None:
    gc.collect()
    torch.cuda.empty_cache() if torch.cuda.is_available() else None


def run_ref(args: argparse.Namespace) -> dict:
    from mobius.engine import SingleEngine

    cfg = make_cfg(args, "single")
    mc = bench_model(args, cfg)
    device = torch.device("cpu" if args.smoke else "cuda")
    if torch.cuda.is_available():
        torch.cuda.set_per_process_memory_fraction(1.0)  # a pipeline run before this one capped the process
        torch.cuda.reset_peak_memory_stats()
    name = "all-in-GPU (mobius reference engine)" + clip_tag(args)
    engine = None
    try:
        engine = SingleEngine(build_model(mc, 0), cfg, device)  # uncapped, as all-in-GPU training runs
        t, stats = time_engine(engine, args, mc.vocab_size)
    except torch.OutOfMemoryError:  # the model's states do not fit the whole GPU: a row that says so
        row = {"name": name, "step_s": None, "error": "out of GPU memory", "grad_clip": args.grad_clip,
               "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)}
    else:
        tokens = args.mbs * args.micro_batches * args.seq
        row = result_row(name, t, param_count(mc), tokens, stats, flops_per_token(args, 1), grad_clip=args.grad_clip)
    del engine
    free_gpu()
    return row


class PeftSteps:
    """A transformers + PEFT model's training step, as the engines' ``train_step``: micro-batches
    accumulated, the gradients clipped by mobius's rule, AdamW."""

    def __init__(self, model, opt: torch.optim.Optimizer, device: torch.device, grad_clip: float):
        self.model, self.opt, self.device, self.grad_clip = model, opt, device, grad_clip
        self.trainable = [p for p in model.parameters() if p.requires_grad]

    def train_step(self, step: int, micro: list[tuple[torch.Tensor, torch.Tensor]], lr: float):
        from mobius.engine import StepStats, global_norm
        from mobius.optim import clip_coefficient

        total = 0.0
        for x, y in micro:
            logits = self.model(input_ids=x.to(self.device)).logits  # [B, T, V]
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.to(self.device).flatten())
            (loss / len(micro)).backward()
            total += float(loss.detach())
        grads = [p.grad for p in self.trainable if p.grad is not None]
        norm = global_norm(grads)
        coef = clip_coefficient(norm, self.grad_clip)
        if coef < 1.0:
            torch._foreach_mul_(grads, coef)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return StepStats(total / len(micro), norm, False, 1.0)


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
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.precision]
    name = f"PEFT all-in-GPU, {args.cap_gib:g} GiB cap{', grad. ckpt' if checkpointing else ''}" + clip_tag(args)
    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * 2**30 / total))
        torch.cuda.reset_peak_memory_stats()
    model = opt = None
    try:
        hf_cfg = config_to_hf(mc, dtype)
        with device:
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**hf_cfg), dtype=dtype)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model = peft.get_peft_model(model, peft.LoraConfig(r=args.lora_rank, lora_alpha=2.0 * args.lora_rank,
                                                           target_modules="all-linear", lora_dropout=0.0))
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, weight_decay=cfg.train.weight_decay, fused=device.type == "cuda")

        t, stats = time_engine(PeftSteps(model, opt, device, args.grad_clip), args, mc.vocab_size)
    except torch.OutOfMemoryError:
        row = {"name": name, "step_s": None, "error": "out of GPU memory", "grad_clip": args.grad_clip,
               "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)}
    else:
        tokens = args.mbs * args.micro_batches * args.seq
        row = result_row(name, t, param_count(mc), tokens, stats, flops_per_token(args, 1), grad_clip=args.grad_clip)
    del model, opt
    free_gpu()
    return row


def run_mobius(args: argparse.Namespace, variant: str = "") -> dict:
    import torch.distributed as dist

    from mobius.app.launch import free_port, open_device
    from mobius.app.planning import plan_pipeline
    from mobius.app.settings import Machine, resolve
    from scheduler.engine import PipelineEngine

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    cfg = make_cfg(args, "pipeline")
    mc = bench_model(args, cfg)
    t_plan = time.perf_counter()
    machine = Machine.detect(cfg)
    settings = resolve(cfg, machine)
    name = f"mobius pipeline, {args.cap_gib:g} GiB cap" + clip_tag(args) + (f" [{variant}]" if variant else "")
    try:
        plan, _, _ = plan_pipeline(cfg, mc, settings, machine)
    except MobiusError as exc:  # no plan fits (GPU or host memory): a row with the planner's reason
        dist.destroy_process_group()
        return {"name": name, "step_s": None, "error": f"no plan: {exc}", "grad_clip": args.grad_clip}
    plan_s = time.perf_counter() - t_plan
    device = open_device(settings, 0)
    torch.cuda.reset_peak_memory_stats() if torch.cuda.is_available() else None
    print(f"{name}: plan stages {plan.num_stages} resident {sorted(plan.resident)} kept {sorted(plan.kept)} grads "
          f"{plan.grad_dtype} slots {plan.num_slots} predicted {plan.predicted_step_s:.3f} s, peak "
          f"{[round(b / 2**30, 2) for b in plan.peak_bytes]} GiB, profile {plan.profile_source}", flush=True)
    engine, rss0 = None, rss_gib()
    try:
        engine = PipelineEngine(cfg, mc, plan, settings, device, None, skip_updates=variant == "no-update")
        t, stats = time_engine(engine, args, mc.vocab_size)
    except Exception as exc:  # noqa: BLE001 - a failed plan is a row (with the plan's choices)
        import traceback
        traceback.print_exc()
        oom = isinstance(exc, torch.OutOfMemoryError)
        row = {"name": name, "step_s": None, "error": "out of GPU memory" if oom else f"{type(exc).__name__}: {exc}"[:500],
               "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else 0.0,
               "grad_clip": args.grad_clip, "stages": plan.num_stages, "boundaries": list(plan.boundaries),
               "predicted_step_s": round(plan.predicted_step_s, 4), "resident": sorted(plan.resident),
               "kept": sorted(plan.kept), "grad_dtype": plan.grad_dtype, "num_slots": plan.num_slots,
               "offload_inputs": plan.offload_inputs, "profile_source": plan.profile_source,
               "predicted_peak_gib": [round(b / 2**30, 2) for b in plan.peak_bytes],
               "host_gib": round(plan.host_bytes / 2**30, 1), "host_rss_gib": round(rss_gib() - rss0, 1),
               "grad_choice": plan.grad_choice}
        if engine is not None:
            engine.close()
        engine = None
        dist.destroy_process_group()
        free_gpu()
        return row
    tokens = args.mbs * args.micro_batches * args.seq
    row = result_row(name, t, param_count(mc), tokens, stats, flops_per_token(args, 1), grad_clip=args.grad_clip,
                     stages=plan.num_stages, boundaries=list(plan.boundaries), plan_s=round(plan_s, 2),
                     predicted_step_s=round(plan.predicted_step_s, 4), model_step_s=round(plan.model_step_s, 4),
                     resident=sorted(plan.resident), kept=sorted(plan.kept), grad_dtype=plan.grad_dtype,
                     grad_choice=plan.grad_choice, num_slots=plan.num_slots, offload_inputs=plan.offload_inputs,
                     barrier=plan.barrier, profile_source=plan.profile_source,
                     predicted_peak_gib=[round(b / 2**30, 2) for b in plan.peak_bytes],
                     predicted_h2d_bytes=plan.traffic.get("h2d_bytes"), predicted_d2h_bytes=plan.traffic.get("d2h_bytes"),
                     host_gib=round(plan.host_bytes / 2**30, 1), host_rss_gib=round(rss_gib() - rss0, 1),
                     cpu_adam_params_per_s=plan.cpu_adam_params_per_s,
                     baselines=plan.baselines)
    row["measured_over_predicted"] = round(t / plan.predicted_step_s, 3) if plan.predicted_step_s else None
    engine.close()
    engine = None
    dist.destroy_process_group()
    free_gpu()
    return row


def add_workload_args(p: argparse.ArgumentParser, clip_default: str, steps_default: int) -> None:
    """The benchmark workload's options, shared with bench/peers.py (same model, batches, cap, clips)."""
    p.add_argument("--preset", default="gpt-1.4b")
    p.add_argument("--layers", type=int, default=0, help="blocks instead of the preset's (0: the preset's)")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--mbs", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--precision", default="bf16")
    p.add_argument("--grad-clip", default=clip_default, help="clip setting(s), a comma list (0,1.0): each system "
                   "runs at each; 0: no clipping")
    p.add_argument("--cap-gib", type=float, default=24.0)
    p.add_argument("--steps", type=int, default=steps_default)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU (checks the script)")
    p.add_argument("--lora-rank", type=int, default=0, help="LoRA rank on every linear layer (0: full fine-tuning)")


def smoke_workload(args: argparse.Namespace) -> None:
    """``--smoke``: a tiny fp32 model of the workload's family and two short steps on the CPU."""
    tiny = "llama-tiny" if get_preset(args.preset).family in ("llama", "mistral", "qwen2", "qwen3") else "gpt2-tiny"
    args.preset, args.seq, args.mbs, args.micro_batches, args.steps, args.warmup = tiny, 32, 2, 2, 2, 1
    args.layers = 0
    args.precision = "fp32"


def clip_list(args: argparse.Namespace) -> list[float]:
    return [float(c) for c in str(args.grad_clip).split(",") if c.strip()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--what", default="ref,mobius")
    add_workload_args(p, clip_default="0", steps_default=5)
    p.add_argument("--stages", type=int, default=0, help="0: planned by partition/")
    p.add_argument("--no-prefetch", action="store_true")
    p.add_argument("--resident", default="auto", help="auto | none | comma list: parallel.resident_stages")
    p.add_argument("--kept", default="auto", help="auto | none | comma list: parallel.kept_stages")
    p.add_argument("--variants", default="", help="extra pipeline runs for a profile: no-update (no CPU AdamW: "
                   "the GPU side alone), no-prefetch, stages=N")
    args = p.parse_args()
    expandable_segments()  # every system in the table runs with the allocator mobius's workers use
    if args.smoke:
        smoke_workload(args)
    Path(args.out).mkdir(parents=True, exist_ok=True)
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
    out.write_text(json.dumps({"args": vars(args), "device": torch.cuda.get_device_name() if torch.cuda.is_available()
                               else "cpu", "rows": rows}, indent=2))
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
