"""Peer baselines on mobius's own model and batches: torch FSDP2 with CPU offload and DeepSpeed
ZeRO-3 with parameter + optimizer offload, one GPU capped at ``--cap-gib`` (a 24 GB card), with and
without gradient clipping.

    python bench/peers.py --what fsdp2 --preset gpt-1.4b --grad-clip 0,1.0 --cap-gib 24 --out bench_out
    python bench/peers.py --what deepspeed --preset gpt-1.4b --grad-clip 0,1.0 --cap-gib 24 --out bench_out

The model is ``mobius.models.build_model(get_preset(preset), 0)`` (its forward returns logits; the
loss is :func:`mobius.models.base.lm_loss`, fp32 cross entropy, as the reference engine computes it).
The batches are pipeline_bench's (same seeds): ``--micro-batches`` x ``--mbs`` sequences of ``--seq``
random tokens per step, bf16. A setting ``GASxMBS`` regroups the same step's sequences as GAS
micro-batches of MBS (GAS x MBS = micro-batches x mbs).

``fsdp2``: ``fully_shard`` on every block and on the root, ``CPUOffloadPolicy(pin_memory=True)``,
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, ``torch.optim.AdamW`` (fused on the
CPU where it works, else foreach), ``clip_grad_norm_`` for a clipped row. ``--fsdp-settings``: a
comma list of ``GASxMBS[:ac|:noac][:nosync]`` (ac: activation checkpointing of every block;
nosync: gradients accumulate on the GPU and are reduced/offloaded after the last micro-batch only).
``deepspeed``: ZeRO-3, ``offload_param`` and ``offload_optimizer`` to pinned CPU memory, bf16,
AdamW (DeepSpeedCPUAdam), ``gradient_clipping`` for a clipped row, the model built under
``deepspeed.zero.Init``; ``--ds-settings`` as above (``:ac`` not supported there).

Prints a table and writes ``<out>/peers.json`` (rows of an earlier invocation into the same folder
are kept, a row of the same name replaced): step time (median of ``--steps`` timed steps after
``--warmup``), tokens/s, TFLOPs (6 N tokens / t), peak GPU GiB, and "best" per system and clip.
A setting that runs out of GPU memory gets a row with ``error``. ``--smoke``: a tiny model on the
CPU with gloo (FSDP2 without offload; DeepSpeed only checks its configuration).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import (LR, add_sweep_args, add_workload_args, batches, cap_gpu, clip_list, cuda_sync,  # noqa: E402
                    free_gpu, parse_workload, peak_gib, rates, reset_peak, step_tokens, write_json)
from mobius.models import build_model, get_preset, param_count  # noqa: E402
from mobius.models.base import lm_loss  # noqa: E402


def step_batches(args: argparse.Namespace, vocab: int, step: int, gas: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """pipeline_bench's batches of this step, regrouped as ``gas`` micro-batches."""
    xs, ys = zip(*((b.inputs, b.targets) for b in batches(args, vocab, step)))
    return list(zip(torch.cat(xs).chunk(gas), torch.cat(ys).chunk(gas)))


def parse_setting(text: str, total: int) -> dict:
    head, *flags = text.split(":")
    gas, mbs = (int(v) for v in head.lower().split("x"))
    if gas * mbs != total:
        raise SystemExit(f"setting {text}: {gas} x {mbs} != {total} sequences per step")
    unknown = set(flags) - {"ac", "noac", "nosync"}
    if unknown:
        raise SystemExit(f"setting {text}: unknown flags {sorted(unknown)}")
    return {"gas": gas, "mbs": mbs, "ac": "ac" in flags, "nosync": "nosync" in flags, "text": text}


def timed(args: argparse.Namespace, one_step) -> tuple[list[float], list[float]]:
    """``--warmup`` steps, then ``--steps`` timed ones (each to completion); seconds and losses."""
    times, losses = [], []
    for step in range(args.warmup + args.steps):
        cuda_sync()
        t0 = time.perf_counter()
        loss = one_step(step)
        cuda_sync()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
            losses.append(loss)
    return times, losses


def make_row(system: str, setting: dict, clip: float, args: argparse.Namespace, n_params: int, times: list[float],
             losses: list[float], **extra) -> dict:
    tokens = step_tokens(args)
    t = statistics.median(times)
    flags = ("AC" if setting["ac"] else "no AC") + (", grads synced once" if setting["nosync"] else "")
    row = {"name": f"{system} {setting['gas']}x{setting['mbs']} ({flags}) [clip {clip:g}]", "system": system,
           "setting": setting["text"], "grad_clip": clip, "step_s": round(t, 4),
           "step_s_all": [round(v, 4) for v in times], **rates(tokens, 6 * n_params * tokens, t),
           "peak_gib": peak_gib(),
           "loss": round(losses[-1], 4), "cap_gib": args.cap_gib, "preset": args.preset}
    row.update(extra)
    return row


def error_row(system: str, setting: dict, clip: float, exc: BaseException) -> dict:
    oom = isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()
    return {"name": f"{system} {setting['text']} [clip {clip:g}]", "system": system, "setting": setting["text"],
            "grad_clip": clip, "step_s": None, "peak_gib": peak_gib(),
            "error": "out of GPU memory" if oom else f"{type(exc).__name__}: {str(exc)[:400]}"}


# ------------------------------------------------------------------------------------------------ FSDP2
def init_pg(backend: str) -> None:
    import torch.distributed as dist

    from mobius.app.launch import free_port

    if dist.is_initialized():
        return
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ.get("MASTER_PORT") or str(free_port()))
    dist.init_process_group(backend, rank=0, world_size=1)


def run_fsdp2(args: argparse.Namespace, base: torch.nn.Module, setting: dict, clip: float) -> dict:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    model = copy.deepcopy(base)
    if setting["ac"]:
        for i, block in enumerate(model.blocks):
            model.blocks[i] = checkpoint_wrapper(block)
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy(pin_memory=True) if cuda else OffloadPolicy()
    if cuda:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cuda", (1,))
    else:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (1,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp, offload_policy=offload)
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload)
    params = list(model.parameters())
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    kind = "fused"
    try:
        opt = torch.optim.AdamW(groups, lr=LR, fused=True)
    except Exception:  # noqa: BLE001 - fall back to foreach
        kind, opt = "foreach", torch.optim.AdamW(groups, lr=LR, foreach=True)
    gas, vocab = setting["gas"], base.config.vocab_size

    def one_step(step: int) -> float:
        total = 0.0
        for m, (x, y) in enumerate(step_batches(args, vocab, step, gas)):
            if setting["nosync"] and gas > 1:
                model.set_requires_gradient_sync(m == gas - 1)
            loss = lm_loss(model(x.to(device, non_blocking=True)), y.to(device, non_blocking=True))
            (loss / gas).backward()
            total += float(loss.detach())
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total / gas

    reset_peak()
    try:
        try:
            times, losses = timed(args, one_step)
        except RuntimeError as exc:
            if kind != "fused" or "out of memory" in str(exc).lower():
                raise
            print(f"fused AdamW failed ({str(exc)[:200]}); foreach instead", flush=True)
            kind, opt = "foreach", torch.optim.AdamW(groups, lr=LR, foreach=True)
            times, losses = timed(args, one_step)
        return make_row("FSDP2 CPU offload", setting, clip, args, param_count(base.config), times, losses,
                        optimizer=f"torch AdamW ({kind}, CPU)")
    finally:
        opt = model = params = decay = no_decay = groups = None  # freed before the next setting
        free_gpu()


def fsdp2_rows(args: argparse.Namespace, clips: list[float]) -> list[dict]:
    cuda = torch.cuda.is_available() and not args.smoke
    init_pg("cpu:gloo,cuda:nccl" if cuda else "gloo")
    if cuda:
        torch.cuda.set_device(0)
        cap_gpu(args)
    mc = get_preset(args.preset)
    t0 = time.perf_counter()
    base = build_model(mc, 0)
    print(f"built {args.preset} ({param_count(mc) / 1e9:.2f}B) in {time.perf_counter() - t0:.1f} s", flush=True)
    total = args.micro_batches * args.mbs
    settings = [parse_setting(t, total) for t in filter(None, args.fsdp_settings.split(","))]
    return sweep("FSDP2 CPU offload", lambda setting, clip: run_fsdp2(args, base, setting, clip), settings, clips,
                 args)


def sweep(system: str, run, settings: list[dict], clips: list[float], args: argparse.Namespace) -> list[dict]:
    """``run(setting, clip)`` for every clip and setting; a failure is a row; the JSON after each."""
    rows = []
    for clip in clips:
        for setting in settings:
            try:
                row = run(setting, clip)
            except Exception as exc:  # noqa: BLE001 - one setting's failure is a row
                traceback.print_exc()
                row = error_row(system, setting, clip, exc)
                free_gpu()
            rows.append(row)
            print(json.dumps(row), flush=True)
            save(rows, args, partial=True)
    return rows


# -------------------------------------------------------------------------------------------- DeepSpeed
def ds_config(args: argparse.Namespace, setting: dict, clip: float) -> dict:
    return {"train_micro_batch_size_per_gpu": setting["mbs"], "gradient_accumulation_steps": setting["gas"],
            "train_batch_size": setting["mbs"] * setting["gas"],
            "bf16": {"enabled": args.precision == "bf16"},
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8,
                                                      "weight_decay": 0.1}},
            "gradient_clipping": clip,
            "zero_optimization": {"stage": 3,
                                  "offload_param": {"device": "cpu", "pin_memory": True},
                                  "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                  "overlap_comm": True, "contiguous_gradients": True,
                                  "reduce_bucket_size": 5e7, "stage3_prefetch_bucket_size": 5e7,
                                  "stage3_param_persistence_threshold": 1e5,
                                  "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                                  "sub_group_size": 1e9},
            "steps_per_print": 10**9, "wall_clock_breakdown": False}


def run_deepspeed(args: argparse.Namespace, setting: dict, clip: float) -> dict:
    import deepspeed

    cfg = ds_config(args, setting, clip)
    mc = get_preset(args.preset)
    reset_peak()
    t0 = time.perf_counter()
    how = "zero.Init"
    if args.ds_no_zero_init:
        model, how = build_model(mc, 0), "built on the CPU, partitioned by initialize"
    else:
        with deepspeed.zero.Init(config_dict_or_path=cfg, remote_device="cpu", pin_memory=True):
            model = build_model(mc, 0)
        # build_model's own initialisation ran on already partitioned (empty) parameters: redo it unit by
        # unit on gathered ones, so that the weights are the other systems' (same seed, same losses)
        for k, unit in enumerate(model.units()):
            with deepspeed.zero.GatheredParameters(list(unit.parameters()), modifier_rank=0):
                type(model).init_unit(mc, unit, k, 0)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    print(f"DeepSpeed engine built in {time.perf_counter() - t0:.1f} s ({how}); optimizer "
          f"{type(engine.optimizer).__name__} / {type(getattr(engine.optimizer, 'optimizer', None)).__name__}",
          flush=True)
    gas, device = setting["gas"], engine.device

    def one_step(step: int) -> float:
        total = 0.0
        for x, y in step_batches(args, mc.vocab_size, step, gas):
            loss = lm_loss(engine(x.to(device)), y.to(device))
            engine.backward(loss)
            engine.step()
            total += float(loss.detach())
        return total / gas

    try:
        times, losses = timed(args, one_step)
        return make_row("DeepSpeed ZeRO-3 offload", setting, clip, args, param_count(mc), times, losses,
                        optimizer=type(getattr(engine.optimizer, "optimizer", engine.optimizer)).__name__,
                        deepspeed=deepspeed.__version__, model_init=how)
    finally:
        engine.destroy() if hasattr(engine, "destroy") else None
        engine = model = None  # freed before the next setting
        free_gpu()


def deepspeed_rows(args: argparse.Namespace, clips: list[float]) -> list[dict]:
    total = args.micro_batches * args.mbs
    settings = [parse_setting(t, total) for t in filter(None, args.ds_settings.split(","))]
    if any(s["ac"] for s in settings):
        raise SystemExit("deepspeed settings: activation checkpointing is not wired here")
    if args.smoke:
        for s in settings:
            json.dumps(ds_config(args, s, 1.0))
        print("deepspeed: configuration checked (no run on the CPU)")
        return []
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    if not os.environ.get("MASTER_PORT"):
        from mobius.app.launch import free_port
        os.environ["MASTER_PORT"] = str(free_port())
    import deepspeed

    torch.cuda.set_device(0)
    deepspeed.init_distributed(dist_backend="nccl")
    cap_gpu(args)
    return sweep("DeepSpeed ZeRO-3 offload", lambda setting, clip: run_deepspeed(args, setting, clip), settings,
                 clips, args)


# ---------------------------------------------------------------------------------------------- report
def best_rows(rows: list[dict]) -> list[dict]:
    best = {}
    for r in rows:
        if r.get("step_s") is None:
            continue
        key = (r["system"], r["grad_clip"])
        if key not in best or r["step_s"] < best[key]["step_s"]:
            best[key] = r
    return [{**r, "name": f"{r['system']} best = {r['setting']} [clip {r['grad_clip']:g}]", "best_of": r["name"]}
            for r in best.values()]


def save(rows: list[dict], args: argparse.Namespace, partial: bool = False) -> Path:
    """Merge into ``<out>/peers.json``: rows from earlier invocations stay (same name: replaced)."""
    out = Path(args.out) / "peers.json"
    old = []
    if out.exists():
        try:
            old = json.loads(out.read_text()).get("rows", [])
        except (json.JSONDecodeError, OSError):
            old = []
    names = {r["name"] for r in rows}
    merged = [r for r in old if r["name"] not in names and not r.get("best_of")] + rows
    merged = [r for r in merged if not r.get("best_of")]
    write_json(out, args, merged, torch=torch.__version__, best=best_rows(merged), partial=partial)
    return out


def report(args: argparse.Namespace) -> None:
    data = json.loads((Path(args.out) / "peers.json").read_text())
    print(f"\n{'system':62s} {'step s':>7s} {'tok/s':>7s} {'TFLOPs':>7s} {'peak GiB':>8s}  note")
    for r in data["rows"] + data["best"]:
        if r.get("step_s") is None:
            print(f"{r['name']:62s} {'-':>7s} {'-':>7s} {'-':>7s} {r.get('peak_gib', 0):8.2f}  {r.get('error')}")
        else:
            print(f"{r['name']:62s} {r['step_s']:7.3f} {r['tokens_per_s']:7d} {r['tflops']:7.1f} "
                  f"{r['peak_gib']:8.2f}  {r.get('optimizer', '')} steps {r.get('step_s_all')}")
    print(f"wrote {Path(args.out) / 'peers.json'}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--what", default="fsdp2,deepspeed")
    add_workload_args(p, steps_default=3)
    add_sweep_args(p, clip_default="0,1.0")
    p.add_argument("--fsdp-settings", default="4x4:ac,4x4:noac,4x4:ac:nosync,1x16:ac,1x16:noac")
    p.add_argument("--ds-settings", default="4x4")
    p.add_argument("--ds-no-zero-init", action="store_true", help="build the model on the CPU, partition in initialize")
    args = parse_workload(p)
    if args.smoke:
        args.fsdp_settings = ",".join(s.replace("4x4", "2x2").replace("1x16", "1x4") for s in args.fsdp_settings.split(","))
        args.ds_settings = ",".join(s.replace("4x4", "2x2").replace("1x16", "1x4") for s in args.ds_settings.split(","))
    clips = clip_list(args)
    for what in args.what.split(","):
        rows = {"fsdp2": fsdp2_rows, "deepspeed": deepspeed_rows}[what](args, clips)
        if rows:
            save(rows, args)
    if (Path(args.out) / "peers.json").exists():
        report(args)


if __name__ == "__main__":
    main()
