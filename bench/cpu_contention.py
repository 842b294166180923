"""How much a CPU worker's compute slows while other threads of the host want its cores: the fact behind the
simulator's sharing of CPU workers' cores (``partition.hardware.Hardware.host_cores``).

    python bench/cpu_contention.py            # ~1 minute

One GPT-2 block (hidden 256, a micro-batch of 4 x 128 tokens, fp32, one thread: a CPU worker's compute on a 2-core
machine) runs forward and backward over and over in each of ``--workers`` processes at once, alone or beside one
busy helper thread per process of the kind a worker runs: a memory copy (an upload or download on CPU workers), an
in-place add (the round-robin's gradient sums) or the CPU AdamW (``mobius.optim.FlatAdamW``). Prints the median
forward+backward time per setting and its ratio to one process alone, and writes ``<out>/cpu_contention.json``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import OUT  # noqa: E402

HELPER_NUMEL = 1 << 22  # elements each helper works on per call (16 MB in fp32: out of the caches)


def _helper(kind: str, stop: threading.Event) -> None:
    """Busy until ``stop``: the work of one of a worker's threads beside its compute."""
    import torch

    from partition.cpu_rate import update_step

    a, b = torch.ones(HELPER_NUMEL), torch.empty(HELPER_NUMEL)
    work = {"copy": lambda: b.copy_(a), "add": lambda: b.add_(a)}.get(kind) or update_step(HELPER_NUMEL)
    while not stop.is_set():
        work()


def _worker(helper: str | None, seconds: float, start, out) -> None:
    """(A process) time the block's forward+backward for ``seconds`` beside ``helper``; put the median in ``out``."""
    import torch

    from mobius.models import build_model
    from mobius.models.gpt2 import GPT2Config

    torch.set_num_threads(1)
    block = build_model(GPT2Config(vocab_size=320, n_embd=256, n_layer=1, n_head=4, n_positions=128)).blocks[0]
    x = torch.randn(4, 128, 256)

    def step() -> None:
        xi = x.detach().requires_grad_()
        block(xi).sum().backward()
        block.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    stop = threading.Event()
    thread = threading.Thread(target=_helper, args=(helper, stop)) if helper else None
    start.wait()
    if thread:
        thread.start()
        time.sleep(0.2)
    times, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    stop.set()
    if thread:
        thread.join()
    out.put(statistics.median(times))


def measure(workers: int, helper: str | None, seconds: float) -> float:
    """Median seconds of the block's forward+backward over ``workers`` processes running at once."""
    ctx = mp.get_context("spawn")
    start, out = ctx.Barrier(workers), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(helper, seconds, start, out)) for _ in range(workers)]
    for p in procs:
        p.start()
    medians = [out.get() for _ in procs]
    for p in procs:
        p.join()
    return statistics.median(medians)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=OUT)
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes at once (default: the cores)")
    p.add_argument("--seconds", type=float, default=4.0, help="timed seconds per setting")
    args = p.parse_args()
    rows = []
    for workers in sorted({1, args.workers}):
        for helper in (None, "copy", "add", "adamw"):
            rows.append({"workers": workers, "helper": helper or "none",
                         "step_ms": round(1e3 * measure(workers, helper, args.seconds), 2)})
    alone = rows[0]["step_ms"]
    print(f"{os.cpu_count()} cores; one GPT-2 block's forward+backward, one thread per process")
    print(f"{'processes':>9s} {'helper thread each':>18s} {'ms':>8s} {'vs one alone':>12s}")
    for r in rows:
        r["ratio"] = round(r["step_ms"] / alone, 3)
        print(f"{r['workers']:9d} {r['helper']:>18s} {r['step_ms']:8.2f} {r['ratio']:11.2f}x")
    path = Path(args.out) / "cpu_contention.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"cores": os.cpu_count(), "rows": rows}, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
