"""The Mobius paper's partition, topology and mapping experiments (§4.3, §4.4), in simulation.

Hardware as in the paper's §4: RTX 3090 Ti GPUs (24 GB), four GPUs per CPU root complex behind a
PCIe switch, no P2P; Table 3's GPT-like models at sequence 512 in fp16 (updates after the global
norm, as fp16 loss scaling needs), at Table 3's micro-batch sizes; as many micro-batches as GPUs
(§3.1). Unit costs are *estimated* from the 3090 Ti datasheet (no GPU needed). Every plan is made by
``plan_model`` (the MIP to within ``GAP``, the residency pass unless said otherwise, the re-plan
under contention) and scored by the same simulator.

* ``baselines`` (Fig. 9): Topo 2+2, the MIP's plan against minimum-stage, maximum-stage and
  time-balanced partitions.
* ``topologies``: Topo 4, 2+2 and 1+3 (15B; 8B and 15B without the optimizer): the plan the
  contention-free MIP makes, and the plan after re-planning at the transfer rates its simulated step
  reached (the step with contention).
* ``mapping`` (Fig. 10): 8 GPUs, 4+4: the paper's pipeline (every stage swapped) planned for cross
  mapping, simulated under cross and sequential mapping, with two device slots and with one.
* ``regimes``: a synthetic sweep (identical blocks, one per stage, no optimizer) over how long a
  stage's upload takes against its forward, prefetch room, upload ordering and boxes.

Hardware readings (see docs/perf-paper.md): ``paper`` (13.1 GB/s per GPU and per switch uplink:
the paper's measured maximum; the host's CPU AdamW at 4 G parameters/s for all workers together),
``no-optimizer`` (the CPU update's time left out) and ``x8-uplink`` (the uplink is PCIe 3.0 x8,
6.55 GB/s shared by the switch's GPUs; no optimizer).

Usage: python bench/paper_sim.py [--out runs/bench_paper_sim.json] [--only SECTION ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mobius.models import unit_specs  # noqa: E402
from mobius.models.gpt2 import GPT2Config  # noqa: E402
from partition import (Hardware, ModelProfile, PipelineOptions, PlanRequest, UnitCost, estimate_units,  # noqa: E402
                       plan_model, simulate)
from partition.hardware import PAPER_LINK_Bps  # noqa: E402
from topology import cross_mapping  # noqa: E402

SEQ = 512
GAP = 0.02  # the MIP's optimality gap: the comparisons below are at the level of several percent
TIME_LIMIT_S = 15.0  # per plan; a plan cut short says so in its status


@dataclass(frozen=True)
class PaperModel:
    name: str
    hidden: int
    layers: int
    heads: int
    mbs: int


TABLE3 = [PaperModel("3B", 2048, 64, 32, 2), PaperModel("8B", 4096, 40, 32, 2),
          PaperModel("15B", 5120, 40, 64, 1), PaperModel("51B", 9216, 50, 72, 1)]  # Table 3 says 80 heads; 9216 is not divisible by 80 (72: OPT-66B)
NO_OPTIMIZER = 1e15  # parameters/s: the CPU update takes no time
VARIANTS = {
    "paper": dict(uplink_Bps=PAPER_LINK_Bps),
    "no-optimizer": dict(uplink_Bps=PAPER_LINK_Bps, cpu_adam_params_per_s=NO_OPTIMIZER),
    "x8-uplink": dict(uplink_Bps=PAPER_LINK_Bps / 2, cpu_adam_params_per_s=NO_OPTIMIZER),
}
TOPOLOGIES = {"4": [[0, 1, 2, 3]], "2+2": [[0, 1], [2, 3]], "1+3": [[0], [1, 2, 3]]}


def profile_of(model: PaperModel, mbs: int) -> ModelProfile:
    cfg = GPT2Config(n_embd=model.hidden, n_layer=model.layers, n_head=model.heads, n_positions=1024,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return estimate_units(unit_specs(cfg), mbs, SEQ, "fp16", "rtx3090ti")


def plan(prof: ModelProfile, hw: Hardware, micro_batches: int, **kw):
    """``plan_model`` as every experiment here runs it (fp16: updates after the global norm); ``kw``:
    the rest of the :class:`PlanRequest`."""
    return plan_model(prof, hw, PlanRequest(micro_batches=micro_batches, barrier=True, rel_gap=GAP,
                                            time_limit_s=TIME_LIMIT_S, **kw))


PLANS_2X2: dict[tuple[str, str], tuple] = {}  # (model, variant) -> (plan, seconds): Fig. 9's plans, reused


def mip_vs_baselines(model: PaperModel, variant: str) -> dict:
    """Fig. 9 setting: Topo 2+2, 4 micro-batches."""
    hw = Hardware.paper_3090ti(groups=TOPOLOGIES["2+2"], **VARIANTS[variant])
    t0 = time.perf_counter()
    p = plan(profile_of(model, model.mbs), hw, 4)
    PLANS_2X2[(model.name, variant)] = (p, time.perf_counter() - t0)
    row = {"model": model.name, "mbs": model.mbs, "variant": variant, "mip_s": p.predicted_step_s,
           "mip_model_s": p.model_step_s, "mip_stages": p.num_stages, "status": p.status,
           "plan_s": time.perf_counter() - t0, "resident": len(p.options.resident), "kept": len(p.options.kept),
           "traffic_x_fp32_params": p.traffic["x_fp32_param_bytes"],
           "baseline_adopted": p.mip.baseline_adopted.name if p.mip.baseline_adopted else None}  # lost to a baseline
    for name, t in p.baselines.items():
        row[name] = t
        row[f"{name}_stages"] = len(p.baseline_boundaries[name]) - 1 if p.baseline_boundaries[name] else None
        row[f"{name}_reduction"] = 1 - p.predicted_step_s / t if t else None
    return row


def topology_plans(model: PaperModel, variant: str, topo: str) -> dict:
    """The contention-free MIP's plan and the plan re-planned at the simulated rates, on one topology
    (Topo 2+2: Fig. 9's plan)."""
    hw = Hardware.paper_3090ti(groups=TOPOLOGIES[topo], **VARIANTS[variant])
    t0 = time.perf_counter()
    p, seconds = PLANS_2X2.get((model.name, variant), (None, 0.0)) if topo == "2+2" else (None, 0.0)
    if p is None:
        p = plan(profile_of(model, model.mbs), hw, 4, with_baselines=False)
        seconds = time.perf_counter() - t0
    tried = p.mip.contention_plans
    free, adopted = tried[0], p.mip.simulated_rates_GBps is not None
    return {"model": model.name, "variant": variant, "topology": topo, "free_stages": len(free["boundaries"]) - 1,
            "free_model_s": free["model_step_s"], "free_sim_s": free["simulated_step_s"], "replanned": len(tried) > 1,
            "adopted": adopted, "new_partition": p.boundaries != free["boundaries"],
            "new_residency": (sorted(p.options.resident), sorted(p.options.kept)) != (free["resident"], free["kept"]),
            "stages": p.num_stages,
            "model_s": p.model_step_s, "sim_s": p.predicted_step_s,
            "gain": 1 - p.predicted_step_s / free["simulated_step_s"], "plan_s": seconds}


def cross_vs_sequential(model: PaperModel, variant: str, prefetch: bool) -> dict:
    """Fig. 10 setting: 8 GPUs, four per root complex, 8 micro-batches; the paper's pipeline (no
    resident or kept stages) planned for cross mapping, its partition simulated under both."""
    hw = Hardware.paper_3090ti(groups=[[0, 1, 2, 3], [4, 5, 6, 7]], **VARIANTS[variant])
    prof = profile_of(model, model.mbs)
    t0 = time.perf_counter()
    p = plan(prof, hw, 8, with_baselines=False, prefetch=prefetch, resident=[], kept=[], contention_rounds=0)
    seq = simulate(prof, p.boundaries, hw, list(range(8)), 8, p.options, record=False).step_s
    stage = prof.units[1]
    return {"model": model.name, "variant": variant, "slots": p.options.num_slots, "stages": p.num_stages,
            "cross_s": p.predicted_step_s, "sequential_s": seq, "reduction": 1 - p.predicted_step_s / seq,
            "upload_x_fwd": stage.param_bytes / PAPER_LINK_Bps / stage.fwd_s, "cross_worker_gpus": p.worker_gpus,
            "plan_s": time.perf_counter() - t0}


def regime(groups: list[list[int]], upload_x_fwd: float, slots: int, sharing: str) -> dict:
    """One block per stage, 4 stages per GPU, activations negligible: how much cross mapping saves
    when a stage's upload takes ``upload_x_fwd`` times its forward pass (on one link alone)."""
    n = sum(len(g) for g in groups)
    fwd, link = 0.01, PAPER_LINK_Bps
    blocks = 4 * n - 2
    param_bytes = upload_x_fwd * fwd * link
    prof = ModelProfile([UnitCost("embed", "embed", "e", 1000, 1e-4, 3e-4, 2000, 2000, 4096, 4096, 0, 0)]
                        + [UnitCost(f"block.{i}", "block", "b", int(param_bytes / 2), fwd, 3 * fwd, int(param_bytes),
                                    int(param_bytes), 4096, 4096, 0, 0) for i in range(blocks)]
                        + [UnitCost("head", "head", "h", 1000, 1e-4, 3e-4, 2000, 2000, 4096, 4096, 0, 0)],
                        1, 512, "fp16", "synthetic", "estimated")
    hw = Hardware.uniform(n, 64 * 2**30, link, groups=groups, cpu_adam_params_per_s=NO_OPTIMIZER)
    bounds = [0, 2] + list(range(3, blocks + 1)) + [blocks + 2]
    options = PipelineOptions(num_slots=slots)
    cross = cross_mapping(groups, len(bounds) - 1).worker_gpus
    t = {name: simulate(prof, bounds, hw, list(order), n, options, sharing, record=False).step_s
         for name, order in (("cross", cross), ("sequential", range(n)))}
    return {"box": "+".join(str(len(g)) for g in groups), "upload_x_fwd": upload_x_fwd, "slots": slots,
            "sharing": sharing, "load": len(groups[0]) * upload_x_fwd / n, "cross_s": t["cross"],
            "sequential_s": t["sequential"], "reduction": 1 - t["cross"] / t["sequential"]}


def _pct(x: float | None) -> str:
    return "  n/a" if x is None else f"{100 * x:5.1f}%"


def print_baselines(rows: list[dict]) -> None:
    print("MIP vs baselines, Topo 2+2, 4 micro-batches (simulated step, s; reduction = 1 - MIP / baseline)")
    print(f"{'variant':<13}{'model':>5}{'mbs':>4}{'MIP':>8}{'S':>4}{'res':>4}{'kept':>5}{'min-stage':>11}"
          f"{'max-stage':>11}{'balanced':>11}   reduction vs min / max / balanced    plan  status")
    for r in rows:
        cells = "".join(f"{r[k]:>11.3f}" if r[k] else f"{'no fit':>11}"
                        for k in ("minimum-stage", "maximum-stage", "time-balanced"))
        red = " / ".join(_pct(r[f"{k}_reduction"]) for k in ("minimum-stage", "maximum-stage", "time-balanced"))
        print(f"{r['variant']:<13}{r['model']:>5}{r['mbs']:>4}{r['mip_s']:>8.3f}{r['mip_stages']:>4}{r['resident']:>4}"
              f"{r['kept']:>5}{cells}   {red}  {r['plan_s']:5.1f}s  {r['status']}"
              + (f" (the search lost to the {r['baseline_adopted']} baseline: planned with it)"
                 if r["baseline_adopted"] else ""))


def print_topologies(rows: list[dict]) -> None:
    print("\nThe plan on the paper's topologies, 4 GPUs, 4 micro-batches: contention-free MIP, then re-planned at the "
          "simulated rates (S, model s / simulated s)")
    print(f"{'variant':<13}{'model':>5}{'topo':>5}   {'contention-free':<24}{'re-planned':<24}{'gain':>7}  "
          f"{'what changed':<22}plan")
    for r in rows:
        free = f"{r['free_stages']:>3}  {r['free_model_s']:.3f} / {r['free_sim_s']:.3f}"
        again = (f"{r['stages']:>3}  {r['model_s']:.3f} / {r['sim_s']:.3f}" if r["adopted"]
                 else "   (not faster)" if r["replanned"] else "   (not needed)")
        what = " + ".join(k for k, on in (("partition", r["new_partition"]), ("residency", r["new_residency"])) if on)
        print(f"{r['variant']:<13}{r['model']:>5}{r['topology']:>5}   {free:<24}{again:<24}{_pct(r['gain']):>7}  "
              f"{what or '-':<22}{r['plan_s']:5.1f}s")


def print_mapping(rows: list[dict]) -> None:
    print("\nCross vs sequential mapping, 8 GPUs (4+4), 8 micro-batches, every stage swapped (simulated step, s)")
    print(f"{'variant':<13}{'model':>5}{'upload/fwd':>11}{'slots':>6}{'S':>4}{'cross':>9}{'sequential':>11}"
          f"{'reduction':>10}   plan")
    for r in rows:
        print(f"{r['variant']:<13}{r['model']:>5}{r['upload_x_fwd']:>11.1f}{r['slots']:>6}{r['stages']:>4}"
              f"{r['cross_s']:>9.3f}{r['sequential_s']:>11.3f}{_pct(r['reduction']):>10}   {r['plan_s']:5.1f}s")
    print("cross mapping (GPU of each worker):", rows[0]["cross_worker_gpus"] if rows else "-")


def print_regimes(rows: list[dict]) -> None:
    print("\nWhere cross mapping pays (one block per stage, no optimizer; load = a root complex's uploads per step "
          "over the forward time that should hide them)")
    print(f"{'box':>5}{'upload/fwd':>11}{'load':>6}{'slots':>6}{'sharing':>10}{'cross s':>9}{'seq s':>9}  reduction")
    for r in rows:
        print(f"{r['box']:>5}{r['upload_x_fwd']:>11.2f}{r['load']:>6.2f}{r['slots']:>6}{r['sharing']:>10}"
              f"{r['cross_s']:>9.3f}{r['sequential_s']:>9.3f}  {_pct(r['reduction'])}")


SECTIONS = ("baselines", "topologies", "mapping", "regimes")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/bench_paper_sim.json", help="where to write the results as JSON")
    parser.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS), help="the sections to run")
    args = parser.parse_args()
    t0 = time.perf_counter()
    out: dict[str, list[dict]] = {}
    if "baselines" in args.only:
        out["baselines"] = [mip_vs_baselines(m, v) for v in ("paper", "no-optimizer") for m in TABLE3]
        print_baselines(out["baselines"])
    if "topologies" in args.only:
        out["topologies"] = [topology_plans(m, v, t) for m, v in ((TABLE3[2], "paper"), (TABLE3[1], "no-optimizer"),
                                                                 (TABLE3[2], "no-optimizer")) for t in TOPOLOGIES]
        print_topologies(out["topologies"])
    if "mapping" in args.only:
        out["mapping"] = [cross_vs_sequential(m, v, pre) for v in VARIANTS for m in TABLE3
                          for pre in ((True, False) if v == "no-optimizer" else (True,))]
        print_mapping(out["mapping"])
    if "regimes" in args.only:
        out["regimes"] = [regime(g, r, k, sh) for g in ([[0, 1], [2, 3]], [[0, 1, 2, 3], [4, 5, 6, 7]])
                          for r in (0.5, 1.0, 2.0, 4.0, 8.0) for k in (2, 1) for sh in ("priority", "fair")]
        print_regimes(out["regimes"])
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(f"\nwrote {args.out} in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
