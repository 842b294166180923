"""Zero mode against the single-device reference, on CPU worker processes (gloo).

The exactness matrix runs many engine configurations one after another inside one group of worker
processes per world size (spawning is the expensive part on a 2-core machine): rCache-min, a middle
size and rCache-max; every chunk offloaded, none, and half; with and without activation
checkpointing (all 18 on 1 and 2 workers, each cache size with each offload on 4); the tied GPT-2
embedding; a chunk size (4999, prime) that no world size divides and that the 9600-element token
embedding exceeds. fp32, 3 steps, losses and every parameter within 1e-5.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mobius.app.run import train
from mobius.config import config_from_dict
from mobius.errors import ConfigError
from mobius.models import unit_specs
from mobius.models.hf import read_config
from mobius.layout import build_layout
from mobius.models.params import model_params
from spawned import EXACT_EPS, case_model, spawn_cases, token_batches
from in_process import mobius

ROOT = Path(__file__).resolve().parents[1]
CHUNK = 4999  # prime: no world divides it; the token embedding (300 x 32) spans two chunks; blocks straddle chunks
MICRO = 4
STEPS = 3
MATRIX = [{"ac": ac, "cache": cache, "offload": off} for ac in (True, False) for cache in ("min", "mid", "max")
          for off in ("all", "none", "mix")]
# four workers run each cache size with each offload once, checkpointing on in 5 and off in 4 (1 and 2 workers run
# all 18: what 4 workers add is the sharding, not the combinations)
SQUARE = [{"ac": ac, "cache": cache, "offload": off} for ac, cache, off in (
    (True, "min", "all"), (True, "mid", "mix"), (True, "max", "none"),
    (False, "min", "mix"), (False, "mid", "none"), (False, "max", "all"),
    (True, "min", "none"), (False, "mid", "all"), (True, "max", "mix"))]
EXTRA = [  # two workers also run these
    {"ac": True, "cache": "mid", "offload": "mix", "train": {"grad_clip": 0.0}},  # CPU updates overlap the backward
    {"ac": False, "cache": "min", "offload": "mix", "dropout": 0.1},  # masks seeded by the global micro-batch
    {"ac": True, "cache": "max", "offload": "mix", "train": {"precision": "bf16"}, "atol": 3e-2},
    {"ac": False, "cache": "mid", "offload": "mix", "train": {"precision": "fp16"}, "atol": 3e-2},
    {"ac": True, "cache": "min", "offload": "all", "prefetch": False},  # gathers only on demand
]


def _cfg(ck: Path, case: dict, tmp: Path | None = None):
    raw = {"model": {"checkpoint": str(ck), "activation_checkpointing": case["ac"], "dropout": case.get("dropout")},
           "data": {"seq_len": 16},
           "train": {"max_steps": STEPS, "micro_batch_size": 2, "micro_batches": MICRO, "lr": 1e-2, "warmup_steps": 1,
                     "weight_decay": 0.1, "seed": 3, "eps": EXACT_EPS, **case.get("train", {})},
           "parallel": {"mode": "zero", "device": "cpu"}, "output": {"dir": str(tmp or ck.parent / "out")}}
    return config_from_dict(raw, "test_zero")


def _model_cfg(ck: Path, case: dict):
    return case_model(ck, case.get("dropout"))


def _batches(step: int, count: int = MICRO) -> list:
    return token_batches(step, count, 257)


def _reference(ck: Path, case: dict) -> dict:
    from scheduler.single_engine import SingleEngine
    from mobius.models.hf import load_checkpoint
    from mobius.optim import lr_at

    cfg = _cfg(ck, case)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model; two threads only contend with the workers' processes
    try:
        engine = SingleEngine(load_checkpoint(ck, _model_cfg(ck, case)), cfg, torch.device("cpu"))
        losses = [engine.train_step(s, _batches(s), lr_at(s, cfg.train)).loss for s in range(STEPS)]
        return {"losses": losses, "eval": engine.evaluate(_batches(99, 3)), "weights": engine.rank_state(False).weights}
    finally:
        torch.set_num_threads(threads)


def _zero_plan(cfg, mc, world: int, blocks: int, gpu: int, prefetch: bool = True):
    """The plan as configured (an estimated profile: no measuring in the workers)."""
    from partition.estimate import estimate_units
    from partition.zero import ZeroHardware, plan

    prof = estimate_units(unit_specs(mc), 2, 16, cfg.train.precision, "h100")
    hw = ZeroHardware(world, 2**30, 5e9, 5e9, 2e9, 5e9, 1e9, 1e9, name="CPU workers")
    return plan(model_params(mc), len(unit_specs(mc)), prof, hw, micro_batches=MICRO,
                checkpointing=cfg.model.activation_checkpointing, barrier=cfg.train.grad_clip > 0 or
                cfg.train.precision == "fp16", prefetch=prefetch, chunk_size=CHUNK, cache_blocks=blocks,
                gpu_chunks=gpu)


def _run_case(ck: Path, case: dict, world: int) -> dict:
    """(In a worker) one configuration: 3 steps, an evaluation, this rank's weights and the cache's record."""
    from mobius.assemble import WeightSource
    from mobius.optim import lr_at
    from partition.schedule.zero import chunk_trace, train_program
    from partition.zero import simulate_cache
    from scheduler.zero import ZeroEngine

    cfg, mc = _cfg(ck, case), _model_cfg(ck, case)
    p = _zero_plan(cfg, mc, world, case["blocks"], case["gpu"], case.get("prefetch", True))
    engine = ZeroEngine(cfg, mc, p, None, torch.device("cpu"), WeightSource(str(ck), None, cfg.train.seed))
    try:
        stats = [engine.train_step(s, _batches(s), lr_at(s, cfg.train)) for s in range(STEPS)]
        ev = engine.evaluate(_batches(99, 3))  # 3 batches: an uneven split
        weights = {k: v.numpy().copy() for k, v in engine.rank_state(False).weights.items()}
        trace = chunk_trace(train_program(engine.layout.num_units), engine.layout)
        expected = simulate_cache(trace, p.cache_blocks, p.prefetch).gathers
    finally:
        engine.close()
    return {"losses": [s.loss for s in stats], "eval": ev, "weights": weights,
            "trace_recorded": engine.cache.traces["train"] == trace,
            "gathers": [s.extra["gathers"] for s in stats], "expected_gathers": expected}


def _run_ranked(case: dict, world: int) -> dict:
    """(In a worker) :func:`_run_case` on the case's checkpoint."""
    return _run_case(case["ck"], case, world)


def _spawn(ck: Path, cases: list[dict], world: int) -> list[dict]:
    """Run ``cases`` on ``world`` worker processes; per case the ranks' results merged."""
    merged: list[dict] = []
    for ranks in spawn_cases(_run_ranked, [{**c, "ck": ck} for c in cases], world):
        out: dict = {"weights": {}}
        for rank, part in enumerate(ranks):
            assert not set(out["weights"]) & set(part["weights"]), "a parameter written by two ranks"
            out["weights"].update(part.pop("weights"))
            if rank == 0:
                out.update(part)
        merged.append(out)
    return merged


def _configure(ck: Path, case: dict, world: int) -> dict:
    layout = build_layout(model_params(read_config(ck)), len(unit_specs(read_config(ck))), CHUNK, world)
    n, lo = layout.num_chunks, layout.min_blocks
    blocks = {"min": lo, "mid": (lo + n) // 2, "max": n}[case["cache"]]
    gpu = {"all": 0, "none": n, "mix": n // 2}[case["offload"]]
    return {**case, "blocks": blocks, "gpu": gpu}


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 4])
def test_zero_matches_the_reference(deep_checkpoint: Path, world: int) -> None:
    matrix = {1: MATRIX, 2: MATRIX + EXTRA, 4: SQUARE}[world]
    cases = [_configure(deep_checkpoint, c, world) for c in matrix]
    layout = build_layout(model_params(read_config(deep_checkpoint)), 12, CHUNK, world)
    assert world == 1 or CHUNK % world, "the world must not divide the chunk size"
    assert layout.padded % world == 0 and layout.waste > 0 and layout.min_blocks > 1  # padded shards, unfilled chunks
    assert any(len(p) > 1 for p in layout.pieces)  # a parameter larger than a chunk
    refs: dict[str, dict] = {}
    for case, got in zip(cases, _spawn(deep_checkpoint, cases, world)):
        key = json.dumps({k: case.get(k) for k in ("ac", "train", "dropout")}, sort_keys=True)
        ref = refs.setdefault(key, _reference(deep_checkpoint, case))
        atol = case.get("atol", 1e-5)
        where = f"world {world}, {case}"
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=0, atol=atol,
                                   msg=where)
        assert abs(got["eval"] - ref["eval"]) <= atol, where
        assert set(got["weights"]) == set(ref["weights"]), where
        if "atol" not in case:
            for name, w in ref["weights"].items():
                torch.testing.assert_close(torch.from_numpy(got["weights"][name]), w, rtol=0, atol=atol,
                                           msg=f"{where}: {name}")
        assert got["trace_recorded"], where  # the warm-up step recorded the planner's trace
        assert got["gathers"][1:] == [got["expected_gathers"]] * (STEPS - 1), where  # Belady as simulated


# ---- through `mobius train`: resume across modes, the demo, the plan -------------------------------
def _run_cfg(tmp: Path, ck: Path, corpus: Path, out: str, **sections: dict):
    raw = {"model": {"checkpoint": str(ck)},
           "data": {"path": str(corpus), "seq_len": 16, "cache_dir": str(tmp / "cache")},
           "train": {"max_steps": 4, "micro_batch_size": 2, "micro_batches": 2, "lr": 1e-2, "warmup_steps": 1,
                     "weight_decay": 0.1, "eval_every": 2, "eval_batches": 3, "seed": 3},
           "parallel": {"mode": "single", "device": "cpu"}, "partition": {"cache_dir": str(tmp / "cache")},
           "output": {"dir": str(tmp / out), "plot": False}}
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return config_from_dict(raw, "test.yaml")


def _resume_from(tmp: Path, run: str, step: int, into: str) -> None:
    (tmp / into / "checkpoints").mkdir(parents=True)
    name = f"step-{step:06d}"
    shutil.copytree(tmp / run / "checkpoints" / name, tmp / into / "checkpoints" / name)


@pytest.mark.slow
def test_a_run_resumes_across_modes_single_zero_pipeline_and_back(tmp_path: Path, deep_checkpoint: Path,
                                                                  corpus: Path) -> None:
    """Optimizer states are stored by parameter name: zero -> pipeline -> zero continues the same run."""
    import transformers

    from mobius.models.hf import load_checkpoint

    zero = {"parallel": {"mode": "zero", "devices": 2}, "zero": {"chunk_size": 3000, "gpu_chunks": 20}}
    straight = train(_run_cfg(tmp_path, deep_checkpoint, corpus, "single"))
    first = train(_run_cfg(tmp_path, deep_checkpoint, corpus, "zero", output={"save_every": 2}, **zero))
    torch.testing.assert_close(torch.tensor(first.losses), torch.tensor(straight.losses), rtol=0, atol=1e-5)
    _resume_from(tmp_path, "zero", 2, "pipe")
    piped = train(_run_cfg(tmp_path, deep_checkpoint, corpus, "pipe", output={"save_every": 3},
                           parallel={"mode": "pipeline", "devices": 2, "stages": 4}), resume="auto")
    _resume_from(tmp_path, "pipe", 3, "back")
    back = train(_run_cfg(tmp_path, deep_checkpoint, corpus, "back", parallel={"mode": "zero", "devices": 2},
                          zero={"chunk_size": 7001, "cache_blocks": 4}), resume="auto")
    torch.testing.assert_close(torch.tensor(piped.losses), torch.tensor(straight.losses), rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.tensor(back.losses), torch.tensor(straight.losses), rtol=0, atol=1e-5)
    assert (first.final_dir / "model.safetensors.index.json").is_file()  # each rank wrote its part
    hf = transformers.AutoModelForCausalLM.from_pretrained(first.final_dir).eval()
    ids = torch.randint(0, 257, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(load_checkpoint(first.final_dir)(ids), hf(ids).logits, atol=1e-5, rtol=0)
    plan = json.loads((tmp_path / "zero" / "plan.json").read_text())
    assert (plan["world"], plan["chunk_size"], plan["gpu_chunks"]) == (2, 3000, 20)


@pytest.mark.slow
def test_demo_in_zero_mode_on_two_workers_matches_single(tmp_path: Path, demo_single: Path,
                                                          demo_data_cache: Path) -> None:
    """The issue's check: `mobius train configs/demo.yaml --parallel.mode=zero --parallel.devices=2`."""
    from conftest import DEMO_SHORT

    r = subprocess.run([sys.executable, "-m", "mobius.cli", "train", str(ROOT / "configs" / "demo.yaml"),
                        f"--output.dir={tmp_path / 'zero'}", f"--data.cache_dir={demo_data_cache}", *DEMO_SHORT,
                        f"--partition.cache_dir={tmp_path / 'cache'}", "--parallel.mode=zero",
                        "--parallel.devices=2"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "rCache:" in r.stderr and "predicted step time" in r.stderr  # the zero plan is shown before training
    rows = {n: [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
            for n, d in (("single", demo_single), ("zero", tmp_path / "zero"))}
    torch.testing.assert_close(torch.tensor([r["loss"] for r in rows["zero"]]),
                               torch.tensor([r["loss"] for r in rows["single"]]), rtol=0, atol=1e-5)
    assert rows["zero"][-1]["eval_loss"] == pytest.approx(rows["single"][-1]["eval_loss"], abs=1e-5)
    assert {"allgather_bytes", "reduce_scatter_bytes", "gathers"} <= set(rows["zero"][-1])


def test_mobius_plan_shows_the_zero_plan(tmp_path: Path) -> None:
    r = mobius(["plan", str(ROOT / "configs" / "demo.yaml"), "--parallel.mode=zero", "--parallel.devices=2",
                f"--partition.cache_dir={tmp_path}"])
    assert r.returncode == 0, r.stderr[-3000:]
    for words in ("zero: 2 rank(s)", "chunks:", "rCache:", "chunk states:", "predicted step time",
                  "GPU memory per rank", "alternatives (predicted): rcache-min", "rcache-max", "all-offload"):
        assert words in r.stdout, (words, r.stdout)
    r = mobius(["plan", str(ROOT / "configs" / "demo.yaml"), "--parallel.mode=zero", "--parallel.devices=2",
                "--zero.cache_blocks=3", "--json", f"--partition.cache_dir={tmp_path}"])
    out = json.loads(r.stdout)
    assert out["cache_blocks"] == 3 and out["decided"]["cache_blocks"] == "config" and out["world"] == 2


def test_micro_batches_must_be_a_multiple_of_the_ranks(tmp_path: Path) -> None:
    from mobius.app.settings import Machine, resolve

    cfg = config_from_dict({"model": {"preset": "gpt2-tiny"}, "train": {"micro_batches": 3},
                            "parallel": {"mode": "zero", "devices": 2, "device": "cpu"}}, "run.yaml")
    with pytest.raises(ConfigError, match=r"train.micro_batches=3 evenly among parallel.devices=2 ranks: make "
                                          r"train.micro_batches a multiple of 2"):
        resolve(cfg, Machine.cpu_only())
