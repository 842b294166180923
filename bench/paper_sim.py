"""The Mobius paper's partition and mapping experiments (§4.3, §4.4), in simulation.

Hardware as in the paper's §4: RTX 3090 Ti GPUs (24 GB), four GPUs per CPU root complex behind a
PCIe switch, no P2P; Table 3's GPT-like models at sequence 512 in mixed precision; as many
micro-batches as GPUs (§3.1). Unit costs are *estimated* from the 3090 Ti datasheet (no GPU needed).

* MIP vs baselines (Fig. 9): Topo 2+2 (4 GPUs), MIP plan vs minimum-stage, maximum-stage and
  time-balanced partitions, every plan scored by the same simulator (contention included).
* Cross vs sequential mapping (Fig. 10): 8 GPUs, 4+4, the MIP plan under each mapping, with the
  runtime's priority-ordered uploads and with fair sharing, with two device slots and with one.
* Where cross mapping pays: a synthetic sweep (identical blocks, one per stage) over how long a
  stage's upload takes against its forward, prefetch room (two slots or one), upload ordering
  (priority or fair) and boxes (2+2, 4+4), cross vs sequential on the same partition.

Each experiment runs under three hardware readings (see partition/README.md): ``paper`` (13.1 GB/s
per GPU and per switch uplink: the paper's measured maximum), ``x8-uplink`` (the uplink is PCIe 3.0
x8, 6.55 GB/s, shared), and ``no-optimizer`` (paper, with the CPU optimizer's time left out).

Usage: python bench/paper_sim.py [--out runs/bench_paper_sim.json] [--quick] [--regimes-only]
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
from partition import (Hardware, ModelProfile, PipelineOptions, UnitCost, estimate_units, plan_model,  # noqa: E402
                       simulate)
from partition.hardware import PAPER_LINK_Bps  # noqa: E402
from topology import cross_mapping  # noqa: E402

SEQ = 512


@dataclass(frozen=True)
class PaperModel:
    name: str
    hidden: int
    layers: int
    heads: int
    mbs: int


TABLE3 = [PaperModel("3B", 2048, 64, 32, 2), PaperModel("8B", 4096, 40, 32, 2),
          PaperModel("15B", 5120, 40, 64, 1), PaperModel("51B", 9216, 50, 72, 1)]  # Table 3 says 80 heads; 9216 is not divisible by 80 (72: OPT-66B)
VARIANTS = {
    "paper": dict(uplink_Bps=PAPER_LINK_Bps),
    "x8-uplink": dict(uplink_Bps=PAPER_LINK_Bps / 2),
    "no-optimizer": dict(uplink_Bps=PAPER_LINK_Bps, cpu_adam_params_per_s=1e15),
}


def profile_of(model: PaperModel, mbs: int):
    cfg = GPT2Config(n_embd=model.hidden, n_layer=model.layers, n_head=model.heads, n_positions=1024,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return estimate_units(unit_specs(cfg), mbs, SEQ, "fp16", "rtx3090ti")


def uncontended(hw: Hardware) -> Hardware:
    """The same GPUs with a root complex each: nothing shares an uplink."""
    n = hw.num_gpus
    return Hardware.uniform(n, hw.gpu_memory_bytes, min(hw.h2d_Bps[0], hw.rc_h2d_Bps[0]),
                            cpu_adam_params_per_s=hw.cpu_adam_params_per_s, name="uncontended")


def mip_vs_baselines(model: PaperModel, mbs: int, variant: str) -> dict:
    """Fig. 9 setting: Topo 2+2, 4 micro-batches."""
    hw = Hardware.paper_3090ti(groups=[[0, 1], [2, 3]], **VARIANTS[variant])
    prof = profile_of(model, mbs)
    t0 = time.perf_counter()
    plan = plan_model(prof, hw, micro_batches=4, mapping="cross")
    free = simulate(prof, plan.boundaries, uncontended(hw), plan.worker_gpus, 4, plan.options, record=False).step_s
    row = {"model": model.name, "mbs": mbs, "variant": variant, "mip_s": plan.predicted_step_s,
           "mip_model_s": plan.model_step_s, "sim_uncontended_s": free, "mip_stages": plan.num_stages,
           "solver": plan.solver,
           "solve_s": plan.solve_s, "gap": plan.gap, "plan_s": time.perf_counter() - t0,
           "traffic_x_fp32_params": plan.traffic["x_fp32_param_bytes"]}
    for name, t in plan.baselines.items():
        row[name] = t
        row[f"{name}_stages"] = len(plan.baseline_boundaries[name]) - 1 if plan.baseline_boundaries[name] else None
        row[f"{name}_reduction"] = 1 - plan.predicted_step_s / t if t else None
    return row


def cross_vs_sequential(model: PaperModel, mbs: int, variant: str, sharing: str = "priority",
                        prefetch: bool = True) -> dict:
    """Fig. 10 setting: 8 GPUs, four per root complex, 8 micro-batches. The MIP's partition is
    simulated under both mappings (everything else the same); ``replanned_s`` plans anew for the
    sequential mapping."""
    hw = Hardware.paper_3090ti(groups=[[0, 1, 2, 3], [4, 5, 6, 7]], **VARIANTS[variant])
    prof = profile_of(model, mbs)
    cross = plan_model(prof, hw, micro_batches=8, mapping="cross", with_baselines=False, sharing=sharing,
                       prefetch=prefetch)
    seq = simulate(prof, cross.boundaries, hw, list(range(8)), 8, cross.options, sharing, record=False).step_s
    replanned = plan_model(prof, hw, micro_batches=8, mapping="sequential", with_baselines=False, sharing=sharing,
                           prefetch=prefetch)
    return {"model": model.name, "mbs": mbs, "variant": variant, "sharing": sharing, "slots": cross.num_slots,
            "cross_s": cross.predicted_step_s, "sequential_s": seq,
            "replanned_sequential_s": replanned.predicted_step_s, "cross_worker_gpus": cross.worker_gpus,
            "stages": cross.num_stages, "reduction": 1 - cross.predicted_step_s / seq}


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
    hw = Hardware.uniform(n, 64 * 2**30, link, groups=groups, cpu_adam_params_per_s=1e15)
    bounds = [0, 2] + list(range(3, blocks + 1)) + [blocks + 2]
    options = PipelineOptions(num_slots=slots)
    cross = cross_mapping(groups, len(bounds) - 1).worker_gpus
    t = {name: simulate(prof, bounds, hw, list(order), n, options, sharing, record=False).step_s
         for name, order in (("cross", cross), ("sequential", range(n)))}
    per_gpu_forward = sum(u.fwd_s for u in prof.units[1:-1]) / n * n  # its stages, every micro-batch
    return {"box": "+".join(str(len(g)) for g in groups), "upload_x_fwd": upload_x_fwd, "slots": slots,
            "sharing": sharing, "cross_s": t["cross"], "sequential_s": t["sequential"],
            "reduction": 1 - t["cross"] / t["sequential"],
            "saved_x_forward": (t["sequential"] - t["cross"]) / per_gpu_forward}


def _pct(x: float | None) -> str:
    return "  n/a" if x is None else f"{100 * x:5.1f}%"


def print_tables(fig9: list[dict], fig10: list[dict]) -> None:
    print("MIP vs baselines, Topo 2+2, 4 micro-batches (simulated step time; reduction = 1 - MIP/baseline)")
    print(f"{'variant':<13}{'model':>5}{'mbs':>4}{'MIP s':>8}{'S':>4}{'min-stage':>11}{'max-stage':>11}"
          f"{'balanced':>11}   reduction vs min / max / balanced   solve  MIP model / uncontended sim")
    for r in fig9:
        cells = "".join(f"{r[k]:>11.3f}" if r[k] else f"{'no fit':>11}"
                        for k in ("minimum-stage", "maximum-stage", "time-balanced"))
        red = " / ".join(_pct(r[f"{k}_reduction"]) for k in ("minimum-stage", "maximum-stage", "time-balanced"))
        print(f"{r['variant']:<13}{r['model']:>5}{r['mbs']:>4}{r['mip_s']:>8.3f}{r['mip_stages']:>4}{cells}   "
              f"{red}  {r['solve_s']:5.1f}s  {r['mip_model_s']:.3f} / {r['sim_uncontended_s']:.3f}")
    print("\nCross vs sequential mapping, 8 GPUs (4+4), 8 micro-batches")
    print(f"{'variant':<13}{'model':>5}{'mbs':>4}{'sharing':>10}{'slots':>6}{'cross s':>9}{'seq s':>9}{'S':>4}  "
          f"reduction  re-planned seq s")
    for r in fig10:
        print(f"{r['variant']:<13}{r['model']:>5}{r['mbs']:>4}{r['sharing']:>10}{r['slots']:>6}{r['cross_s']:>9.3f}"
              f"{r['sequential_s']:>9.3f}{r['stages']:>4}  {_pct(r['reduction'])}     {r['replanned_sequential_s']:.3f}")
    print("cross mapping (GPU of each worker):", fig10[0]["cross_worker_gpus"] if fig10 else "-")


def print_regimes(rows: list[dict]) -> None:
    print("\nWhere cross mapping pays (one block per stage, activations negligible; saved = step time saved / one "
          "GPU's forward pass over all micro-batches)")
    print(f"{'box':>5}{'upload/fwd':>11}{'slots':>6}{'sharing':>10}{'cross s':>9}{'seq s':>9}  reduction  saved")
    for r in rows:
        print(f"{r['box']:>5}{r['upload_x_fwd']:>11.2f}{r['slots']:>6}{r['sharing']:>10}{r['cross_s']:>9.3f}"
              f"{r['sequential_s']:>9.3f}  {_pct(r['reduction'])}   {100 * r['saved_x_forward']:5.1f}%")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/bench_paper_sim.json", help="where to write the results as JSON")
    parser.add_argument("--quick", action="store_true", help="only the paper variant")
    parser.add_argument("--regimes-only", action="store_true", help="only the synthetic sweep")
    args = parser.parse_args()
    variants = ["paper"] if args.quick else list(VARIANTS)
    regimes = [regime(g, r, k, sh) for g in ([[0, 1], [2, 3]], [[0, 1, 2, 3], [4, 5, 6, 7]])
               for r in (0.5, 1.0, 2.0, 4.0) for k in (2, 1) for sh in ("priority", "fair")]
    fig9, fig10 = [], []
    if not args.regimes_only:
        fig9 = [mip_vs_baselines(m, mbs, v) for v in variants for m in TABLE3 for mbs in sorted({m.mbs, 1, 4})]
        fig10 = [cross_vs_sequential(m, mbs, v, sh, pre) for v in variants for m in TABLE3 for mbs in (1, 2)
                 for sh in ("priority", "fair") for pre in (True, False)]
        print_tables(fig9, fig10)
    print_regimes(regimes)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"mip_vs_baselines": fig9, "cross_vs_sequential": fig10, "regimes": regimes}, indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
