"""Zero mode's collectives between CPU worker processes (gloo), as its runtime calls them: a reduce-scatter
of a flat fp32 gradient buffer into each rank's shard, and an all-gather of the shards into the buffer, for
shards from 1K to 10M elements. The planner's zero model on CPU workers charges each ``GLOO_COLLECTIVE_S``
plus its bytes at ``GLOO_Bps`` (``mobius/app/planning.py``): this is where those figures come from.

    python bench/gloo_collectives.py                  # 2 worker processes, about 20 s on 2 cores
    python bench/gloo_collectives.py --workers 4

Prints one row per shard size (median milliseconds of ``--reps`` calls, each after a barrier, and the rate
of the bytes a rank receives: ``(workers - 1) x shard x 4``) and writes ``<out>/gloo_collectives.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import OUT  # noqa: E402
from mobius.app.launch import free_port  # noqa: E402
from scheduler.collectives import all_gather_flat, reduce_scatter_flat  # noqa: E402

SHARDS = (1024, 100_000, 1_000_000, 10_000_000)  # elements per rank


def _timed(fn, reps: int) -> float:
    """Median seconds of ``fn`` over ``reps`` calls, the ranks lined up by a barrier before each."""
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _worker(rank: int, world: int, port: int, reps: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    rows = []
    for shard in SHARDS:
        full, mine = torch.ones(shard * world), torch.empty(shard)  # [N s], [s]
        reduce_s = _timed(lambda: reduce_scatter_flat(mine, full), reps)
        gather_s = _timed(lambda: all_gather_flat(full, mine), reps)
        received = (world - 1) * shard * 4
        rows.append({"shard": shard, "reduce_scatter_ms": reduce_s * 1e3, "all_gather_ms": gather_s * 1e3,
                     "reduce_scatter_GBps": received / reduce_s / 1e9, "all_gather_GBps": received / gather_s / 1e9})
    if rank == 0:
        Path(out).write_text(json.dumps({"workers": world, "reps": reps, "cpus": os.cpu_count(), "rows": rows},
                                        indent=1))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--out", default=OUT)
    args = p.parse_args()
    out = Path(args.out) / "gloo_collectives.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    mp.spawn(_worker, args=(args.workers, free_port(), args.reps, str(out)), nprocs=args.workers)
    rows = json.loads(out.read_text())["rows"]
    print(f"| shard (elements) | reduce-scatter ms | GB/s | all-gather ms | GB/s |  ({args.workers} workers)\n"
          "|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shard']:,} | {r['reduce_scatter_ms']:.2f} | {r['reduce_scatter_GBps']:.2f} | "
              f"{r['all_gather_ms']:.2f} | {r['all_gather_GBps']:.2f} |")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
