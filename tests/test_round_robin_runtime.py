"""The round-robin runtime (scheduler/roundrobin_engine.py) on CPU worker processes (gloo), against single mode
on the same batches: more ops than workers, asymmetric forward and backward cuts with inputs kept in the
shared stash, a tied embedding and head (their two ends in two ops), LoRA, clipping or none, sync and
delayed updates; rounds of unequal size; the bytes it moves equal the simulator's."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from mobius.app.run import train
from spawned import adapted_model, delayed_run_config, exact_config, resume_from, resumed_equals_straight, spawn_cases
from spawned import check_against_reference, pipeline_plan, round_robin_plan, to_numpy, token_batches
from spawned import train_delayed_case

STEPS, MICRO = 4, 3
UNITS = 12  # every fixture: the embedding, 10 blocks, the head

# name -> checkpoint, cuts (forward, backward; the fused op runs the rest), train settings, tolerance
CASES = {
    # 6 ops on 2 workers: 3 micro-batches make rounds of 2 and 1; the tied ends in the fused and last ops
    "tied-sync-clipped": ("deep", ((0, 4, 8), (0, 2, 5, 8)), {"update": "sync"}),
    "tied-delayed-no-clip": ("deep", ((0, 4, 8), (0, 2, 5, 8)), {"update": "delayed", "grad_clip": 0.0}),
    # a backward cut inside a forward op (unit 3 and 7's inputs kept mid-op), one-unit forward op
    "untied-delayed-clipped": ("untied", ((0, 1, 9), (0, 3, 7, 9)), {"update": "delayed"}),
    "lora-sync-no-clip": ("llama", ((0, 5, 10), (0, 4, 7, 10)), {"update": "sync", "grad_clip": 0.0, "lr": 1e-3}),
    "lora-delayed-clipped": ("llama", ((0, 6, 10), (0, 3, 10)), {"update": "delayed", "lr": 1e-3}),
    # every gradient download held 50 ms, as a GPU's fp32 sums take to come down over PCIe (see _slow_downloads)
    "tied-sync-slow-downloads": ("deep", ((0, 4, 8), (0, 2, 5, 8)), {"update": "sync"}),
    # train.optimizer_states: moments in the shared host memory in bf16 (delayed) and int8 (LoRA, sync)
    "states-bf16-tied-delayed": ("deep", ((0, 4, 8), (0, 2, 5, 8)), {"update": "delayed", "optimizer_states": "bf16"}),
    "states-int8-lora-sync": ("llama", ((0, 5, 10), (0, 4, 7, 10)), {"update": "sync", "optimizer_states": "int8",
                                                                     "lr": 1e-3}),
}
SLOW_DOWNLOAD_S = 0.05
SLOW_RELOAD_S = 0.04


def _cfg(case: dict, world: int, tmp: Path):
    parallel = {"mode": "pipeline" if world else "single", "device": "cpu", "devices": max(world, 1),
                **({"stages": 6, "resident_stages": [], "kept_stages": []} if world else {})}
    return exact_config(case, case["name"], STEPS, case.get("micro", MICRO), case["train"], parallel, tmp / "out",
                        partition={"cache_dir": str(tmp / "cache")})


def _batches(step: int, count: int = MICRO) -> list:
    return token_batches(step, count, 300)


def _planned(case: dict, world: int, tmp: Path) -> dict:
    """The run's pipeline plan with the case's round-robin cuts to run."""
    cfg = _cfg(case, world, tmp)
    mc = adapted_model(case, cfg)
    swapped, settings = pipeline_plan(cfg, mc)
    plan = round_robin_plan(swapped, *case["cuts"], UNITS)
    return {**case, "cfg": cfg, "settings": settings, "plan": plan, "model_cfg": mc}


def _slow_downloads() -> list[bool]:
    """(In a worker) hold every gradient download ``SLOW_DOWNLOAD_S`` longer, and note for each upload whether
    the dispatch thread went on while the slot it gave the upload still held the op before (whose gradients
    were still coming down)."""
    import time

    from scheduler.roundrobin_engine import _Dispatch

    to_host, upload, ahead = _Dispatch._to_host, _Dispatch._upload, []

    def slow(self, dst, src, ready, trace=None, name=""):
        if name.startswith("D"):
            time.sleep(SLOW_DOWNLOAD_S)
        to_host(self, dst, src, ready, trace, name)

    def noted(self, a):
        upload(self, a)
        slot = self.slot_of[(self.st.index, a.stage, a.round)]
        with self.freed:
            ahead.append(slot.stage not in (None, (a.stage, a.round)))

    _Dispatch._to_host, _Dispatch._upload = slow, noted
    return ahead


def _slow_reloads() -> None:
    """(In a worker) hold every reload of a backward op's input ``SLOW_RELOAD_S`` before it waits for its stash
    entry and reads it (the reload thread, whose copy the op's RELOAD waits for): a worker lagging behind the
    others, whose next step has begun."""
    import time

    from scheduler.roundrobin_engine import _Dispatch

    reload = _Dispatch._reload_job

    def slow(self, st, a, upload):
        time.sleep(SLOW_RELOAD_S)
        return reload(self, st, a, upload)

    _Dispatch._reload_job = slow


def _run_case(case: dict, world: int) -> dict:
    """(In a worker) the case's steps through the engine `mobius train` builds."""
    from mobius.app.launch import make_engine, open_device
    from mobius.assemble import WeightSource

    ahead = _slow_downloads() if case["name"].endswith("slow-downloads") else []
    if case["name"].endswith("slow-reloads"):
        _slow_reloads()
    cfg = case["cfg"]
    engine = make_engine(cfg, case["model_cfg"], case["plan"], case["settings"],
                         open_device(case["settings"], int(os.environ["LOCAL_RANK"])),
                         WeightSource(str(case["ck"]), None, cfg.train.seed))
    try:
        out = train_delayed_case(engine, cfg, STEPS, lambda s, n=case.get("micro", MICRO): _batches(s, n),
                                 lambda e: {}, case.get("overflow", -1))
    finally:
        engine.close()
    return {**to_numpy(out), "uploads_ahead": sum(ahead)}


def _reference(case: dict, tmp: Path) -> dict:
    from mobius.assemble import initial_model
    from scheduler.single_engine import SingleEngine

    cfg = _cfg(case, 0, tmp)
    model = initial_model(cfg, adapted_model(case, cfg), None)
    return train_delayed_case(SingleEngine(model, cfg, torch.device("cpu")), cfg, STEPS,
                              lambda s, n=case.get("micro", MICRO): _batches(s, n), lambda e: {},
                              case.get("overflow", -1))


def _case(name: str, cks: dict[str, Path]) -> dict:
    ck, cuts, train = CASES[name]
    return {"name": name, "ck": cks[ck], "cuts": cuts, "train": train, "lora": ck == "llama"}


def _check(case: dict, ranks: list[dict], ref: dict) -> None:
    check_against_reference(ranks, ref, case["name"], STEPS, 1e-5, case["train"]["update"], case["model_cfg"],
                            behind=False, states=case["train"].get("optimizer_states", "fp32"),
                            lr=case["train"].get("lr", 1e-2))


@pytest.mark.slow
def test_round_robin_two_workers_equal_single_mode(tmp_path: Path, deep_checkpoint: Path, untied_checkpoint: Path,
                                                   llama_checkpoint: Path) -> None:
    """Every case on 2 workers: the losses of 4 steps, two evaluations, every weight and (delayed) the compute
    weights a checkpoint keeps equal single mode's under the same update rule within 1e-5. With its gradient
    downloads held 50 ms, a worker's dispatch thread goes on to the next op's compute while the slot it gave the
    op after that still holds the op before's gradients (it used to wait for the slot to be free)."""
    cks = {"deep": deep_checkpoint, "untied": untied_checkpoint, "llama": llama_checkpoint}
    cases = [_planned(_case(name, cks), 2, tmp_path) for name in CASES]
    for case, ranks in zip(cases, spawn_cases(_run_case, cases, 2)):
        _check(case, ranks, _reference(case, tmp_path))
        slow = case["name"].endswith("slow-downloads")
        assert all((r["uploads_ahead"] > 0) == slow for r in ranks), (case["name"], [r["uploads_ahead"] for r in ranks])


@pytest.mark.slow
def test_round_robin_four_workers_equal_single_mode(tmp_path: Path, deep_checkpoint: Path) -> None:
    """8 ops on 4 workers, 6 micro-batches in rounds of 4 and 2, and 9 in three (delayed); delayed in one round of 3
    micro-batches, each
    reload held 40 ms (a worker whose next step's forwards, run ahead, reach the stash entries that this step's
    backwards have yet to read: each step's entries are its own); a bf16 run (half activations and compute copies,
    fp32 sums) against fp32 autocast within 3e-2; fp16 with step 2's loss scale overflowing (no update, the
    compute copies still take the master) against single mode's fp16, within 3e-2 and with the same skips."""
    cases = [{"name": "four-sync", "ck": deep_checkpoint, "cuts": ((0, 3, 6, 9), (0, 2, 5, 7, 9)),
              "train": {"update": "sync"}, "lora": False, "micro": 6},
             {"name": "four-delayed-one-round-slow-reloads", "ck": deep_checkpoint, "cuts": ((0, 4, 8), (0, 2, 5, 8)),
              "train": {"update": "delayed", "grad_clip": 0.0}, "lora": False, "micro": 3},
             # three rounds: the middle one's sums come down into the staging buffer and the summing thread adds
             # them; lr 1e-3 as in the LoRA cases (at 1e-2 the rounds' summation order moves weights whose gradients
             # are near AdamW's eps by up to 3e-5)
             {"name": "four-delayed-three-rounds", "ck": deep_checkpoint, "cuts": ((0, 3, 6, 9), (0, 2, 5, 7, 9)),
              "train": {"update": "delayed", "grad_clip": 0.0, "lr": 1e-3}, "lora": False, "micro": 9},
             {"name": "four-delayed-bf16", "ck": deep_checkpoint, "cuts": ((0, 5, 10), (0, 4, 7, 10)),
              "train": {"update": "delayed", "precision": "bf16"}, "lora": False, "micro": 6, "atol": 3e-2},
             {"name": "four-delayed-fp16-overflow", "ck": deep_checkpoint, "cuts": ((0, 5, 10), (0, 4, 7, 10)),
              "train": {"update": "delayed", "precision": "fp16"}, "lora": False, "micro": 4, "atol": 3e-2,
              "overflow": 1}]
    cases = [_planned(c, 4, tmp_path) for c in cases]
    assert cases[-1]["plan"].options.barrier  # fp16: every update waits for the overflow check
    for case, ranks in zip(cases, spawn_cases(_run_case, cases, 4)):
        ref = _reference(case, tmp_path)
        assert [r["skipped"] for r in ranks] == [ref["skipped"]] * 4
        assert ref["skipped"] == [s == case.get("overflow", -1) for s in range(STEPS)], case["name"]
        if "atol" in case:
            torch.testing.assert_close(torch.tensor(ranks[0]["losses"]), torch.tensor(ref["losses"]), rtol=0,
                                       atol=case["atol"])
            continue
        _check(case, ranks, ref)


# ---- resuming with an update in flight, through `mobius train` -------------------------------------------
def _run_cfg(tmp: Path, ck: Path, corpus: Path, out: str, **sections: dict):
    return delayed_run_config(tmp, ck, corpus, out, 3, {"parallel": {"mode": "pipeline", "device": "cpu",
                                                                     "devices": 2, "schedule": "round_robin"}},
                              **sections)


def test_round_robin_resume_with_an_update_in_flight(tmp_path: Path, deep_checkpoint: Path, corpus: Path) -> None:
    """4 delayed round-robin steps (the tied weight's ends in two ops) == 2 steps, the step-2 checkpoint,
    --resume, 2 more: the same losses, evaluations and weights; the run's metrics say the schedule and its step
    trace has both workers' compute, copies and updates; and the same checkpoint resumed in the swapped pipeline
    continues as 4 swapped steps do."""
    def runs(tmp: Path, out: str, **sec: dict):  # the first run traces step 3, which runs step 4 ahead
        return _run_cfg(tmp, deep_checkpoint, corpus, out, **({"parallel": {"trace_step": 3}} if out == "first"
                                                              else {}), **sec)
    first = resumed_equals_straight(tmp_path, runs, compute_file=False)
    rows = [json.loads(line) for line in (tmp_path / "first" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["schedule"] == "round_robin" and r["update"] == "delayed" for r in rows)
    trace = json.loads((tmp_path / "first" / "trace-step3.json").read_text())["traceEvents"]
    spans = [e for e in trace if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {1, 2}  # both workers
    kinds = {(e["tid"], e["name"].rstrip("0123456789.,")) for e in spans}
    assert kinds >= {(0, "F"), (0, "FB"), (0, "C"), (0, "B"), (1, "U"), (2, "D"), (4, "O")}, kinds
    swapped = {"parallel": {"schedule": "swapped", "stages": 4}}
    straight = train(_run_cfg(tmp_path, deep_checkpoint, corpus, "swapped", **swapped))
    torch.testing.assert_close(torch.tensor(first.losses), torch.tensor(straight.losses), rtol=0, atol=1e-5)
    resume_from(tmp_path, "first", 2, "third")
    third = train(_run_cfg(tmp_path, deep_checkpoint, corpus, "third", **swapped), resume="auto")
    torch.testing.assert_close(torch.tensor(third.losses), torch.tensor(straight.losses), rtol=0, atol=1e-5)
