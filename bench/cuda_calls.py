"""What the host pays per CUDA call that the pipeline's dispatch thread makes around its actions: creating and
recording a timing event, reading the time between two events, reading a device scalar (``float()``), a
device synchronize, a stream waiting on an event, and launching one small kernel. On a machine whose GPU calls
go through a sandbox (gVisor's nvproxy) these can cost far more than on bare metal, and a pipeline step makes
hundreds of them: the end of a step (its REDUCE) reads a timing per compute action and a norm per stage.
Then one block's forward (``--preset``'s, 1 x ``--seq`` tokens): the host's time to issue it beside the
device's time to run it, under the runtimes' bf16 autocast and without it; and the same forward while a CPU
AdamW runs beside it on the threads a pipeline worker gives its updates (``--adamw-threads``, by default what
``mobius train`` gives one GPU worker: the cores less the dispatch threads), as the pipeline's CPU update runs
beside the next forwards: whether those threads slow the thread that launches the kernels.

    python bench/cuda_calls.py --out runs/calls      # about 20 s on a GPU
    python bench/cuda_calls.py --smoke               # the same calls' host-side costs on the CPU (checks the script)

Prints one table (median microseconds per call over ``--reps`` calls) and writes ``<out>/cuda_calls.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from common import OUT
from mobius.app.settings import DISPATCH_THREADS


def per_call_us(fn: Callable[[], object], reps: int, setup: Callable[[], None] | None = None) -> float:
    """Median host microseconds of one ``fn()`` over ``reps`` calls (``setup`` before each, untimed)."""
    times = []
    for _ in range(reps):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def gpu_calls(reps: int) -> dict[str, float]:
    """Each call's median host microseconds on the current GPU (idle between calls)."""
    dev = torch.device("cuda", torch.cuda.current_device())
    x, scalar = torch.zeros(1024, device=dev), torch.ones((), device=dev)
    side = torch.cuda.Stream(dev)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record(), x.add_(1), b.record()
    torch.cuda.synchronize(dev)
    reused = torch.cuda.Event(enable_timing=True)
    idle = lambda: torch.cuda.synchronize(dev)  # noqa: E731
    return {"new timing event, recorded": per_call_us(lambda: torch.cuda.Event(enable_timing=True).record(), reps),
            "recording a reused event": per_call_us(reused.record, reps, idle),
            "elapsed_time of two ended events": per_call_us(lambda: a.elapsed_time(b), reps),
            "float() of a device scalar": per_call_us(lambda: float(scalar), reps, idle),
            "synchronize, device idle": per_call_us(idle, reps),
            "stream waits on an event": per_call_us(lambda: side.wait_event(reused), reps),
            "one small kernel launched": per_call_us(lambda: x.add_(1), reps, idle)}


def block_forward(preset: str, seq: int, reps: int, device: torch.device,
                  only: tuple[str, ...] | None = None) -> dict[str, float]:
    """One block of ``preset`` (bf16 weights, one micro-batch of 1 x ``seq``) run the ways the pipeline runs a
    forward: without grad under bf16 autocast (norms in fp32; a stage that recomputes), the same without
    autocast, and with autograd on (a kept stage's forward, whose graph stays for the backward; the profile
    times the forward without grad), also under the saved-tensor hooks a swapped kept stage packs its saved
    weights with (``scheduler.executor``'s ``_weights_by_position``: a Python call per saved tensor).
    Microseconds the host takes to issue it from an idle device, and the device's time per forward when many
    run back to back. Issue time above device time means the forward waits on the thread that launches it."""
    from common import architecture

    from mobius.engine import autocast
    from mobius.models import unit_specs

    spec = next(s for s in unit_specs(architecture(preset)) if s.kind == "block")
    module = spec.build().to(device=device, dtype=torch.bfloat16)
    x = spec.make_input(1, seq, device, torch.bfloat16)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
    cast = lambda: autocast(device, "bf16")  # noqa: E731
    hooks = lambda: torch.autograd.graph.saved_tensors_hooks(lambda t: (t,), lambda p: p[0])  # noqa: E731
    ways = {"autocast": (torch.no_grad, cast, contextlib.nullcontext),
            "plain bf16": (torch.no_grad, contextlib.nullcontext, contextlib.nullcontext),
            "autocast, with grad (kept)": (torch.enable_grad, cast, contextlib.nullcontext),
            "autocast, with grad and saved-tensor hooks (swapped, kept)": (torch.enable_grad, cast, hooks)}
    out = {}
    for name, (grad, ctx, packing) in ways.items():
        if only is not None and name not in only:
            continue

        def forward(grad=grad, ctx=ctx, packing=packing) -> None:
            with grad(), ctx(), packing():
                module(x.detach().requires_grad_(grad is torch.enable_grad))
        for _ in range(3):
            forward()
        out[f"block forward issued, {name}"] = per_call_us(forward, reps, sync)
        if sync is not None:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(reps):
                forward()
            b.record()
            b.synchronize()
            out[f"block forward on the device, {name}"] = a.elapsed_time(b) * 1e3 / reps
    return out


def beside_adamw(preset: str, seq: int, reps: int, device: torch.device, threads: int) -> dict[str, float]:
    """:func:`block_forward`'s first and third ways while a CPU AdamW (``mobius.optim.FlatAdamW`` over 64M
    parameters, fp32 gradients) runs over and over on ``threads`` threads in another Python thread."""
    import threading

    from partition.cpu_rate import update_step

    step, stop, before = update_step(1 << 26), threading.Event(), torch.get_num_threads()

    def update() -> None:
        while not stop.is_set():
            step()

    torch.set_num_threads(threads)
    helper = threading.Thread(target=update, daemon=True)
    helper.start()
    try:
        time.sleep(0.5)
        rows = block_forward(preset, seq, reps, device, only=("autocast", "autocast, with grad (kept)"))
    finally:
        stop.set()
        helper.join()
        torch.set_num_threads(before)
    return {f"{name}, beside a CPU AdamW on {threads} threads": us for name, us in rows.items()}


def cpu_calls(reps: int) -> dict[str, float]:
    """The host-side part of the same calls on the CPU (no events, no device): the script's check."""
    x, scalar = torch.zeros(1024), torch.ones(())
    return {"float() of a device scalar": per_call_us(lambda: float(scalar), reps),
            "one small kernel launched": per_call_us(lambda: x.add_(1), reps)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=2000)
    p.add_argument("--preset", default="opt-2.7b", help="whose block's forward to time (at 1 x --seq tokens)")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--out", default=str(Path(OUT) / "calls"))
    p.add_argument("--smoke", action="store_true", help="the host-side costs on the CPU (checks the script)")
    p.add_argument("--adamw-threads", type=int, default=None, help="the CPU AdamW's threads beside the forward "
                   "(default: the cores less the dispatch threads, as mobius train gives one GPU worker)")
    args = p.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("cuda_calls: no CUDA GPU here (--smoke runs the CPU check)")
    device = "cpu" if args.smoke else torch.cuda.get_device_name()
    rows = cpu_calls(args.reps) if args.smoke else gpu_calls(args.reps)
    dev = torch.device("cpu") if args.smoke else torch.device("cuda", torch.cuda.current_device())
    preset, seq, reps = ("gpt2-tiny", 64, 5) if args.smoke else (args.preset, args.seq, 50)
    rows.update(block_forward(preset, seq, reps, dev))
    threads = args.adamw_threads or max(1, (os.cpu_count() or 1) - (DISPATCH_THREADS if not args.smoke else 0))
    rows.update(beside_adamw(preset, seq, reps, dev, threads))
    print(f"| call ({device}) | us (host, median; 'on the device': device, mean back to back) |\n|---|---|")
    for name, us in rows.items():
        print(f"| {name} | {us:.1f} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cuda_calls.json").write_text(json.dumps({"device": device, "reps": args.reps, "host_us": rows}, indent=1))


if __name__ == "__main__":
    main()
