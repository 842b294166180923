"""The host's CPU update, measured: parameters per second of one worker's AdamW on a flat buffer with each
``train.optimizer_states`` rule, beside torch's fused AdamW, against the host's memory bandwidth.

    python bench/cpu_update_bench.py                          # 512M parameters (about 12 GiB), the run's threads
    python bench/cpu_update_bench.py --numel 67108864 --reps 9 --threads 8

Variants (bf16 training, a clipped step: the gradient factor 0.5; fp32 gradients; the bf16 half copy written):

* ``torch AdamW (fused)``: ``torch.optim.AdamW``'s fused kernel over the whole buffer (the factor as its
  ``grad_scale``), then a second pass writing the half copy;
* ``fp32`` / ``bf16`` / ``int8``: :class:`mobius.optim.FlatAdamW` with that rule's moments: fp32 is the fused
  kernel block by block with the half copy written while the block is in cache; bf16 and int8 the rules' host
  kernel (mobius/kernels/adamw_states.cpp), one pass.

The machine may be shared: the variants run in turn, one step each, ``--reps`` times (A, B, C, D, A, B, ...), so
that load from elsewhere falls on all alike; the table gives each one's median. Bytes per parameter are the step's
memory traffic (fp32: read master, gradient, m, v: 16; write master, m, v, half copy: 14); a streaming add timed
between the steps gives the host's memory bandwidth, and with it each variant's bound (bandwidth / bytes).

With ``--workers N`` it also measures each rule on N workers at once (one thread group each, ``--threads`` each):
the host's total, the figure ``partition.cpu_update_rate`` takes (fp32) when a server is planned from elsewhere::

    python bench/cpu_update_bench.py --workers 4 --threads 6 --numel 67108864   # on the server: 4 GPUs' workers

Prints a table and writes ``<out>/cpu_update_bench.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import OUT  # noqa: E402
from mobius.config import TrainSection  # noqa: E402
from mobius.optim import FlatAdamW  # noqa: E402
from partition.costs import update_bytes  # noqa: E402

RULES = ("fp32", "bf16", "int8")
TORCH = "torch AdamW (fused)"
ADD_BYTES = 12  # a.add_(b): read 4 + 4, write 4


def variants(n: int) -> dict[str, Callable[[], None]]:
    """One step of each variant over one shared master, gradient and half copy (each rule its own moments; torch's
    AdamW the fp32 rule's)."""
    master, grad = torch.zeros(n), torch.full((n,), 1e-3)
    half = torch.empty(n, dtype=torch.bfloat16)
    opts = {r: FlatAdamW(master, half, [(0, n, True)], TrainSection(weight_decay=0.1, optimizer_states=r))
            for r in RULES}
    fp32 = opts["fp32"].moments
    step, scale = [torch.zeros(())], torch.tensor(2.0)

    def torch_adamw() -> None:
        torch._fused_adamw_([master], [grad], [fp32.m], [fp32.v], [], step, lr=1e-4, beta1=0.9, beta2=0.95,
                            weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False, grad_scale=scale)
        half.copy_(master)

    out = {TORCH: torch_adamw}
    out.update({r: (lambda o=o: o.step(grad, 1e-4, 0.5)) for r, o in opts.items()})
    return out


def interleaved(fns: dict[str, Callable[[], None]], reps: int, n: int) -> dict[str, list[float]]:
    """Seconds of each variant's steps, taken in turn ``reps`` times (after one warm-up round), and of a streaming
    fp32 add over ``n`` elements between them (``"memory"``)."""
    a, b = torch.zeros(n), torch.ones(n)
    fns = {**fns, "memory": lambda: a.add_(b)}
    for fn in fns.values():
        fn()  # first-touch page faults, kernel build and selection
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return times


def table(times: dict[str, list[float]], n: int) -> list[dict]:
    """Each variant's median rate, bytes per parameter, traffic rate and bound at the measured bandwidth."""
    bandwidth = ADD_BYTES * n / statistics.median(times["memory"])
    rows = []
    for k, ts in times.items():
        if k == "memory":
            continue
        med = statistics.median(ts)
        per = update_bytes(k if k in RULES else "fp32")
        rows.append({"variant": k, "median_s": med, "params_per_s": n / med, "bytes_per_param": per,
                     "traffic_GBps": per * n / med / 1e9, "bound_params_per_s": bandwidth / per,
                     "spread_s": [min(ts), max(ts)]})
    return rows


def print_table(rows: list[dict], times: dict[str, list[float]], n: int, threads: int, reps: int) -> None:
    bandwidth = ADD_BYTES * n / statistics.median(times["memory"])
    print(f"CPU update of {n / 1e6:.0f} M parameters, {threads} thread(s), medians of {reps} interleaved steps; "
          f"memory bandwidth {bandwidth / 1e9:.1f} GB/s (a streaming fp32 add, {ADD_BYTES} bytes an element)")
    print(f"{'variant':<20} {'median s':>9} {'G params/s':>11} {'bytes/param':>12} {'GB/s':>7} {'bound G/s':>10} "
          f"{'of bound':>9}")
    for r in rows:
        print(f"{r['variant']:<20} {r['median_s']:>9.4f} {r['params_per_s'] / 1e9:>11.3f} {r['bytes_per_param']:>12g} "
              f"{r['traffic_GBps']:>7.1f} {r['bound_params_per_s'] / 1e9:>10.3f} "
              f"{r['params_per_s'] / r['bound_params_per_s']:>8.0%}")
    rate = {r["variant"]: r["params_per_s"] for r in rows}
    print(f"ratios: bf16/fp32 {rate['bf16'] / rate['fp32']:.2f}x, int8/bf16 {rate['int8'] / rate['bf16']:.2f}x, "
          f"int8/fp32 {rate['int8'] / rate['fp32']:.2f}x, fp32/torch {rate['fp32'] / rate[TORCH]:.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--numel", type=int, default=1 << 29)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--workers", type=int, default=1, help="also measure each rule on this many workers at once")
    p.add_argument("--out", default=OUT)
    p.add_argument("--smoke", action="store_true", help="1M parameters, 3 rounds (checks the script)")
    args = p.parse_args()
    if args.smoke:
        args.numel, args.reps = 1 << 20, 3
    torch.set_num_threads(args.threads)
    times = interleaved(variants(args.numel), args.reps, args.numel)
    rows = table(times, args.numel)
    print_table(rows, times, args.numel, args.threads, args.reps)
    together = {}
    if args.workers > 1:
        from partition.cpu_rate import measure_host_update

        for r in RULES:
            together[r] = measure_host_update(args.workers, args.threads, "bf16", min(args.numel, 1 << 26),
                                              states=r)
            print(f"{r}: {together[r] / 1e9:.2f} G params/s in total, {args.workers} workers at once")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cpu_update_bench.json").write_text(json.dumps(
        {"numel": args.numel, "threads": args.threads, "reps": args.reps, "rows": rows, "times": times,
         "workers": args.workers, "together_params_per_s": together, "date": time.strftime("%Y-%m-%d")}, indent=1))


if __name__ == "__main__":
    main()
