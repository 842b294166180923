"""``mobius plan CONFIG``: how the model will be cut into stages and placed, and what a step will cost.

Examples::

    mobius plan configs/finetune-opt-13b.yaml --topology topo_m.txt     # saved `nvidia-smi topo -m` of the server
    mobius plan configs/finetune-opt-13b.yaml --topology box.json --bandwidth topology_bandwidth.json
    mobius plan configs/finetune-opt-13b.yaml --gpus 4 --json           # a synthetic 2+2 box of partition.gpu
    mobius plan run.yaml --trace plan.json                              # timeline for https://ui.perfetto.dev
    mobius plan run.yaml --parallel.mode=zero --gpus 2                  # zero mode: chunks, rCache, GPU/CPU split

With ``parallel.mode: zero`` it shows the zero plan instead (chunk size, rCache blocks, chunks on the
GPU and offloaded, predicted step time and memory, and the rCache-min / rCache-max / all-offload
alternatives); otherwise the pipeline's, whatever mode the run file picks.

Config keys used: model.checkpoint / model.preset, data.seq_len, train.micro_batch_size,
train.micro_batches, train.precision, parallel.devices / mapping / prefetch / p2p, partition.* and
topology.file / topology.bandwidth_file; in zero mode also model.activation_checkpointing,
train.grad_clip and zero.*.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from typing import Any

from mobius.app.planning import plan_pipeline, plan_zero
from mobius.app.settings import Machine, resolve
from mobius.assemble import planned_architecture
from mobius.config import Config, load_config
from mobius.errors import ConfigError, MobiusError
from partition import simulate
from partition.gpus import GB, gpu_spec

log = logging.getLogger(__name__)


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add the ``plan`` sub-command."""
    p = sub.add_parser("plan", help="show how the model will be partitioned and placed, and the predicted step time",
                       description="Profile (or estimate) the model's units, solve the partition MIP, map stages to "
                                   "GPUs and simulate a training step; baselines are simulated beside it. Any "
                                   "configuration key can be overridden with --section.key=value.")
    p.add_argument("config", help="YAML run file (see configs/)")
    p.add_argument("--topology", metavar="FILE", help="saved topology: `mobius topo --json` output or "
                                                      "`nvidia-smi topo -m` text (default: topology.file, else detect)")
    p.add_argument("--bandwidth", metavar="FILE", help="bandwidth JSON from `mobius topo --bench` "
                                                       "(default: topology.bandwidth_file)")
    p.add_argument("--gpus", type=int, metavar="N", help="plan for a synthetic box of N GPUs of model partition.gpu "
                                                         "in two root complexes (when no topology is given)")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    p.add_argument("--trace", metavar="FILE", help="write the simulated step as Chrome-trace JSON (Perfetto)")
    p.add_argument("--timeline", action="store_true", help="also print the simulated step as a text grid")
    p.set_defaults(func=run, accepts_overrides=True)


def _machine(cfg: Config, args: argparse.Namespace) -> Machine:
    """The machine planned for: a saved topology, a synthetic box of ``--gpus``, or this one."""
    import topology

    path = args.topology or cfg.topology.file
    if path:
        return Machine.saved(topology.load_topology(path))
    if args.gpus:
        spec = gpu_spec(cfg.partition.gpu) if cfg.partition.gpu else None
        sizes = [args.gpus - args.gpus // 2, args.gpus // 2] if args.gpus > 1 else [1]
        return Machine.saved(topology.Topology.synthetic(sizes, memory_bytes=spec.memory_bytes if spec else 24 * 2**30,
                                                         name=spec.name if spec else "NVIDIA GeForce RTX 3090"))
    machine = Machine.detect(cfg)
    if machine.gpu_count == 0 and cfg.parallel.device != "cpu":
        raise MobiusError("this machine has no CUDA GPU to plan for; plan for a server with --topology FILE "
                          "(mobius topo --json, or saved nvidia-smi topo -m) or --gpus N, or set "
                          "parallel.device=cpu to plan CPU worker processes")
    return machine


def run(args: argparse.Namespace) -> int:
    """Carry out ``mobius plan``; user-facing problems raise :class:`MobiusError`."""
    cfg = load_config(args.config, args.overrides)
    if args.gpus is not None:
        if args.gpus < 1:
            raise ConfigError(f"--gpus must be at least 1, got {args.gpus}")
        cfg.parallel.devices = args.gpus
    zero = cfg.parallel.mode == "zero"
    if not zero:
        cfg.parallel.mode = "pipeline"  # the plan of the pipeline, whatever other mode the run file picks
    elif args.trace or args.timeline:
        raise ConfigError("--trace and --timeline draw the pipeline's simulated step; parallel.mode=zero has none")
    machine = _machine(cfg, args)
    if cfg.parallel.devices > max(1, machine.gpu_count) and machine.gpu_count:
        raise ConfigError(f"parallel.devices is {cfg.parallel.devices} but the topology has {machine.gpu_count} GPU(s)")
    settings = resolve(cfg, machine)
    planner = plan_zero if zero else plan_pipeline
    plan, prof, hw = planner(cfg, planned_architecture(cfg), settings, machine, args.bandwidth)
    sim = None
    if args.trace or args.timeline:
        sim = simulate(prof, plan.boundaries, hw, plan.slots, plan.micro_batches, plan.options)
    if args.trace:
        sim.write_chrome_trace(args.trace)
    if args.json:
        out = plan.to_json()
        out["profile"] = _profile_json(prof)
        out["model"] = _model_name(cfg)
        print(json.dumps(out))
    else:
        print(_report(cfg, prof, hw, plan))
        if args.timeline:
            print(sim.to_ascii(110))
        if args.trace:
            print(f"wrote {args.trace} (open it in https://ui.perfetto.dev)")
    return 0


def _model_name(cfg: Config) -> str:
    ck = cfg.model.checkpoint
    if ck and os.path.isdir(ck):
        return ck
    return cfg.model.preset or str(ck)


def _distinct(prof: Any) -> list[tuple[Any, int]]:
    """(unit, how many identical units) in model order."""
    out: dict[str, list] = {}
    for u in prof.units:
        out.setdefault(u.signature, [u, 0])[1] += 1
    return [(u, n) for u, n in out.values()]


def _profile_json(prof: Any) -> dict:
    units = [{"name": u.name, "kind": u.kind, "count": n, "fwd_s": u.fwd_s, "bwd_s": u.bwd_s,
              "param_bytes": u.param_bytes, "act_bytes": u.act_bytes, "saved_bytes": u.saved_bytes,
              "work_bytes": u.work_bytes} for u, n in _distinct(prof)]
    return {"source": prof.source, "device": prof.device_name, "micro_batch_size": prof.micro_batch_size,
            "seq_len": prof.seq_len, "precision": prof.precision, "profile_s": prof.profile_s, "units": units,
            "notes": prof.notes}


def _report(cfg: Config, prof: Any, hw: Any, plan: Any) -> str:
    how = (f"estimated for {prof.device_name} ({100 * prof.notes.get('compute_efficiency', 0):.0f}% of "
           f"{prof.notes.get('tflops', 0):.1f} TFLOP/s)" if prof.source == "estimated"
           else f"measured on {prof.device_name} in {prof.profile_s:.1f} s")
    lines = [f"model: {_model_name(cfg)}: {prof.num_units} units, {prof.param_count() / 1e9:.2f} B parameters "
             f"({prof.param_bytes() / GB:.1f} GB in {prof.precision}); micro-batch {prof.micro_batch_size} x "
             f"{prof.seq_len} tokens, {plan.micro_batches} micro-batches",
             f"hardware: {hw.describe()}",
             f"profile: {how}; per micro-batch:"]
    for u, n in _distinct(prof):
        lines.append(f"  {u.kind:<6} x{n:<3} fwd {u.fwd_s * 1e3:8.2f} ms  bwd {u.bwd_s * 1e3:8.2f} ms  params "
                     f"{u.param_bytes / GB:6.3f} GB  output {u.act_bytes / 1e6:8.2f} MB  saved "
                     f"{u.saved_bytes / 1e6:8.1f} MB")
    return "\n".join(lines + [plan.summary()])
