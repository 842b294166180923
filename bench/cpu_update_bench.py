"""The pipeline's CPU update, measured: parameters per second of one worker's AdamW on a flat
stage, by variant, with the run's thread count.

    python bench/cpu_update_bench.py --numel 67108864 --threads 8 --out bench_out

Variants (bf16 training, a clipped step: the gradient is multiplied by a factor):

* ``torch-adamw``: what the pipeline ran before -- ``g.mul_(factor)``, ``torch.optim.AdamW(fused=True)``
  over the whole stage, then a second pass writing the bf16 copy;
* ``flat-fp32-grads``: :class:`mobius.optim.FlatAdamW` -- the fused kernel block by block with the
  factor folded in and the bf16 copy written while the block is in cache;
* ``flat-half-grads``: the same from bf16 gradients (the ``grad_download: half`` path).

With ``--workers N`` it also runs ``flat-fp32-grads`` on N workers at once (one thread group each,
``--threads`` threads per worker, as the pipeline's N workers update together): the host's total,
the figure ``partition.cpu_update_rate`` takes when a server is planned from elsewhere::

    python bench/cpu_update_bench.py --workers 4 --threads 6   # on the server: 4 GPUs' workers

Prints a table and writes ``<out>/cpu_update_bench.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import OUT  # noqa: E402
from mobius.config import TrainSection  # noqa: E402
from mobius.optim import FlatAdamW, adamw  # noqa: E402


def _time(fn, reps: int) -> float:
    fn()  # warm-up: first-touch page faults, kernel selection
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def variants(n: int, cfg: TrainSection) -> dict:
    master = torch.zeros(n)
    half = torch.empty(n, dtype=torch.bfloat16)
    grad = torch.full((n,), 1e-3)
    grad_half = grad.to(torch.bfloat16)
    flat_param = torch.nn.Parameter(master)
    opt = adamw([flat_param], [], cfg, fused=True)

    def torch_adamw() -> None:
        grad.mul_(0.5)
        flat_param.grad = grad
        opt.step()
        half.copy_(master)

    flat = FlatAdamW(master, half, [(0, n, True)], cfg)
    return {"torch-adamw": torch_adamw, "flat-fp32-grads": lambda: flat.step(grad, 1e-4, 0.5),
            "flat-half-grads": lambda: flat.step(grad_half, 1e-4, 0.5)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--numel", type=int, default=1 << 25)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--workers", type=int, default=1, help="also measure this many workers updating at once")
    p.add_argument("--out", default=OUT)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    cfg = TrainSection(weight_decay=0.1)
    rows = []
    for name, fn in variants(args.numel, cfg).items():
        t = _time(fn, args.reps)
        rows.append({"variant": name, "seconds": round(t, 4), "params_per_s": round(args.numel / t)})
    if args.workers > 1:
        from partition.cpu_rate import measure_host_update

        rate = measure_host_update(args.workers, args.threads, "bf16", args.numel, args.reps)
        rows.append({"variant": f"flat-fp32-grads x {args.workers} workers at once (total)", "seconds": None,
                     "params_per_s": round(rate)})
    base = rows[0]["params_per_s"]
    print(f"CPU update of {args.numel / 1e6:.0f} M parameters, {args.threads} thread(s)")
    print(f"{'variant':<18} {'seconds':>9} {'G params/s':>11} {'vs torch-adamw':>15}")
    for r in rows:
        secs = f"{r['seconds']:>9.4f}" if r["seconds"] is not None else f"{'':>9}"
        print(f"{r['variant']:<18} {secs} {r['params_per_s'] / 1e9:>11.2f} {r['params_per_s'] / base:>14.2f}x")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cpu_update_bench.json").write_text(json.dumps({"numel": args.numel, "threads": args.threads,
                                                           "workers": args.workers, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
