"""``mobius plan CONFIG``: which mode runs, how the model will be cut, placed or chunked, and what a step
will cost.

Examples::

    mobius plan configs/finetune-opt-13b.yaml --topology topo_m.txt     # saved `nvidia-smi topo -m` of the server
    mobius plan configs/finetune-opt-13b.yaml --topology box.json --bandwidth topology_bandwidth.json
    mobius plan configs/finetune-opt-13b.yaml --gpus 4 --json           # a synthetic 2+2 box of partition.gpu
    mobius plan run.yaml --trace plan.json                              # timeline for https://ui.perfetto.dev
    mobius plan run.yaml --parallel.mode=zero --gpus 2                  # zero mode: chunks, rCache, GPU/CPU split
    mobius plan run.yaml --parallel.mode=auto --topology dgx.txt --nodes 2 --parallel.devices=16   # two 8-GPU nodes

It shows the plan of ``parallel.mode``: the pipeline's (stages, mapping, predicted step, baselines),
zero's (chunk size, rCache blocks, chunks on the GPU and offloaded, predicted step and memory, the
rCache-min / rCache-max / all-offload alternatives) or single's (plain training: predicted step and
whether it fits). With ``parallel.mode: auto`` it first prints auto's comparison -- every mode's
predicted step, whether it fits, the choice and why -- then the chosen mode's plan, exactly what
``mobius train`` would run.

Config keys read (``tests/test_docs.py`` checks that each is a key of :class:`mobius.config.Config` and that the
plans it makes of a few runs read no other; ``*``: every key of the section):

    model: checkpoint, preset, dropout, activation_checkpointing, router_aux_loss_coef
    data: path, format, text_field, chat_template, train_on, packing, truncation, seq_len, tokenizer,
        val_fraction, cache_dir
    train: micro_batch_size, micro_batches, precision, grad_clip, seed, update, optimizer_states
    parallel: mode, devices, device, mapping, prefetch, p2p, offload_inputs, schedule, stages, resident_stages,
        kept_stages, grad_download, cpu_threads, cpu_pinning
    partition: *
    zero: *
    lora: *
    topology: *

The data keys matter for packed conversations: the plan profiles attention within documents of their mean length
(the data prepared as ``mobius train`` prepares it), unless partition.document_tokens says it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from typing import Any

from mobius.app.planning import ModeChoice, plan_run, profile_line
from mobius.app.settings import Machine
from mobius.assemble import planned_architecture, planned_document_tokens
from mobius.config import Config, load_config
from mobius.errors import ConfigError, MobiusError
from mobius.models import preset_names
from mobius.models.lora import LoraSpec
from partition import ScheduleComparison, simulate
from partition.costs import ModelProfile
from partition.gpus import GB, gpu_spec

log = logging.getLogger(__name__)


def configure(p: argparse.ArgumentParser) -> None:
    """The ``plan`` sub-command's arguments."""
    p.description = ("Profile (or estimate) the model's units and plan the run's mode: the pipeline's partition MIP, "
                     "mapping and simulated step with baselines, zero's chunk search, or single's plain training; "
                     "parallel.mode=auto compares them and picks one. Any configuration key can be overridden with "
                     "--section.key=value.")
    p.epilog = "model.preset names an architecture before its checkpoint is at hand: " + ", ".join(preset_names()) + "."
    p.add_argument("config", help="YAML run file (see configs/)")
    p.add_argument("--topology", metavar="FILE", help="saved topology: `mobius topo --json` output or "
                                                      "`nvidia-smi topo -m` text (default: topology.file, else detect)")
    p.add_argument("--bandwidth", metavar="FILE", help="bandwidth JSON from `mobius topo --bench` "
                                                       "(default: topology.bandwidth_file)")
    p.add_argument("--gpus", type=int, metavar="N", help="plan for a synthetic box of N GPUs of model partition.gpu "
                                                         "in two root complexes (when no topology is given)")
    p.add_argument("--nodes", type=int, default=1, metavar="N",
                   help="plan a torchrun run over N machines like this one (parallel.devices counts the ranks of "
                        "all of them, like torchrun's world size)")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    p.add_argument("--trace", metavar="FILE", help="write the simulated step as Chrome-trace JSON (Perfetto)")
    p.add_argument("--timeline", action="store_true", help="also print the step: the pipeline's simulated step as a "
                                                           "text grid, or zero mode's program of operators and chunks")
    p.set_defaults(func=run, accepts_overrides=True)


def _machine(cfg: Config, args: argparse.Namespace) -> Machine:
    """The machine planned for: a saved topology, a synthetic box of ``--gpus``, or this one."""
    import topology

    path = args.topology or cfg.topology.file
    if path:
        return Machine.saved(topology.load_topology(path), nodes=args.nodes)
    if args.gpus:
        spec = gpu_spec(cfg.partition.gpu) if cfg.partition.gpu else None
        sizes = [args.gpus - args.gpus // 2, args.gpus // 2] if args.gpus > 1 else [1]
        return Machine.saved(topology.Topology.synthetic(sizes, memory_bytes=spec.memory_bytes if spec else 24 * 2**30,
                                                         name=spec.name if spec else "NVIDIA GeForce RTX 3090"),
                             nodes=args.nodes)
    machine = Machine.detect(cfg, nodes=args.nodes)
    if machine.gpu_count == 0 and cfg.parallel.device != "cpu":
        raise MobiusError("this machine has no CUDA GPU to plan for; plan for a server with --topology FILE "
                          "(mobius topo --json, or saved nvidia-smi topo -m) or --gpus N, or set "
                          "parallel.device=cpu to plan CPU worker processes")
    return machine


def run(args: argparse.Namespace) -> int:
    """Carry out ``mobius plan``; user-facing problems raise :class:`MobiusError`."""
    cfg = load_config(args.config, args.overrides)
    if args.nodes < 1:
        raise ConfigError(f"--nodes must be at least 1, got {args.nodes}")
    if args.gpus is not None:
        if args.gpus < 1:
            raise ConfigError(f"--gpus must be at least 1, got {args.gpus}")
        cfg.parallel.devices = args.gpus * args.nodes
    machine = _machine(cfg, args)
    per_node = cfg.parallel.devices // args.nodes
    if machine.gpu_count and per_node > machine.gpu_count:
        raise ConfigError(f"parallel.devices is {cfg.parallel.devices} but the topology has {machine.gpu_count} GPU(s)"
                          + (f" per node ({args.nodes} nodes)" if args.nodes > 1 else ""))
    model_cfg = planned_architecture(cfg)
    cfg = planned_document_tokens(cfg)
    choice = plan_run(cfg, model_cfg, machine, args.bandwidth, plan_single=True)
    chosen = choice.chosen
    if args.trace and choice.mode != "pipeline" or args.timeline and choice.mode == "single":
        raise ConfigError(f"--trace draws the pipeline's simulated step and --timeline the pipeline's or zero mode's "
                          f"step; the run's mode is {choice.mode} (set --parallel.mode=pipeline or zero)")
    sim = None
    if choice.mode == "pipeline" and (args.trace or args.timeline):
        plan = chosen.plan.swapped
        sim = simulate(chosen.profile, plan.boundaries, chosen.hardware, plan.worker_gpus, plan.micro_batches, plan.options)
    if args.trace:
        sim.write_chrome_trace(args.trace)
    if args.json:
        out = chosen.plan.to_json()
        out.update(mode=choice.to_json(), profile=_profile_json(chosen.profile), model=_model_name(cfg),
                   host=chosen.host_resources())
        print(json.dumps(out))
    else:
        print(_report(cfg, model_cfg, choice))
        if args.timeline:
            print(sim.to_ascii(110) if sim is not None else _zero_program(chosen.plan, model_cfg))
        if args.trace:
            print(f"wrote {args.trace} (open it in https://ui.perfetto.dev)")
    return 0


def _zero_program(plan: Any, model_cfg: Any) -> str:
    """Zero mode's step as its runtime runs it: each operator, the chunks it calls and reduces."""
    from mobius.layout import build_layout
    from mobius.models import unit_specs
    from mobius.models.params import model_params
    from partition.schedule.zero import program_timeline, train_program

    layout = build_layout(model_params(model_cfg), len(unit_specs(model_cfg)), plan.chunk_size, plan.world, plan.align)
    return program_timeline(train_program(layout.num_units), layout)


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


def _amount(n: float, unit: str = "") -> str:
    """``n`` with the largest decimal prefix that leaves at least 1, three significant digits: 6.55M, 1.42B
    (with ``unit="B"``: 3.63 MB, 5.68 GB)."""
    for scale, prefix in ((1e9, "G" if unit else "B"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.3g}{' ' if unit else ''}{prefix}{unit}"
    return f"{n:.0f}{' ' if unit else ''}{unit}"


def _lora_part(lora: LoraSpec | None, prof: ModelProfile) -> str:
    """", LoRA rank r on ...: N trainable (x%), M frozen" when the run trains adapters."""
    if lora is None:
        return ""
    frozen = sum(u.frozen_count for u in prof.units)
    total = prof.param_count()
    return (f", LoRA rank {lora.rank} on {' '.join(lora.targets)}: {_amount(total - frozen)} trainable "
            f"({100 * (total - frozen) / total:.2f}%), {_amount(frozen)} frozen")


def experts_line(model_cfg: Any, prof: ModelProfile) -> str | None:
    """What a mixture of experts' plan assumes ("experts: ..."), None for a dense model."""
    from mobius.models.experts import balance_of

    balance = balance_of(model_cfg)
    if balance is None:
        return None
    E, k = model_cfg.num_experts, model_cfg.num_experts_per_tok
    tokens = prof.micro_batch_size * prof.seq_len
    how = "timed" if prof.source in ("measured", "learnt") else "estimated"
    return (f"experts: {balance.layers} MoE layers of {E} experts, {k} per token: a layer's bytes are all {E} "
            f"experts', its FLOPs the {k} each token reaches; {how} with a micro-batch's {tokens * k:,} choices spread "
            f"evenly ({tokens * k / E:,.0f} tokens per expert, as a random router spreads them; a trained router "
            f"loads some experts more: metrics.jsonl's expert_share_max), one grouped matmul per projection; the "
            f"load-balancing loss at router_aux_loss_coef {model_cfg.router_aux_loss_coef:g}")


def _report(cfg: Config, model_cfg: Any, choice: ModeChoice) -> str:
    lora = model_cfg.lora
    chosen = choice.chosen
    prof, hw, plan = chosen.profile, chosen.hardware, chosen.plan
    head = [plan.headline()] if isinstance(plan, ScheduleComparison) else []
    lines = head + [choice.line() if choice.explicit else choice.table(),
             f"model: {_model_name(cfg)}: {prof.num_units} units, {_amount(prof.param_count())} parameters "
             f"({_amount(prof.param_bytes(), 'B')} in {prof.precision}){_lora_part(lora, prof)}; micro-batch "
             f"{prof.micro_batch_size} x "
             f"{prof.seq_len} tokens, {chosen.runs.micro_batches} micro-batches",
             f"hardware: {hw.describe()}",
             chosen.host_line(),
             f"profile: {profile_line(prof)}; per micro-batch:"]
    for u, n in _distinct(prof):
        lines.append(f"  {u.kind:<6} x{n:<3} fwd {u.fwd_s * 1e3:8.2f} ms  bwd {u.bwd_s * 1e3:8.2f} ms  params "
                     f"{u.param_bytes / GB:6.3f} GB  output {u.act_bytes / 1e6:8.2f} MB  saved "
                     f"{u.saved_bytes / 1e6:8.1f} MB")
    experts = experts_line(model_cfg, prof)
    return "\n".join(lines + ([experts] if experts else []) + [plan.summary()])
