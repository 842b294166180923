"""``mobius topo``: show, save, map and benchmark the GPU topology of this (or a saved) machine.

Examples::

    mobius topo                       # GPUs, root complexes, links, peer access
    mobius topo --json > box.json     # save it; `mobius topo --from box.json` shows it elsewhere
    mobius topo --from topo_m.txt     # saved `nvidia-smi topo -m` output of another server
    mobius topo --map 16              # cross mapping of 16 pipeline stages and its contention
    mobius topo --bench               # measure bandwidths -> topology_bandwidth.json (+ .png)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mobius.errors import MobiusError
from topology import bench, cross_mapping, detect, load_topology, save_bandwidth
from topology.model import Topology
from topology.render import format_bandwidth, format_mapping, format_topology


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {value}")
    return value


def configure(p: argparse.ArgumentParser) -> None:
    """The ``topo`` sub-command's arguments."""
    p.description = ("Show the GPUs, the CPU root complexes they share, NVLink and peer access; map pipeline stages "
                     "across root complexes; measure copy bandwidths.")
    p.add_argument("--json", action="store_true", help="print the topology as one JSON object")
    p.add_argument("--from", dest="from_file", metavar="FILE",
                   help="read a saved topology (`mobius topo --json` output or `nvidia-smi topo -m` text) instead of detecting")
    p.add_argument("--map", dest="map_stages", metavar="STAGES", type=_positive_int,
                   help="print the cross mapping of STAGES pipeline stages and its contention")
    p.add_argument("--bench", action="store_true", help="measure host<->GPU and peer copy bandwidth")
    p.add_argument("--bench-out", metavar="FILE", default="topology_bandwidth.json",
                   help="where --bench writes its JSON (default: %(default)s)")
    p.add_argument("--bench-size-mb", metavar="MB", type=_positive_int, default=256,
                   help="size of each benchmark copy in MiB (default: %(default)s)")
    p.add_argument("--png", metavar="FILE",
                   help="heat map of the benchmark (default: --bench-out with .png, when matplotlib is installed)")
    p.set_defaults(func=run)


def _topology(args: argparse.Namespace) -> Topology:
    if args.from_file:
        return load_topology(args.from_file)
    return detect()


def _bench(args: argparse.Namespace, topo: Topology) -> None:
    """Measure, write the JSON (and PNG); tables go to stderr when stdout carries --json."""
    stream = sys.stderr if args.json else sys.stdout
    bw = bench.measure(topo, size_bytes=args.bench_size_mb << 20)
    out = save_bandwidth(bw, args.bench_out)
    print(format_bandwidth(bw), file=stream)
    print(f"\nwrote {out}", file=stream)
    png = bench.heatmap_png(bw, args.png or Path(args.bench_out).with_suffix(".png"))
    print(f"wrote {png}", file=stream)


def run(args: argparse.Namespace) -> int:
    """Carry out ``mobius topo``; user-facing problems raise :class:`MobiusError`."""
    if args.bench and args.from_file:
        raise MobiusError("--bench measures this machine; it cannot be combined with --from")
    if args.bench:
        bench.require_cuda()
    topo = _topology(args)
    mapping = cross_mapping(topo, args.map_stages) if args.map_stages else None
    if args.json:
        doc = topo.to_json()
        if mapping is not None:
            doc["mapping"] = {"num_stages": mapping.num_stages, "worker_gpus": list(mapping.worker_gpus), "method": mapping.method,
                              "contention": mapping.contention, "sequential_contention": mapping.sequential_contention,
                              "stage_gpus": mapping.stage_gpus()}
        print(json.dumps(doc, indent=2))
    else:
        print(format_topology(topo))
        if mapping is not None:
            print()
            print(format_mapping(mapping))
    if args.bench:
        print(file=sys.stderr if args.json else sys.stdout)
        _bench(args, topo)
    return 0
