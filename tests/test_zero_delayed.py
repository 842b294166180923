"""``train.update: delayed`` in zero mode, against single mode's delayed engine (the reference that
tests/test_delayed_update.py holds to a plain torch loop), on 2 CPU worker processes (gloo): GPU and
offloaded chunks (updates after the global norm, and as gradients arrive), the tied GPT-2 embedding,
LoRA, an fp16 overflow, evaluation with the newest weights, and resuming with an update in flight (in
zero mode, and in single mode)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from mobius.app.run import train
from mobius.config import config_from_dict
from mobius.models.hf import read_state_dict
from spawned import adapted_model, exact_config, spawn_cases, token_batches, train_delayed_case
from spawned import check_against_reference, delayed_run_config, metric_rows, resume_from
from spawned import resumed_equals_straight, to_numpy

STEPS, MICRO = 4, 4
CHUNK = 4999  # as tests/test_zero.py: no world divides it; the token embedding spans two chunks
CHUNK_INT8 = 78 * 64  # int8 moments: a multiple of their blocks of 64 (the token embedding still spans two chunks)
OVERFLOW_STEP = 1  # the fp16 case's step whose loss scale overflows

# name -> checkpoint fixture, engine settings (activation checkpointing, rCache, offloaded chunks), train
# settings, update rule, tolerance (losses, evaluations, weights)
CASES = {
    # half the chunks on the "GPU", half offloaded; clipping (0.5: below the steps' norms here): every CPU
    # update after the global norm
    "mix-clipped": ("deep", {"ac": True, "cache": "mid", "offload": "mix"}, {"grad_clip": 0.5}, "delayed", 1e-5),
    # no barrier: offloaded chunks updated as their gradients arrive (downloads wait for the AdamW)
    "mix-no-clip": ("deep", {"ac": False, "cache": "min", "offload": "mix"}, {"grad_clip": 0.0}, "delayed", 1e-5),
    "all-offloaded-no-clip": ("deep", {"ac": True, "cache": "max", "offload": "all"}, {"grad_clip": 0.0}, "delayed",
                              1e-5),
    "all-on-gpu": ("deep", {"ac": False, "cache": "mid", "offload": "none"}, {}, "delayed", 1e-5),
    # LoRA: frozen chunks (no compute copy) beside the adapters'; lr 1e-3 as in tests/test_lora.py
    "lora-mix": ("llama", {"ac": True, "cache": "mid", "offload": "mix"}, {"lr": 1e-3}, "delayed", 1e-5),
    # bf16: GPU compute copies in bf16, host ones in bf16 (losses only, within 3e-2)
    "bf16-mix": ("deep", {"ac": True, "cache": "mid", "offload": "mix"}, {"precision": "bf16"}, "delayed", 3e-2),
    "sync-mix-clipped": ("deep", {"ac": True, "cache": "mid", "offload": "mix"}, {"grad_clip": 0.5}, "sync",
                         1e-5),  # what delayed must differ from
    # train.optimizer_states: bf16 (sync) and int8 (delayed) moments in GPU chunks and offloaded ones, the
    # token embedding cut across two chunks and both ranks
    "states-bf16-mix-sync": ("deep", {"ac": True, "cache": "mid", "offload": "mix"}, {"optimizer_states": "bf16"},
                             "sync", 1e-5),
    "states-int8-mix": ("deep", {"ac": False, "cache": "min", "offload": "mix"}, {"optimizer_states": "int8"},
                        "delayed", 1e-5),
}


def _cfg(case: dict, zero: bool):
    parallel = {"mode": "zero" if zero else "single", "device": "cpu", "devices": 2 if zero else 1}
    return exact_config(case, case["name"], STEPS, MICRO, {"update": case["update"], **case["train"]}, parallel,
                        case["ck"].parent / "out", model={"activation_checkpointing": case["engine"]["ac"]})


def _batches(step: int, count: int = MICRO) -> list:
    return token_batches(step, count, 300)


def _plan(case: dict, cfg, mc, world: int = 2):
    """The zero plan for ``world`` ranks (an estimated profile: no measuring in the workers) with the case's
    rCache blocks and GPU chunks, made for the run's update rule."""
    from mobius.layout import build_layout
    from mobius.models import unit_specs
    from mobius.models.params import model_params
    from partition.estimate import estimate_units
    from partition.zero import ZeroHardware, plan

    units = len(unit_specs(mc))
    chunk = CHUNK_INT8 if cfg.train.optimizer_states == "int8" else CHUNK
    layout = build_layout(model_params(mc), units, chunk, world)
    n, lo, e = layout.num_chunks, layout.min_blocks, case["engine"]
    trained = sum(layout.trains(c) for c in range(n))  # they come first (LoRA: the frozen chunks after them)
    blocks = {"min": lo, "mid": (lo + n) // 2, "max": n}[e["cache"]]
    gpu = {"all": 0, "none": n, "mix": trained // 2}[e["offload"]]
    prof = estimate_units(unit_specs(mc), 2, 16, cfg.train.precision, "h100")
    hw = ZeroHardware(world, 2**30, 5e9, 5e9, 2e9, 5e9, 1e9, 1e9, name="CPU workers")
    return plan(model_params(mc), units, prof, hw, micro_batches=MICRO, checkpointing=e["ac"],
                barrier=cfg.train.barrier, chunk_size=chunk, cache_blocks=blocks, gpu_chunks=gpu,
                delayed=cfg.train.delayed, states=cfg.train.optimizer_states)


def _train(engine, cfg, overflow: bool = False) -> dict:
    """The case's steps (:func:`spawned.train_delayed_case`); ``overflow``: step OVERFLOW_STEP + 1's loss scale
    overflows."""
    return train_delayed_case(engine, cfg, STEPS, _batches, _shard_state, OVERFLOW_STEP if overflow else -1)


def _shard_state(engine) -> dict:
    """The GPU chunks' and each offloaded chunk's master and compute copy (zero engines only)."""
    if not hasattr(engine, "hosts"):
        return {}
    shards = {"gpu": engine.gpu, **{f"host {c}": h.shards for c, h in engine.hosts.items()}}
    return {k: (s.master.clone(), s.compute.clone()) for k, s in shards.items() if s.chunks}


def _run_case(case: dict, world: int) -> dict:
    """(In a worker) one case: the zero engine on the case's plan."""
    from mobius.assemble import WeightSource
    from scheduler.zero import ZeroEngine

    cfg = _cfg(case, zero=True)
    mc = adapted_model(case, cfg)
    engine = ZeroEngine(cfg, mc, _plan(case, cfg, mc), None, torch.device("cpu"),
                        WeightSource(str(case["ck"]), None, cfg.train.seed))
    try:
        out = _train(engine, cfg, case.get("overflow", False))
        out["gpu_chunks"], out["offloaded"] = len(engine.gpu.chunks), len(engine.hosts)
    finally:
        engine.close()
    return to_numpy(out)


def _reference(case: dict) -> dict:
    from mobius.assemble import initial_model
    from scheduler.single_engine import SingleEngine

    cfg = _cfg(case, zero=False)
    model = initial_model(cfg, adapted_model(case, cfg), None)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model; two threads only contend with the workers' processes
    try:
        return _train(SingleEngine(model, cfg, torch.device("cpu")), cfg, case.get("overflow", False))
    finally:
        torch.set_num_threads(threads)


def _case(name: str, cks: dict[str, Path]) -> dict:
    ck, engine, tr, update, atol = CASES[name]
    return {"name": name, "ck": cks[ck], "engine": engine, "train": tr, "update": update, "atol": atol,
            "lora": ck == "llama"}


@pytest.mark.slow
def test_zero_delayed_equals_single_delayed(deep_checkpoint: Path, llama_checkpoint: Path) -> None:
    """Every case on 2 ranks against single mode's delayed engine on the same batches: the losses of 4
    steps, both evaluations (the newest weights; the compute weights put back after the first), every
    weight and the compute weights a checkpoint keeps within 1e-5 (fp32; bf16 within 3e-2 on the losses);
    zero sync computes step 1 alike and differs from step 2 on."""
    cks = {"deep": deep_checkpoint, "llama": llama_checkpoint}
    cases = [_case(name, cks) for name in CASES]
    results = dict(zip(CASES, spawn_cases(_run_case, cases, 2)))
    for case in cases:
        ranks, where, atol = results[case["name"]], case["name"], case["atol"]
        placement = {"mix": ranks[0]["gpu_chunks"] > 0 < ranks[0]["offloaded"], "all": ranks[0]["gpu_chunks"] == 0,
                     "none": ranks[0]["offloaded"] == 0}
        assert placement[case["engine"]["offload"]], (where, ranks[0]["gpu_chunks"], ranks[0]["offloaded"])
        check_against_reference(ranks, _reference(case), where, STEPS, atol, case["update"],
                                adapted_model(case, _cfg(case, zero=False)),
                                weights=case["train"].get("precision") != "bf16", each_once=True,
                                states=case["train"].get("optimizer_states", "fp32"), lr=case["train"].get("lr", 1e-2))
    delayed, sync = results["mix-clipped"][0]["losses"], results["sync-mix-clipped"][0]["losses"]
    assert delayed[0] == pytest.approx(sync[0], abs=1e-6) and all(abs(a - b) > 1e-4 for a, b in zip(delayed[1:],
                                                                                                     sync[1:]))


def test_zero_delayed_fp16_overflow_skips_the_update_and_still_hands_over(deep_checkpoint: Path) -> None:
    """fp16 with GPU and offloaded chunks on both ranks: an overflowing step 2 makes no update (every
    master unchanged: w_2 == w_1) yet every compute copy takes the master (step 3 computes with w_1);
    the run goes on like single mode's (fp16 tolerance) with the same skips."""
    case = {"name": "fp16-overflow", "ck": deep_checkpoint, "engine": {"ac": True, "cache": "mid", "offload": "mix"},
            "train": {"precision": "fp16"}, "update": "delayed", "lora": False, "overflow": True}
    ranks = spawn_cases(_run_case, [case], 2)[0]
    ref = _reference(case)
    assert [r["skipped"] for r in ranks] == [ref["skipped"]] * 2 == [[s == OVERFLOW_STEP for s in range(STEPS)]] * 2
    assert all(r["optimizer_step"] == STEPS - 1 for r in ranks)
    for rank in ranks:
        assert "gpu" in rank["after"] and len(rank["after"]) > 1  # GPU chunks and offloaded ones
        for k, (master, compute) in rank["after"].items():
            before_master, before_compute = rank["before"][k]
            assert (master == before_master).all(), k  # no update
            assert (compute == torch.from_numpy(master).half().float().numpy()).all(), k  # w_1 in the compute copy
            assert (compute != before_compute).any(), k  # it held w_0 before
    torch.testing.assert_close(torch.tensor(ranks[0]["losses"]), torch.tensor(ref["losses"]), rtol=0, atol=3e-2)


def test_zero_plan_counts_the_compute_copies(deep_checkpoint: Path) -> None:
    """The plan made for delayed counts one more copy of each GPU chunk's shard in the training dtype and,
    in fp32, 4 more host bytes per offloaded element; the engine refuses a plan made for the other rule."""
    from mobius.errors import MobiusError
    from partition.costs import STATE_BYTES
    from scheduler.zero import ZeroEngine

    case = _case("mix-clipped", {"deep": deep_checkpoint})
    plans = {}
    for update in ("sync", "delayed"):
        cfg = _cfg({**case, "update": update}, zero=True)
        plans[update] = _plan({**case, "update": update}, cfg, adapted_model(case, cfg))
    sync, delayed = plans["sync"], plans["delayed"]
    assert (delayed.gpu_chunks, delayed.cache_blocks) == (sync.gpu_chunks, sync.cache_blocks) and delayed.delayed
    shard = delayed.padded_chunk // delayed.world
    assert delayed.memory["gpu_shards"] == sync.memory["gpu_shards"] * (STATE_BYTES + 4) // STATE_BYTES
    offloaded = delayed.num_chunks - delayed.gpu_chunks
    assert delayed.memory["host"] - sync.memory["host"] == 4 * offloaded * shard
    assert "train.update=delayed" in delayed.summary().splitlines()[0]
    cfg = _cfg(case, zero=True)
    with pytest.raises(MobiusError, match="the zero plan was made for train.update=sync"):
        ZeroEngine(cfg, adapted_model(case, cfg), sync, None, torch.device("cpu"))


def test_zero_and_auto_accept_delayed() -> None:
    """parallel.mode=zero runs train.update=delayed, and auto may choose it."""
    from mobius.app.run import check_parallel
    from mobius.app.settings import Machine, mode_options, resolve

    for mode in ("zero", "auto"):
        cfg = config_from_dict({"model": {"preset": "gpt2-tiny"}, "train": {"micro_batches": 2, "update": "delayed"},
                                "parallel": {"mode": mode, "devices": 2, "device": "cpu"}}, "run.yaml")
        check_parallel(cfg, Machine.cpu_only())
        assert mode_options(cfg, Machine.cpu_only())["zero"] == ""
    assert resolve(cfg, Machine.cpu_only(), "zero").mode == "zero"


# ---- resuming with an update in flight, through `mobius train` -------------------------------------------
def _run_cfg(tmp: Path, ck: Path, corpus: Path, out: str, **sections: dict):
    return delayed_run_config(tmp, ck, corpus, out, 2, {"parallel": {"mode": "zero", "device": "cpu", "devices": 2},
                                                     "zero": {"chunk_size": 3000, "gpu_chunks": 4}}, **sections)


def test_zero_resume_with_an_update_in_flight(tmp_path: Path, deep_checkpoint: Path, corpus: Path) -> None:
    """4 delayed zero steps (GPU and offloaded chunks, the tied embedding, evaluations after steps 2 and 4)
    == 2 steps, the step-2 checkpoint, --resume, 2 more: the same losses, evaluations and weights, bit for
    bit. The checkpoint holds the compute weights (every trainable weight once, fp32, one update behind
    its newest), written by both ranks into one file; resumed in single mode it continues as the zero run
    did (which test_zero_delayed_equals_single_delayed holds to single mode's own delayed run)."""
    runs = lambda tmp, out, **sec: _run_cfg(tmp, deep_checkpoint, corpus, out, **sec)  # noqa: E731
    first = resumed_equals_straight(tmp_path, runs)
    plan = json.loads((tmp_path / "first" / "plan.json").read_text())
    assert plan["delayed"] and 0 < plan["gpu_chunks"] < plan["num_chunks"]
    assert [r[2] is not None for r in metric_rows(tmp_path / "first")] == [False, True, False, True]
    a = read_state_dict(first.final_dir)
    # the same checkpoint in single mode continues as the delayed run did
    resume_from(tmp_path, "first", 2, "third")
    third = train(_run_cfg(tmp_path, deep_checkpoint, corpus, "third", parallel={"mode": "single", "devices": 1}),
                  resume="auto")
    torch.testing.assert_close(torch.tensor(third.losses), torch.tensor(first.losses), rtol=0, atol=1e-5)
    c = read_state_dict(third.final_dir)
    for k in a:
        torch.testing.assert_close(c[k], a[k], rtol=0, atol=1e-5, msg=k)


class _Kept(logging.Handler):
    """The messages logged (in a worker)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _resume_case(case: dict, world: int) -> dict:
    """(In a worker) a zero engine of the case's update rule built from the checkpoint ``case["from"]``, its
    state loaded: what it logged, and whether its compute copies hold the newest weights (the masters)."""
    from mobius.assemble import weights_source
    from mobius.checkpoint import ResumeState
    from scheduler.zero import ZeroEngine

    cfg = _cfg(case, zero=True)
    mc = adapted_model(case, cfg)
    kept, logger = _Kept(), logging.getLogger("scheduler.zero.zero_engine")
    logger.addHandler(kept)
    logger.setLevel(logging.INFO)
    engine = ZeroEngine(cfg, mc, _plan(case, cfg, mc, world), None, torch.device("cpu"),
                        weights_source(cfg, mc, case["from"]))
    try:
        engine.load_state(ResumeState(case["from"]))
        shards = [engine.gpu, *(h.shards for h in engine.hosts.values())]
        newest = None if not engine.delayed else all(torch.equal(s.compute, s.master.to(s.compute.dtype))
                                                     for s in shards if s.chunks)
    finally:
        engine.close()
        logger.removeHandler(kept)
    return {"said": kept.messages, "newest": newest}


@pytest.mark.slow
def test_zero_resume_across_update_rules(tmp_path: Path, deep_checkpoint: Path, corpus: Path) -> None:
    """A sync zero checkpoint resumed delayed computes its first step with the newest weights (as sync
    does); a delayed zero checkpoint resumed sync drops its compute weights (its step 3 computes with w_2,
    not w_1); the engine says so in one line each (and resumed delayed, holds the compute weights)."""
    short = {"train": {"max_steps": 3, "warmup_steps": 3, "eval_every": 0}, "output": {"save_every": 2}}

    def cfg(out: str, update: str):
        return _run_cfg(tmp_path, deep_checkpoint, corpus, out, **{**short, "train": {**short["train"],
                                                                                       "update": update}})

    runs = {update: train(cfg(update, update)) for update in ("sync", "delayed")}
    resumed = {}
    for run, other in (("sync", "delayed"), ("delayed", "sync")):
        resume_from(tmp_path, run, 2, f"{run}-as-{other}")
        resumed[run] = train(cfg(f"{run}-as-{other}", other), resume="auto")
    sync, delayed = runs["sync"].losses, runs["delayed"].losses
    assert resumed["sync"].losses[2] == pytest.approx(sync[2], abs=1e-6)  # w_2 as sync computes step 3
    assert resumed["delayed"].losses[:2] == delayed[:2] and abs(resumed["delayed"].losses[2] - delayed[2]) > 1e-4
    step2 = {run: tmp_path / run / "checkpoints" / "step-000002" for run in runs}
    case = {"name": "resume", "ck": deep_checkpoint, "engine": {"ac": False, "cache": "min", "offload": "mix"},
            "train": {}, "lora": False}
    cases = [{**case, "update": "delayed", "from": step2["sync"]}, {**case, "update": "sync", "from": step2["delayed"]},
             {**case, "update": "delayed", "from": step2["delayed"]}]
    got = [ranks[0] for ranks in spawn_cases(_resume_case, cases, 1)]
    assert got[0] == {"said": ["train.update=delayed: resuming a sync checkpoint; the first step computes with its "
                               "newest weights"], "newest": True}
    assert got[1] == {"said": ["train.update=sync: resuming a delayed checkpoint from its newest weights; the "
                               "compute weights of its update in flight are dropped"], "newest": None}
    assert got[2] == {"said": [], "newest": False}  # the compute weights, one update behind
