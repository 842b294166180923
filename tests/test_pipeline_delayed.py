"""``train.update: delayed`` in the pipeline runtime, against single mode's delayed engine (the reference
that tests/test_delayed_update.py holds to a plain torch loop), on CPU worker processes (gloo): swapped,
resident and kept stages, a tied head, LoRA, bf16, an fp16 overflow, evaluation with the newest weights,
and resuming with an update in flight (in the pipeline, and in single mode)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from mobius.app.run import train
from mobius.models.hf import read_state_dict
from spawned import adapted_model, exact_config, spawn_cases, token_batches, train_delayed_case
from spawned import check_against_reference, delayed_run_config, metric_rows, resume_from
from spawned import pipeline_plan, resumed_equals_straight, to_numpy

STEPS, MICRO = 4, 3
SWAPPED = {"resident_stages": [], "kept_stages": []}

# name -> checkpoint fixture, parallel settings, train settings, update rule, tolerance (losses, weights)
CASES = {
    # 6 stages on 2 workers (0, 2, 4 and 1, 3, 5), all swapped: the tied embedding and head on two workers
    "swapped-2x6-clipped": ("deep", {"stages": 6, **SWAPPED}, {}, "delayed", 1e-5),
    # 5 stages (0, 2, 4 and 1, 3): both ends on worker 0, whose embedding store updates the tied weight for both
    "tied-one-worker-clipped": ("deep", {"stages": 5, **SWAPPED}, {}, "delayed", 1e-5),
    # swapped kept stages, a resident one (device AdamW), clipping: every update after the global norm
    "kept-swapped-and-resident": ("deep", {"stages": 6, "resident_stages": [3], "kept_stages": [0, 2, 3]}, {},
                                  "delayed", 1e-5),
    # no barrier: updates as gradients arrive, a step does not wait for them (downloads wait for the AdamW)
    "resident-kept-no-clip": ("deep", {"stages": 6, "resident_stages": [2, 3], "kept_stages": [2, 3, 4]},
                              {"grad_clip": 0.0}, "delayed", 1e-5),
    "one-slot-offload-no-clip": ("deep", {"stages": 5, **SWAPPED, "prefetch": False, "offload_inputs": "on"},
                                 {"grad_clip": 0.0}, "delayed", 1e-5),
    # LoRA (frozen base weights behind what trains in each flat buffer), resident and kept stages; lr 1e-3 as
    # in tests/test_lora.py (summation-order rounding in an adapter with near-zero gradients stays in 1e-5)
    "lora-resident-kept": ("llama", {"stages": 6, "resident_stages": [1, 5], "kept_stages": [0, 2, 3]},
                           {"lr": 1e-3}, "delayed", 1e-5),
    # bf16: half-precision compute copies and activations vs fp32 autocast (fp32 gradient downloads)
    "bf16-resident": ("deep", {"stages": 5, "resident_stages": [1], "kept_stages": [], "grad_download": "fp32"},
                      {"precision": "bf16"}, "delayed", 3e-2),
    "sync-swapped-2x6": ("deep", {"stages": 6, **SWAPPED}, {}, "sync", 1e-5),  # what delayed must differ from
    # train.optimizer_states: bf16 moments in swapped, kept and resident stages (the host kernel's and the device
    # AdamW's), sync; int8 with the tied weight's two ends on one worker, delayed
    "states-bf16-resident-sync": ("deep", {"stages": 6, "resident_stages": [3], "kept_stages": [0, 2, 3]},
                                  {"optimizer_states": "bf16"}, "sync", 1e-5),
    "states-int8-tied-one-worker": ("deep", {"stages": 5, **SWAPPED}, {"optimizer_states": "int8"}, "delayed", 1e-5),
}
OVERFLOW_STEP = 1  # the fp16 case's step whose loss scale overflows


def _cfg(case: dict, world: int, tmp: Path):
    parallel = {"mode": "pipeline" if world else "single", "device": "cpu", "devices": max(world, 1),
                **(case["parallel"] if world else {})}
    return exact_config(case, case["name"], STEPS, MICRO, {"update": case["update"], **case["train"]}, parallel,
                        tmp / "out", partition={"cache_dir": str(tmp / "cache")})


def _batches(step: int, count: int = MICRO) -> list:
    return token_batches(step, count, 300)


def _train(engine, cfg, overflow: bool = False) -> dict:
    """The case's steps (:func:`spawned.train_delayed_case`); ``overflow``: step OVERFLOW_STEP + 1's loss scale
    overflows."""
    return train_delayed_case(engine, cfg, STEPS, _batches, _store_state, OVERFLOW_STEP if overflow else -1)


def _store_state(engine) -> dict:
    """Each store's master and the part of its compute copy that it updates (pipeline engines only)."""
    stores = getattr(engine, "stores", {})
    return {j: (s.master.clone(), s.half[:s.own].clone()) for j, s in stores.items()}


def _run_case(case: dict, world: int) -> dict:
    """(In a worker) one planned case through the engine `mobius train` builds."""
    from mobius.app.launch import make_engine, open_device
    from mobius.assemble import WeightSource

    cfg = case["cfg"]
    engine = make_engine(cfg, case["model_cfg"], case["plan"], case["settings"],
                         open_device(case["settings"], int(os.environ["LOCAL_RANK"])),
                         WeightSource(str(case["ck"]), None, cfg.train.seed))
    try:
        out = _train(engine, cfg, case.get("overflow", False))
    finally:
        engine.close()
    return to_numpy(out)


def _reference(case: dict, tmp: Path) -> dict:
    from mobius.assemble import initial_model
    from scheduler.single_engine import SingleEngine

    cfg = _cfg(case, 0, tmp)
    model = initial_model(cfg, adapted_model(case, cfg), None)
    return _train(SingleEngine(model, cfg, torch.device("cpu")), cfg, case.get("overflow", False))


def _planned(case: dict, world: int, tmp: Path) -> dict:
    cfg = _cfg(case, world, tmp)
    mc = adapted_model(case, cfg)
    plan, settings = pipeline_plan(cfg, mc)
    par = case["parallel"]
    for key in ("resident", "kept"):
        if f"{key}_stages" in par:
            assert sorted(getattr(plan.options, key)) == par[f"{key}_stages"], case["name"]
    assert plan.options.delayed == (case["update"] == "delayed") and plan.options.grad_dtype == "fp32", case["name"]
    return {**case, "cfg": cfg, "settings": settings, "plan": plan, "model_cfg": mc}


def _case(name: str, cks: dict[str, Path]) -> dict:
    ck, par, tr, update, atol = CASES[name]
    return {"name": name, "ck": cks[ck], "parallel": par, "train": tr, "update": update, "atol": atol,
            "lora": ck == "llama"}


@pytest.mark.slow
def test_pipeline_delayed_equals_single_delayed(tmp_path: Path, deep_checkpoint: Path, llama_checkpoint: Path) -> None:
    """Every case on 2 workers against single mode's delayed engine on the same batches: the losses of 4
    steps, both evaluations (the newest weights, the compute weights put back after the first), every
    weight and the compute weights a checkpoint keeps within 1e-5 (fp32; bf16 within 3e-2 on the
    losses); the sync pipeline computes step 1 alike and differs from step 2 on."""
    cks = {"deep": deep_checkpoint, "llama": llama_checkpoint}
    cases = [_planned(_case(name, cks), 2, tmp_path) for name in CASES]
    results = dict(zip(CASES, spawn_cases(_run_case, cases, 2)))
    for case in cases:
        ranks, where, atol = results[case["name"]], case["name"], case["atol"]
        check_against_reference(ranks, _reference(case, tmp_path), where, STEPS, atol, case["update"],
                                case["model_cfg"], weights=case["train"].get("precision") != "bf16",
                                states=case["train"].get("optimizer_states", "fp32"), lr=case["train"].get("lr", 1e-2))
    delayed, sync = results["swapped-2x6-clipped"][0]["losses"], results["sync-swapped-2x6"][0]["losses"]
    assert delayed[0] == pytest.approx(sync[0], abs=1e-6) and all(abs(a - b) > 1e-4 for a, b in zip(delayed[1:],
                                                                                                     sync[1:]))


def test_pipeline_delayed_fp16_overflow_skips_the_update_and_still_hands_over(tmp_path: Path,
                                                                               deep_checkpoint: Path) -> None:
    """fp16 with swapped and resident stages on both workers (the tied ends on one): an overflowing step 2
    makes no update (every store's master unchanged: w_2 == w_1) yet the compute copies take the master
    (step 3 computes with w_1), on both workers; the run goes on like single mode's (fp16 tolerance) with
    the same skips."""
    case = {"name": "fp16-overflow", "ck": deep_checkpoint, "update": "delayed", "lora": False, "overflow": True,
            "parallel": {"stages": 5, "resident_stages": [1, 2], "kept_stages": [1]}, "train": {"precision": "fp16"}}
    case = _planned(case, 2, tmp_path)
    ranks = spawn_cases(_run_case, [case], 2)[0]
    ref = _reference(case, tmp_path)
    assert [r["skipped"] for r in ranks] == [ref["skipped"]] * 2 == [[s == OVERFLOW_STEP for s in range(STEPS)]] * 2
    assert all(r["optimizer_step"] == STEPS - 1 for r in ranks)
    for rank, stages in zip(ranks, (3, 2)):  # 0, 2, 4 and 1, 3
        assert len(rank["after"]) == stages
        for j, (master, compute) in rank["after"].items():
            before_master, before_compute = rank["before"][j]
            assert (master == before_master).all(), j  # no update
            assert (compute == torch.from_numpy(master).half().float().numpy()).all(), j  # w_1 in the compute copy
            assert (compute != before_compute).any(), j  # it held w_0 before
    torch.testing.assert_close(torch.tensor(ranks[0]["losses"]), torch.tensor(ref["losses"]), rtol=0, atol=3e-2)


# ---- resuming with an update in flight, through `mobius train` -------------------------------------------
def _run_cfg(tmp: Path, ck: Path, corpus: Path, out: str, stages: int = 4, **sections: dict):
    return delayed_run_config(tmp, ck, corpus, out, 3, {"parallel": {"mode": "pipeline", "device": "cpu", "devices": 2,
                                                     "stages": stages, "resident_stages": [1], "kept_stages": []}},
                              **sections)


@pytest.mark.parametrize("stages", [4, 5])
def test_pipeline_resume_with_an_update_in_flight(tmp_path: Path, deep_checkpoint: Path, corpus: Path,
                                                  stages: int) -> None:
    """4 delayed pipeline steps (2 workers, one resident stage; 4 stages: the tied head on the other worker
    than the embedding, 5: on the same one, whose embedding store updates it for both; evaluations after
    steps 2 and 4) == 2 steps, the step-2 checkpoint, --resume, 2 more: the same losses, evaluations and
    weights. The checkpoint holds the compute weights (every trainable weight once, fp32, one update behind
    its newest), written by both workers into one file; resumed in single mode it continues as 4 delayed
    steps in single mode do."""
    runs = lambda tmp, out, **sec: _run_cfg(tmp, deep_checkpoint, corpus, out, stages, **sec)  # noqa: E731
    first = resumed_equals_straight(tmp_path, runs)
    assert [r[2] is not None for r in metric_rows(tmp_path / "first")] == [False, True, False, True]
    if stages == 5:
        return  # what follows reads the checkpoint alone, the same either way
    # the same checkpoint in single mode continues as single mode's own delayed run
    single = {"parallel": {"mode": "single", "devices": 1, "stages": 0, "resident_stages": None,
                           "kept_stages": None}}
    straight = train(_run_cfg(tmp_path, deep_checkpoint, corpus, "single", **single))
    torch.testing.assert_close(torch.tensor(first.losses), torch.tensor(straight.losses), rtol=0, atol=1e-5)
    resume_from(tmp_path, "first", 2, "third")
    third = train(_run_cfg(tmp_path, deep_checkpoint, corpus, "third", **single), resume="auto")
    torch.testing.assert_close(torch.tensor(third.losses), torch.tensor(straight.losses), rtol=0, atol=1e-5)
    c, d = read_state_dict(straight.final_dir), read_state_dict(third.final_dir)
    for k in c:
        torch.testing.assert_close(d[k], c[k], rtol=0, atol=1e-5, msg=k)


def test_delayed_refuses_half_gradient_downloads_and_counts_its_compute_copy() -> None:
    """Half-precision gradients would land on the compute weights: an internal error; fp32 training
    allocates (and counts) a separate pinned fp32 compute copy, half precision nothing more."""
    from mobius.config import TrainSection
    from mobius.errors import MobiusError
    from mobius.models import get_preset
    from scheduler.stages import stage_layouts
    from scheduler.stage_store import StageStore, host_bytes

    layouts = stage_layouts(get_preset("gpt2-tiny"), [0, 2, 4])
    with pytest.raises(MobiusError, match="internal error: half-precision gradient downloads .* fp32 gradients"):
        StageStore(layouts[0], torch.bfloat16, TrainSection(), half_grads=True, delayed=True)
    lay = layouts[1]
    assert host_bytes([lay], torch.float32, delayed=True) == 20 * lay.numel
    assert host_bytes([lay], torch.bfloat16, delayed=True) == host_bytes([lay], torch.bfloat16) == 18 * lay.numel
    store = StageStore(lay, torch.float32, TrainSection(), delayed=True)
    assert store.half.data_ptr() != store.master.data_ptr() and store.optimizer.half is None
