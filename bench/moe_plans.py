"""What `mobius plan` predicts for the mixtures of experts of issue 67, on the boxes it names (predictions, not
measurements; the unit costs estimated from the GPUs' datasheets at 60% of their bf16 rate, every expert's bytes
and each token's k experts' FLOPs, tokens spread evenly over the experts as a random router spreads them):

* RoundPipe's 8 x 24 GB box (the round-robin bench's topology: 8 x RTX 4090 in two root complexes of four, no
  P2P; micro-batches of 4 x 2048 tokens, 16 per step, bf16, no clipping): Qwen3-30B-A3B and GPT-OSS-20B full
  fine-tuning, the swapped pipeline and the round-robin schedule, sync and delayed, beside RoundPipe's measured
  GPT-OSS-20B (12,549 sync / 18,122 delayed tokens/s, its artifact's exp/raw-data.csv; GPT-OSS at 2 x 2048
  tokens, 32 micro-batches: mobius's loss keeps the whole fp32 logits of its 201,088-token vocabulary, which at
  4 x 2048 do not fit beside the head on a 24 GB GPU); Qwen3-235B-A22B LoRA there (RoundPipe: 1,592 / 1,820),
  with the host memory it needs;
* the shipped 4 x RTX 3090 box (tests/fixtures/topology/topo2x2_sys.txt): configs/finetune-qwen3-30b-a3b-lora.yaml,
  Mixtral-8x7B with the same LoRA settings, and configs/finetune-gpt-oss-20b-lora.yaml, as the configs say
  (1 x 2048 tokens, 8 micro-batches, clipping at 1.0).

    python bench/moe_plans.py                  # every row (a few minutes on 2 cores)
    python bench/moe_plans.py --rows gpt-oss-20b-full --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mobius.app.planning import plan_pipeline  # noqa: E402
from mobius.app.settings import Machine, resolve  # noqa: E402
from mobius.assemble import planned_architecture  # noqa: E402
from mobius.config import load_config  # noqa: E402
from mobius.errors import MobiusError  # noqa: E402

GiB = 2**30
BOX8 = ROOT / "tests/fixtures/topology/topo8_4x4_nic.txt"
BOX4 = ROOT / "tests/fixtures/topology/topo2x2_sys.txt"
EIGHT = ["--parallel.devices=8", "--train.micro_batch_size=4", "--train.micro_batches=16", "--partition.gpu=rtx4090",
         "--parallel.schedule=auto", "--train.grad_clip=0", "--partition.time_limit_s=3"]
FULL = ["--lora.rank=0", "--parallel.mode=pipeline"]
QWEN_LORA = ROOT / "configs/finetune-qwen3-30b-a3b-lora.yaml"
ROWS = {  # name -> (config, overrides, topology, RoundPipe's measured sync / delayed tokens/s or None)
    "qwen3-30b-a3b-full": (QWEN_LORA, [*FULL, *EIGHT], BOX8, None),
    # mobius's head keeps the whole [tokens, 201,088] fp32 logits and their gradient (no chunked loss): at 4 x 2048
    # it needs 25.3 GB alone; 2 x 2048 tokens, 32 micro-batches keep the step's 131,072 tokens
    "gpt-oss-20b-full": (ROOT / "configs/finetune-gpt-oss-20b-lora.yaml",
                         [*FULL, *EIGHT, "--train.micro_batch_size=2", "--train.micro_batches=32"], BOX8,
                         (12549, 18122)),
    "qwen3-235b-a22b-lora": (QWEN_LORA, ["--model.preset=qwen3-235b-a22b", *EIGHT], BOX8, (1592, 1820)),
    "qwen3-30b-a3b-lora-4x3090": (QWEN_LORA, ["--parallel.devices=4"], BOX4, None),
    "mixtral-8x7b-lora-4x3090": (QWEN_LORA, ["--model.preset=mixtral-8x7b", "--parallel.devices=4",
                                             "--output.dir=runs/finetune-mixtral-8x7b-lora"], BOX4, None),
    "gpt-oss-20b-lora-4x3090": (ROOT / "configs/finetune-gpt-oss-20b-lora.yaml", ["--parallel.devices=4"], BOX4, None),
}


def plan_row(name: str) -> dict:
    """The plan of one row as `mobius plan` makes it, in numbers."""
    import topology

    config, overrides, topo, roundpipe = ROWS[name]
    cfg = load_config(str(config), overrides)
    machine = Machine.saved(topology.load_topology(str(topo)))
    t0 = time.perf_counter()
    planned, prof, hw = plan_pipeline(cfg, planned_architecture(cfg), resolve(cfg, machine, "pipeline", ""), machine)
    plan = planned.swapped
    tokens = cfg.train.micro_batches * cfg.train.micro_batch_size * cfg.data.seq_len
    other = plan.other_update.step_s if plan.other_update else None
    row = {"row": name, "gpus": hw.num_gpus, "micro_batches": cfg.train.micro_batches,
           "tokens_per_step": tokens, "grad_clip": cfg.train.grad_clip, "lora_rank": cfg.lora.rank,
           "stages": plan.num_stages, "swapped_step_s": plan.predicted_step_s,
           "swapped_tokens_per_s": tokens / plan.predicted_step_s, "update": cfg.train.update,
           "swapped_other_update_tokens_per_s": tokens / other if other else None,
           "host_gib": plan.host_bytes / GiB, "peak_gib": max(plan.peak_bytes) / GiB,
           "gpu_budget_gib": hw.gpu_memory_bytes / GiB, "plan_s": time.perf_counter() - t0,
           "roundpipe_measured_sync_delayed": roundpipe}
    rr = planned.round_robin
    if rr is not None:
        sync, delayed = ((rr.other_step_s, rr.predicted_step_s) if rr.options.delayed
                         else (rr.predicted_step_s, rr.other_step_s))
        row.update(round_robin_sync_tokens_per_s=tokens / sync, round_robin_delayed_tokens_per_s=tokens / delayed,
                   round_robin_host_gib=rr.host_bytes / GiB)
    elif planned.round_robin_error:
        row["round_robin_error"] = planned.round_robin_error
    return row


def line(r: dict) -> str:
    out = (f"{r['row']:<27} {r['gpus']} GPUs, {r['stages']} stages: swapped {r['swapped_tokens_per_s']:>8,.0f} tok/s "
           f"({r['update']})")
    if r["swapped_other_update_tokens_per_s"]:
        out += f", {r['swapped_other_update_tokens_per_s']:,.0f} the other rule"
    if "round_robin_sync_tokens_per_s" in r:
        out += (f"; round-robin sync {r['round_robin_sync_tokens_per_s']:,.0f} / delayed "
                f"{r['round_robin_delayed_tokens_per_s']:,.0f} (host {r['round_robin_host_gib']:.0f} GiB)")
    out += f"; peak {r['peak_gib']:.1f} of {r['gpu_budget_gib']:.1f} GiB, host {r['host_gib']:.1f} GiB"
    if r["roundpipe_measured_sync_delayed"]:
        out += " | RoundPipe measured {:,} / {:,}".format(*r["roundpipe_measured_sync_delayed"])
    return out + f"  [{r['plan_s']:.1f} s]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default=",".join(ROWS), help="comma-separated: " + ", ".join(ROWS))
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args()
    rows = []
    for name in a.rows.split(","):
        try:
            rows.append(plan_row(name))
        except MobiusError as e:  # a plan that does not fit says why, in one line
            rows.append({"row": name, "error": str(e)})
            print(f"{name:<27} {e}", flush=True)
            continue
        print(line(rows[-1]), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
