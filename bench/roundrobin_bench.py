"""The round-robin schedule (RoundPipe's class) against the swapped pipeline, in simulation, on RoundPipe's
own workloads: its RTX 4090 unit times, 8 x 24 GB GPUs in two root complexes of four, no P2P,
micro-batches of 4 x 2048 tokens, 16 per step, bf16. Both mobius figures come from the plans `mobius plan
--parallel.schedule=auto` makes; RoundPipe's are its artifact's (measured, and its simulator's).

Also the round-robin steady state with two of mobius's costs removed, to show where the difference from
RoundPipe's simulator goes: the fp32 gradient sums per micro-batch (``acc_s``), and the host links. And the
like-for-like comparison of the two cut choosers on the same unit times: RoundPipe's own cuts (its
``pp-simulate/run.sh``) simulated by mobius's simulator with mobius's costs, beside the cuts mobius's plan
chose; and both under RoundPipe's simulator's assumptions (the CPU update, the host links and the fp32 sums
free), where mobius's search chooses again (one step from empty GPUs, which is what RoundPipe's simulator
reports, and the delayed steady state). And the host's share: Llama-3.1-8B's round-robin plan at RoundPipe's
measured batch (64 micro-batches, 524,288 tokens per step), and each model's at 16 with a host four times the
default's CPU AdamW rate.

    python bench/roundrobin_bench.py                 # the three models, clipping off and at 1.0 (about 8 min)
    python bench/roundrobin_bench.py --models llama-3.1-8b --json out.json
    python bench/roundrobin_bench.py --models qwen3-32b --clips 1.0 --no-host --set=--train.update=delayed \
        --set=--partition.host_memory_gib=768 --set=--train.optimizer_states=bf16   # a host of 768 GiB
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mobius.app.planning import plan_pipeline  # noqa: E402
from mobius.app.settings import Machine, resolve  # noqa: E402
from mobius.assemble import planned_architecture  # noqa: E402
from mobius.config import load_config  # noqa: E402
from partition.evaluate import GB  # noqa: E402
from partition.request import update_name  # noqa: E402
from partition.roundrobin_plan import search_cuts, simulate_round_robin  # noqa: E402
from partition.schedule import PipelineOptions  # noqa: E402
from partition.schedule.roundrobin_actions import Cuts  # noqa: E402

TOPOLOGY = ROOT / "tests/fixtures/topology/topo8_4x4_nic.txt"
UNITS = {  # RoundPipe's pp-simulate/run.sh: ms per micro-batch of 4 x 2048 (block fwd, block bwd, head fwd, head bwd)
    "llama-3.1-8b": (18.5037, 41.2066, 37.2255, 74.501),
    "qwen3-1.7b": (7.429, 15.831, 22.0655, 43.707),
    "qwen3-32b": (40.5610625, 91.17429688, 54.928, 108.294),
}
ROUNDPIPE = {  # tokens/s: measured sync and delayed (exp/raw-data.csv), its simulator's one step (pp-simulate/log)
    "llama-3.1-8b": (18888, 24275, 21485), "qwen3-1.7b": (56489, 65417, 57337), "qwen3-32b": (4164, 5516, 5466)}
ROUNDPIPE_CUTS = {  # pp-simulate/run.sh: layers per forward stage | per backward stage from the top (the first: the
    # head alone, fused with its forward)
    "llama-3.1-8b": ("5,5,5,5,6,6", "0" + ",2" * 16),
    "qwen3-1.7b": ("7,7,7,7", "0,3,3,3,3,3,3,3,3,2,2"),
    "qwen3-32b": ("2,2" + ",3" * 20, "0" + ",1" * 64),
}
TOKENS = 16 * 4 * 2048
MEASURED_MICRO_BATCHES = {"llama-3.1-8b": 64}  # RoundPipe's measured runs: 524,288 tokens per step (its paper)
HOST_RATES = (16.0,)  # partition.cpu_update_rate (G parameters/s, measured alone) beside the default host's 4.0
FREE = 1e13  # "free": a link (bytes/s) or a CPU update rate (parameters/s) that takes no time at these sizes
EXTRA: list[str] = []  # --set: config overrides for every plan (e.g. the host's memory, the optimizer states)


def _plan(model: str, clip: float, profile_file: Path, micro_batches: int = 16, cpu_rate: float | None = None,
          schedule: str = "auto"):
    """The pipeline plan ``mobius plan`` makes, with the round-robin family beside it (``cpu_rate``: the host's
    ``partition.cpu_update_rate``, G parameters/s; None: the default for a server planned from elsewhere)."""
    import topology

    overrides = [f"--model.preset={model}", "--parallel.devices=8", "--train.micro_batch_size=4",
                 f"--train.micro_batches={micro_batches}", f"--partition.profile_file={profile_file}",
                 "--partition.gpu=rtx4090", f"--parallel.schedule={schedule}", f"--train.grad_clip={clip}"]
    if cpu_rate is not None:
        overrides.append(f"--partition.cpu_update_rate={cpu_rate}")
    overrides += EXTRA
    cfg = load_config(str(ROOT / "configs/finetune-llama-3.1-8b.yaml"), overrides)
    machine = Machine.saved(topology.load_topology(str(TOPOLOGY)))
    settings = resolve(cfg, machine, "pipeline", "")
    return plan_pipeline(cfg, planned_architecture(cfg), settings, machine)


def _ablations(prof, hw, plan) -> dict[str, float]:
    """The round-robin delayed steady state with the fp32 sums free, and with 100 GB/s host links too."""
    cuts, gpus = plan.round_robin.cuts, plan.round_robin.worker_gpus
    opts = PipelineOptions(grad_dtype=plan.swapped.options.grad_dtype, delayed=True)
    no_acc, fast = _no_sums(prof), _links(hw, 1e11)
    return {"delayed_no_fp32_sums_s": simulate_round_robin(no_acc, cuts, hw, gpus, 16, opts, record=False).step_s,
            "delayed_no_fp32_sums_fast_links_s": simulate_round_robin(no_acc, cuts, fast, gpus, 16, opts,
                                                                      record=False).step_s}


def roundpipe_cuts(model: str, num_units: int) -> Cuts:
    """RoundPipe's cuts of ``model`` as mobius's units (0: the embedding, then the blocks, then the head): the
    embedding joins the first forward stage and the last backward stage."""
    fwd, bwd = ([int(x) for x in part.split(",")] for part in ROUNDPIPE_CUTS[model])
    assert bwd[0] == 0 and sum(fwd) == sum(bwd) == num_units - 2, (model, fwd, bwd)
    def bounds(layers: list[int]) -> tuple[int, ...]:
        return (0, *(1 + sum(layers[:i + 1]) for i in range(len(layers))))
    return Cuts(bounds(fwd), bounds(bwd[1:][::-1]), num_units)


def _no_sums(prof):
    """The profile with the fp32 gradient sums of each micro-batch free (``acc_s`` 0)."""
    return dataclasses.replace(prof, units=[dataclasses.replace(u, acc_s=0.0) for u in prof.units])


def _links(hw, rate: float):
    """The machine with every host link and root complex at ``rate`` bytes/s each way."""
    return dataclasses.replace(hw, rc_h2d_Bps=[rate] * len(hw.groups), rc_d2h_Bps=[rate] * len(hw.groups),
                               h2d_Bps=[rate] * hw.num_gpus, d2h_Bps=[rate] * hw.num_gpus)


def _free(prof, hw):
    """The profile and machine under RoundPipe's simulator's assumptions: no fp32 sums, free links, a free CPU update."""
    return _no_sums(prof), dataclasses.replace(_links(hw, FREE), cpu_adam_params_per_s=FREE,
                                               host_adam_params_per_s=FREE)


def _like_for_like(model: str, prof, hw, plan) -> dict[str, float]:
    """Seconds per step of RoundPipe's cuts and mobius's under mobius's costs (sync and delayed steady state),
    and under RoundPipe's simulator's assumptions (sync: one step from empty GPUs; delayed: steady state),
    where mobius's search chooses its cuts again."""
    rr, gpus = plan.to_json()["round_robin"], plan.swapped.worker_gpus
    theirs = roundpipe_cuts(model, prof.num_units)
    out: dict[str, float] = {}
    for delayed in (False, True):
        rule, opts = update_name(delayed), PipelineOptions(delayed=delayed)
        out[f"roundpipe_cuts_{rule}_s"] = simulate_round_robin(prof, theirs, hw, gpus, 16, opts, record=False).step_s
        free_prof, free_hw = _free(prof, hw)
        mine = search_cuts(free_prof, free_hw, gpus, 16, opts, hw.gpu_memory_bytes / GB).cuts
        for who, cuts in (("roundpipe_cuts", theirs), ("mobius_cuts", mine)):
            res = simulate_round_robin(free_prof, cuts, free_hw, gpus, 16, opts, record=False)
            out[f"free_{who}_{rule}_s"] = res.step_s if delayed else res.step_ends[0]
    out["mobius_cuts_sync_s"], out["mobius_cuts_delayed_s"] = _sync_delayed(rr)
    return out


def _sync_delayed(rr: dict) -> tuple[float, float]:
    """(sync, delayed) seconds per step of a round-robin plan (both rules are simulated on its cuts)."""
    sync = rr["step_s"] if rr["update"] == "sync" else rr["sync_step_s"]
    return sync, rr.get("delayed_step_s", rr["step_s"])


def _host(model: str, profile_file: Path) -> list[dict]:
    """The round-robin plan, sync and delayed, at RoundPipe's measured batch and with a faster host."""
    settings = [(MEASURED_MICRO_BATCHES.get(model, 0), None)] + [(16, r) for r in HOST_RATES]
    out = []
    for micro, rate in settings:
        if not micro:
            continue
        plan, _, _ = _plan(model, 0.0, profile_file, micro, rate, "round_robin")
        sync, delayed = _sync_delayed(plan.to_json()["round_robin"])
        tokens = micro * 4 * 2048
        out.append({"micro_batches": micro, "cpu_update_rate": rate, "sync_tokens_per_s": tokens / sync,
                    "delayed_tokens_per_s": tokens / delayed})
    return out


def write_profile(model: str, folder: Path) -> Path:
    """RoundPipe's unit times of ``model`` (:data:`UNITS`) as a profile file (``partition.profile_file``) in
    ``folder``."""
    bf, bb, hf, hb = UNITS[model]
    path = folder / f"{model}.json"
    path.write_text(json.dumps({"gpu": "rtx4090", "micro_batch_size": 4, "seq_len": 2048, "precision": "bf16",
                                "units": {"block": {"forward_ms": bf, "backward_ms": bb},
                                          "head": {"forward_ms": hf, "backward_ms": hb}}}))
    return path


def run(models: list[str], clips: list[float], host: bool = True) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in models:
            path = write_profile(model, Path(tmp))
            for clip in clips:
                t0 = time.perf_counter()
                plan, prof, hw = _plan(model, clip, path)
                rr, swapped = plan.to_json()["round_robin"], plan.swapped
                row = {"model": model, "grad_clip": clip, "swapped_step_s": swapped.predicted_step_s,
                       "swapped_tokens_per_s": TOKENS / swapped.predicted_step_s, "round_robin": rr,
                       "roundpipe_measured_sync": ROUNDPIPE[model][0],
                       "roundpipe_measured_delayed": ROUNDPIPE[model][1],
                       "roundpipe_simulator_one_step": ROUNDPIPE[model][2]}
                if "error" not in rr and clip == 0:
                    row.update(_ablations(prof, hw, plan))
                    row["like_for_like"] = _like_for_like(model, prof, hw, plan)
                    if host:
                        row["host"] = _host(model, path)
                row["plan_s"] = time.perf_counter() - t0
                rows.append(row)
                print(_line(row), flush=True)
    return rows


def _line(r: dict) -> str:
    rr = r["round_robin"]
    if "error" in rr:
        robin = f"round-robin: {rr['error']}"
    else:
        sync, delayed = _sync_delayed(rr)
        robin = (f"round-robin sync {TOKENS / sync:>8,.0f}  delayed {TOKENS / delayed:>8,.0f}  (its compute alone: "
                 f"{TOKENS / compute_s(rr):,.0f}; host stores {rr['host_bytes'] / 2**30:.1f} GiB; "
                 f"{'runs' if rr.get('runs') else 'not run'})")
        if "delayed_no_fp32_sums_s" in r:
            robin += (f"  (delayed without fp32 sums {TOKENS / r['delayed_no_fp32_sums_s']:,.0f}, and fast links "
                      f"{TOKENS / r['delayed_no_fp32_sums_fast_links_s']:,.0f})")
    return (f"{r['model']:<13} clip {r['grad_clip']:<4} swapped {r['swapped_tokens_per_s']:>8,.0f}  {robin}  | "
            f"RoundPipe measured {r['roundpipe_measured_sync']:,} / {r['roundpipe_measured_delayed']:,}, its "
            f"simulator {r['roundpipe_simulator_one_step']:,}  [{r['plan_s']:.0f} s]")


def compute_s(rr: dict) -> float:
    """Seconds per step that each GPU computes in a round-robin plan (either update rule: the same ops), which bounds
    its step from below."""
    split = rr["time_split"]
    return split["forward"] + split["backward"] + split["device_adamw"] + split["dispatch"]


def _like_line(r: dict) -> str:
    f = {k: TOKENS / v for k, v in r["like_for_like"].items()}
    return (f"{r['model']:<13} mobius's costs: RoundPipe's cuts {f['roundpipe_cuts_sync_s']:>8,.0f} / "
            f"{f['roundpipe_cuts_delayed_s']:>8,.0f}, mobius's {f['mobius_cuts_sync_s']:>8,.0f} / "
            f"{f['mobius_cuts_delayed_s']:>8,.0f}  | RoundPipe's assumptions: its cuts {f['free_roundpipe_cuts_sync_s']:>8,.0f}"
            f" / {f['free_roundpipe_cuts_delayed_s']:>8,.0f}, mobius's search {f['free_mobius_cuts_sync_s']:>8,.0f} / "
            f"{f['free_mobius_cuts_delayed_s']:>8,.0f}  (RoundPipe's simulator, one step: "
            f"{r['roundpipe_simulator_one_step']:,})")


def _host_lines(r: dict) -> list[str]:
    out = []
    for h in r["host"]:
        host = f"host {h['cpu_update_rate']:g} G params/s" if h["cpu_update_rate"] else "the default host"
        line = (f"{r['model']:<13} {h['micro_batches']} micro-batches, {host}: round-robin sync "
                f"{h['sync_tokens_per_s']:>8,.0f} / delayed {h['delayed_tokens_per_s']:>8,.0f}")
        if h["micro_batches"] == MEASURED_MICRO_BATCHES.get(r["model"]):
            line += (f"  | RoundPipe measured at this batch {r['roundpipe_measured_sync']:,} / "
                     f"{r['roundpipe_measured_delayed']:,}")
        out.append(line)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(UNITS), help="comma-separated: " + ", ".join(UNITS))
    ap.add_argument("--clips", default="0,1.0", help="train.grad_clip values (0: off)")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--no-host", action="store_true", help="skip the third table (RoundPipe's measured batch, a "
                                                            "faster host: about 2 min)")
    ap.add_argument("--set", action="append", default=[], metavar="--SECTION.KEY=VALUE",
                    help="a config override for every plan (e.g. --set=--partition.host_memory_gib=768)")
    a = ap.parse_args()
    EXTRA.extend(a.set)
    print("tokens/s per step of 16 x 4 x 2048 tokens, predicted by mobius's simulator (8 x RTX 4090 times, two root "
          "complexes, no P2P)")
    rows = run(a.models.split(","), [float(c) for c in a.clips.split(",")], not a.no_host)
    like = [r for r in rows if "like_for_like" in r]
    if like:
        print("\nlike for like, tokens/s sync / delayed: the same unit times and simulator, RoundPipe's cuts against "
              "mobius's; with mobius's costs, and under RoundPipe's simulator's assumptions (no fp32 sums, free links "
              "and CPU update; sync: one step from empty GPUs)")
        for r in like:
            print(_like_line(r))
    hosts = [line for r in like if r.get("host") for line in _host_lines(r)]
    if hosts:
        print("\nthe host's share: mobius's round-robin plan (its cuts for sync, both rules simulated), tokens/s, at "
              "RoundPipe's measured batch and with a host whose CPU AdamW runs at 16 G params/s alone (the default "
              "for a server planned from elsewhere: 4.0, the Mobius paper's two Xeon Gold 6130)")
        print("\n".join(hosts))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
