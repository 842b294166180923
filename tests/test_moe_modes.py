"""Mixture-of-experts models in every mode against the single-device reference, on 2 CPU worker processes
(gloo): the swapped pipeline (swapped, kept and resident stages), the round-robin schedule, zero mode (with and
without activation checkpointing), sync and delayed, full fine-tuning and LoRA on the experts. The router's
load-balancing loss couples every MoE layer of a micro-batch, wherever its layers run: each case checks the
losses, evaluations, every weight (and the compute weights a delayed checkpoint keeps) within 1e-5, and the
step's aux loss and expert shares in the metrics. The checkpoint's router_aux_loss_coef is 0.5, so that a stage
whose backward left its aux term out would be seen (a case whose workers leave it out fails). Two torchrun
"nodes" in zero mode, resuming (a delayed run through `mobius train`; the torchrun run's checkpoint in single
mode), and the final checkpoint in transformers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from conftest import make_hf_moe
from spawned import EXACT_EPS, adapted_model, check_against_reference, exact_config, pipeline_plan, round_robin_plan
from spawned import spawn_cases
from spawned import to_numpy, token_batches, train_delayed_case

STEPS, MICRO = 4, 4
SWAPPED = {"resident_stages": [], "kept_stages": []}
AUX_COEF = 0.5

# name -> checkpoint, mode, its settings, train settings
CASES = {
    # 4 swapped stages of 8 units on 2 workers: every stage's backward recomputes its routing
    "pipeline-swapped-clipped": ("qwen", "pipeline", {"stages": 4, **SWAPPED}, {}),
    # kept stages (the forward's routing graph kept), a resident one, delayed, no clipping
    "pipeline-kept-resident-delayed": ("mixtral", "pipeline", {"stages": 5, "resident_stages": [2],
                                                               "kept_stages": [0, 1]},
                                       {"update": "delayed", "grad_clip": 0.0}),
    # round robin: a backward cut inside a forward op (units 3 and 5's inputs kept in the stash)
    "round-robin-sync": ("qwen", "round_robin", {"cuts": ((0, 2, 6), (0, 3, 5, 6))}, {}),
    "round-robin-delayed": ("mixtral", "round_robin", {"cuts": ((0, 3, 5), (0, 2, 4, 5))}, {"update": "delayed"}),
    # zero: unit-major, each rank's micro-batches through every unit
    "zero-checkpointing-delayed": ("qwen", "zero", {"ac": True}, {"update": "delayed"}),
    "zero-kept-graphs": ("mixtral", "zero", {"ac": False}, {"grad_clip": 0.0}),
    # LoRA (all-linear: every expert's adapters, the router's, attention's; norms trained; frozen weights in the
    # training dtype behind what trains); lr 1e-3 as the dense LoRA matrices
    "pipeline-lora-resident-kept": ("qwen", "pipeline", {"stages": 4, "resident_stages": [1], "kept_stages": [0, 2]},
                                    {"lr": 1e-3}),
    "round-robin-lora-delayed": ("mixtral", "round_robin", {"cuts": ((0, 3, 5), (0, 2, 4, 5))},
                                 {"update": "delayed", "lr": 1e-3}),
    "zero-lora": ("qwen", "zero", {"ac": True}, {"lr": 1e-3}),
    # GPT-OSS: sinks, a 4-token window in every other layer, biased experts; LoRA on its experts by parameter name
    "pipeline-gpt-oss-kept": ("gpt_oss", "pipeline", {"stages": 4, "resident_stages": [], "kept_stages": [1]}, {}),
    "zero-gpt-oss-lora-delayed": ("gpt_oss", "zero", {"ac": False}, {"update": "delayed", "lr": 1e-3}),
}
LORA_TARGETS = {"gpt_oss": ["q_proj", "o_proj", "gate_up_proj", "down_proj"]}  # (else all-linear)


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny Qwen3-MoE (6 layers, the second dense), a Mixtral and a GPT-OSS (6 layers each),
    router_aux_loss_coef 0.5."""
    from mobius.data import byte_tokenizer

    root = tmp_path_factory.mktemp("moe")
    out = {}
    for name, model_type, kw in (("qwen", "qwen3_moe", {"mlp_only_layers": [1]}), ("mixtral", "mixtral", {}),
                                 ("gpt_oss", "gpt_oss", {})):
        out[name] = root / name
        make_hf_moe(model_type, num_hidden_layers=6, router_aux_loss_coef=AUX_COEF, **kw).save_pretrained(out[name])
        byte_tokenizer().save(out[name])
    return out


def _cfg(case: dict, world: int, tmp: Path):
    mode, par = case["mode"], case["parallel"]
    if not world:
        parallel = {"mode": "single", "device": "cpu", "devices": 1}
    elif mode == "zero":
        parallel = {"mode": "zero", "device": "cpu", "devices": world}
    else:
        parallel = {"mode": "pipeline", "device": "cpu", "devices": world,
                    **({"stages": 4, **SWAPPED} if mode == "round_robin" else par)}
    model = {"activation_checkpointing": par["ac"]} if mode == "zero" else None
    cfg = exact_config(case, case["name"], STEPS, MICRO, case["train"], parallel, tmp / "out", model=model,
                       partition={"cache_dir": str(tmp / "cache")})
    if case["lora"] and case["ck"].name in LORA_TARGETS:
        cfg.lora.targets = LORA_TARGETS[case["ck"].name]
    return cfg


def _batches(step: int, count: int = MICRO) -> list:
    return token_batches(step, count, 300)


def _zero_plan(cfg, mc, world: int):
    """Zero mode's plan on an estimated profile, half the chunks offloaded."""
    from mobius.layout import build_layout
    from mobius.models import unit_specs
    from mobius.models.params import model_params
    from partition.estimate import estimate_units
    from partition.zero import ZeroHardware, plan

    units, chunk = len(unit_specs(mc)), 4999
    layout = build_layout(model_params(mc), units, chunk, world)
    trained = sum(layout.trains(c) for c in range(layout.num_chunks))
    prof = estimate_units(unit_specs(mc), 2, 16, cfg.train.precision, "h100")
    hw = ZeroHardware(world, 2**30, 5e9, 5e9, 2e9, 5e9, 1e9, 1e9, name="CPU workers")
    blocks = (layout.min_blocks + layout.num_chunks) // 2
    return plan(model_params(mc), units, prof, hw, micro_batches=MICRO,
                checkpointing=cfg.model.activation_checkpointing, barrier=cfg.train.barrier, chunk_size=chunk,
                cache_blocks=blocks, gpu_chunks=trained // 2, delayed=cfg.train.delayed)


def _planned(case: dict, world: int, tmp: Path) -> dict:
    cfg = _cfg(case, world, tmp)
    mc = adapted_model(case, cfg)
    out = {**case, "cfg": cfg, "model_cfg": mc}
    if case["mode"] == "zero":
        return {**out, "plan": _zero_plan(cfg, mc, world), "settings": None}
    plan, settings = pipeline_plan(cfg, mc)
    if case["mode"] == "round_robin":
        plan = round_robin_plan(plan, *case["parallel"]["cuts"], mc.num_hidden_layers + 2)
    return {**out, "plan": plan, "settings": settings}


def _recorded(engine) -> list[dict]:
    """Each training step's routing metrics, as the engine reports them (wraps its train_step)."""
    seen, step = [], engine.train_step

    def train_step(*args, **kw):
        stats = step(*args, **kw)
        seen.append({k: v for k, v in (stats.extra or {}).items() if k.startswith(("aux", "expert"))})
        return stats
    engine.train_step = train_step
    return seen


def _train(engine, cfg) -> dict:
    seen = _recorded(engine)
    out = train_delayed_case(engine, cfg, STEPS, _batches, lambda e: {})
    return {**out, "routing": seen}


def _run_case(case: dict, world: int) -> dict:
    """(In a worker) the case's steps through the engine `mobius train` builds (zero: on the case's plan)."""
    from mobius.app.launch import make_engine, open_device
    from mobius.assemble import WeightSource
    from scheduler.zero import ZeroEngine

    cfg, source = case["cfg"], WeightSource(str(case["ck"]), None, case["cfg"].train.seed)
    if case.get("no_aux_on_workers"):
        import mobius.routing

        mobius.routing.aux_weight = lambda *a: 0.0
    if case["mode"] == "zero":
        engine = ZeroEngine(cfg, case["model_cfg"], case["plan"], None, torch.device("cpu"), source)
    else:
        engine = make_engine(cfg, case["model_cfg"], case["plan"], case["settings"],
                             open_device(case["settings"], int(os.environ["LOCAL_RANK"])), source)
    try:
        out = _train(engine, cfg)
    finally:
        engine.close()
    return to_numpy(out)


def _reference(case: dict, tmp: Path) -> dict:
    from mobius.assemble import initial_model
    from scheduler.single_engine import SingleEngine

    cfg = _cfg(case, 0, tmp)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers: the CPU's sums over threads come out the same
    try:
        model = initial_model(cfg, adapted_model(case, cfg), None)
        return _train(SingleEngine(model, cfg, torch.device("cpu")), cfg)
    finally:
        torch.set_num_threads(threads)


def _case(name: str, cks: dict[str, Path], **extra) -> dict:
    ck, mode, par, train = CASES[name]
    return {"name": name, "ck": cks[ck], "mode": mode, "parallel": par, "train": train, "lora": "lora" in name,
            **extra}


def _check_routing(ranks: list[dict], ref: dict, where: str) -> None:
    for r in ranks:
        assert len(r["routing"]) == STEPS and all(s["aux_loss"] > 0 for s in r["routing"]), where
        for got, want in zip(r["routing"], ref["routing"]):
            assert got.keys() == want.keys(), where
            assert got["aux_loss"] == pytest.approx(want["aux_loss"], abs=1e-5), where
            assert got["expert_share_max"] == want["expert_share_max"], where
            assert got["expert_share_min"] == want["expert_share_min"], where


@pytest.mark.slow
def test_every_mode_trains_an_moe_like_the_reference(tmp_path: Path, moe_checkpoints: dict[str, Path]) -> None:
    """Each case on 2 workers equals single mode on the same batches (losses, evaluations, every weight, the
    compute weights; the aux loss and the expert shares of every step)."""
    cases = [_planned(_case(name, moe_checkpoints), 2, tmp_path) for name in CASES]
    for case, ranks in zip(cases, spawn_cases(_run_case, cases, 2)):
        ref = _reference(case, tmp_path)
        check_against_reference(ranks, ref, case["name"], STEPS, 1e-5, case["train"].get("update", "sync"),
                                case["model_cfg"], behind=False)
        _check_routing(ranks, ref, case["name"])
        assert len(ref["routing"][0]["expert_share_max"]) == len(case["model_cfg"].moe_layers)
        if case["lora"]:
            assert any(".experts.adapters.lora_B." in n for r in ranks for n in r["trained"]), case["name"]


def test_a_worker_that_leaves_the_aux_out_is_seen(tmp_path: Path, moe_checkpoints: dict[str, Path]) -> None:
    """The control of the matrix above: workers whose backward takes no aux term end far from the reference."""
    case = _planned(_case("pipeline-swapped-clipped", moe_checkpoints, no_aux_on_workers=True), 2, tmp_path)
    ranks = spawn_cases(_run_case, [case], 2)[0]
    ref = _reference(case, tmp_path)
    assert max(abs(a - b) for a, b in zip(ranks[0]["losses"][1:], ref["losses"][1:])) > 1e-3


# ---- through `mobius train`: torchrun nodes, resuming, the final checkpoint -------------------------------
def _run_raw(tmp: Path, ck: Path, corpus: Path, out: str, parallel: dict, **train_keys: object) -> dict:
    """A 4-step run of the corpus (AdamW's eps as the matrices': an expert that few tokens reach has gradients
    near 1e-8, where the summation order of 4 ranks against 1 moves its weights by 1e-5)."""
    return {"model": {"checkpoint": str(ck)},
            "data": {"path": str(corpus), "seq_len": 16, "cache_dir": str(tmp / "cache")},
            "train": {"max_steps": 4, "micro_batch_size": 2, "micro_batches": 4, "lr": 1e-2, "warmup_steps": 1,
                      "weight_decay": 0.1, "eval_every": 0, "eval_batches": 2, "seed": 3, "eps": EXACT_EPS,
                      **train_keys},
            "parallel": {"device": "cpu", **parallel}, "partition": {"cache_dir": str(tmp / "cache")},
            "output": {"dir": str(tmp / out), "plot": False, "save_every": 2}}


def _metrics(run: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_torchrun_nodes_train_an_moe_like_one_device_and_resume_on_one(tmp_path: Path,
                                                                      moe_checkpoints: dict[str, Path],
                                                                      corpus: Path) -> None:
    """Zero mode over two torchrun "nodes" of 2 ranks each equals single mode (losses, aux losses, expert shares,
    final weights); its step-2 checkpoint resumed in single mode goes on as single mode did; its final/ loads in
    transformers with mobius's logits."""
    import json

    import transformers

    from mobius.app.run import train
    from mobius.config import config_from_dict
    from mobius.models.hf import load_checkpoint, read_state_dict
    from test_models import _logits
    from test_torchrun import _two_nodes

    ck = moe_checkpoints["qwen"]
    ref = train(config_from_dict(_run_raw(tmp_path, ck, corpus, "ref", {"mode": "single"}), "ref.yaml"))
    run_file = tmp_path / "run.yaml"
    run_file.write_text(json.dumps(_run_raw(tmp_path, ck, corpus, "two", {"mode": "zero"})))
    nodes = _two_nodes(run_file)
    outs = [p.communicate(timeout=300) for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], "\n".join(err[-3000:] for _, err in outs)
    two, one = _metrics(tmp_path / "two"), _metrics(ref.final_dir.parent)
    torch.testing.assert_close(torch.tensor([r["loss"] for r in two]), torch.tensor(ref.losses), rtol=0, atol=1e-5)
    for a, b in zip(two, one):
        assert a["aux_loss"] == pytest.approx(b["aux_loss"], abs=1e-5)
        assert a["expert_share_max"] == b["expert_share_max"] and a["expert_share_min"] == b["expert_share_min"]
    weights, expected = read_state_dict(tmp_path / "two" / "final"), read_state_dict(ref.final_dir)
    assert set(weights) == set(expected) and any(".experts.3.down_proj." in k for k in weights)
    for k in expected:
        torch.testing.assert_close(weights[k], expected[k], rtol=0, atol=1e-5, msg=k)
    resumed = train(config_from_dict(_run_raw(tmp_path, ck, corpus, "resumed", {"mode": "single"}), "resumed.yaml"),
                    resume=str(tmp_path / "two" / "checkpoints" / "step-000002"))
    torch.testing.assert_close(torch.tensor(resumed.losses), torch.tensor(ref.losses), rtol=0, atol=1e-5)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "two" / "final").eval()
    ids = torch.randint(0, 300, (2, 16))
    torch.testing.assert_close(_logits(hf, ids), _logits(load_checkpoint(tmp_path / "two" / "final"), ids),
                               atol=1e-5, rtol=0)


def test_a_delayed_round_robin_moe_run_resumes_with_its_update_in_flight(tmp_path: Path,
                                                                         moe_checkpoints: dict[str, Path],
                                                                         corpus: Path) -> None:
    """4 delayed round-robin steps of the Mixtral == 2 steps, the step-2 checkpoint, --resume, 2 more: the same
    losses, metrics lines and final weights."""
    from spawned import delayed_run_config, resumed_equals_straight

    def runs(tmp: Path, out: str, **sections: dict):
        mode = {"parallel": {"mode": "pipeline", "device": "cpu", "devices": 2, "schedule": "round_robin"}}
        return delayed_run_config(tmp, moe_checkpoints["mixtral"], corpus, out, 3, mode, **sections)

    first = resumed_equals_straight(tmp_path, runs, compute_file=False)
    rows = _metrics(tmp_path / "first")
    assert all(r["schedule"] == "round_robin" and r["aux_loss"] > 0 for r in rows) and len(first.losses) == 4
