"""Bytes moved per step: the simulator (which the planner trusts) against what the runtime counts.

A GPT-2 whose every parameter is a multiple of the layout's alignment (hidden 64), so that the bytes
a stage's flat buffer moves equal its parameters' bytes. Each plan trains two steps on CPU workers;
the second step's host->device and device->host bytes (summed over workers: stage uploads, boundary
inputs offloaded and reloaded, gradient downloads, activations through host memory) must equal the
simulated step's to the byte. A rule that one side applies and the other does not (an input
reloaded for a stage that never offloaded it, say) shows up here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import make_hf_model, round_robin_cuts_with_kept_inputs
from mobius.app.run import train
from mobius.config import config_from_dict
from mobius.models import tied_param_count, unit_specs
from mobius.models.hf import read_config
from partition.hardware import Hardware
from partition.schedule_comparison import ScheduleComparison
from partition.estimate import estimate_units
from partition.roundrobin_plan import RoundRobinPlan, simulate_round_robin
from partition.schedule import PipelineOptions
from partition.simulate import simulate

PLANS = {  # name -> (workers, stages, parallel settings); 12 units: embed, 10 blocks, head
    "swapped": (2, 6, {"resident_stages": [], "kept_stages": []}),
    "offload-kept-resident": (2, 6, {"resident_stages": [3], "kept_stages": [1, 3], "offload_inputs": "on"}),
    "four-workers-offload": (4, 8, {"resident_stages": [], "kept_stages": [2], "offload_inputs": "on"}),
    # worker 0 holds both ends of the tied embedding and head: stage 0's backward upload brings the head's gradient
    "tied-ends-on-one-worker": (2, 5, {"resident_stages": [], "kept_stages": [0]}),
    "one-slot-prefetch-buffer": (2, 6, {"resident_stages": [], "kept_stages": [1], "prefetch": False,
                                        "offload_inputs": "on"}),
}
BUFFERED = {"one-slot-prefetch-buffer": 0.6}  # a prefetch buffer of this share of the largest stage's weights


@pytest.fixture(scope="module")
def aligned_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mobius.data import byte_tokenizer

    d = tmp_path_factory.mktemp("aligned") / "gpt2-64"
    make_hf_model("gpt2", n_layer=10, n_embd=64, n_head=4, vocab_size=320, n_positions=64, resid_pdrop=0.0,
                  embd_pdrop=0.0, attn_pdrop=0.0).save_pretrained(d)
    byte_tokenizer().save(d)
    return d


@pytest.mark.parametrize("name", list(PLANS))
def test_simulated_bytes_equal_the_runtimes(tmp_path: Path, aligned_checkpoint: Path, corpus: Path,
                                            name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    workers, stages, par = PLANS[name]
    if name in BUFFERED:  # the plan as the planner makes it where two slots do not fit
        _with_buffer(monkeypatch, BUFFERED[name])
    raw = {"model": {"checkpoint": str(aligned_checkpoint)},
           "data": {"path": str(corpus), "seq_len": 16, "cache_dir": str(tmp_path / "cache")},
           "train": {"max_steps": 2, "micro_batch_size": 2, "micro_batches": 3, "eval_every": 0, "seed": 3},
           "parallel": {"mode": "pipeline", "device": "cpu", "devices": workers, "stages": stages, **par},
           "partition": {"cache_dir": str(tmp_path / "cache")}, "output": {"dir": str(tmp_path / "run"), "plot": False}}
    train(config_from_dict(raw, "test.yaml"))
    plan = ScheduleComparison.from_json(json.loads((tmp_path / "run" / "plan.json").read_text())).swapped
    opts = plan.options
    assert (sorted(opts.resident), sorted(opts.kept), opts.offload_inputs) == (par["resident_stages"], par["kept_stages"],
                                                                             par.get("offload_inputs") == "on")
    assert (plan.options.prefetch_bytes > 0) == (name in BUFFERED)
    measured = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    prof = estimate_units(unit_specs(read_config(aligned_checkpoint)), 2, 16, "fp32", "h100")
    prof.tied_params = tied_param_count(read_config(aligned_checkpoint))  # as the planner counts it
    hw = Hardware.uniform(workers, 2**34, 1e9)  # no peer access: activations take two host hops, as over gloo
    sim = simulate(prof, plan.boundaries, hw, plan.worker_gpus, 3, plan.options)
    assert measured["h2d_bytes"] == pytest.approx(sum(sim.h2d_bytes), rel=1e-9), sim.bytes_by_kind
    assert measured["d2h_bytes"] == pytest.approx(sum(sim.d2h_bytes), rel=1e-9), sim.bytes_by_kind
    assert measured["p2p_bytes"] == sum(sim.p2p_bytes) == 0
    assert measured["overflow_bytes"] == 0  # every message found a slot in its mailbox
    if plan.options.offload_inputs:
        assert sim.bytes_by_kind.get("ckpt", 0) > 0  # inputs did go to host memory
    assert plan.worker_gpus[0] == plan.worker_gpus[(stages - 1) % workers] or name != "tied-ends-on-one-worker"


def _with_buffer(monkeypatch: pytest.MonkeyPatch, share: float) -> None:
    """`mobius train` plans one slot with a prefetch buffer of ``share`` of the largest swapped stage."""
    from dataclasses import replace

    from mobius.app import planning

    plan_pipeline = planning.PLANNERS["pipeline"]

    def buffered(*args, **kwargs):
        plans, prof, hw = plan_pipeline(*args, **kwargs)
        plan = plans.swapped
        largest = max(s.param_bytes for s in plan.stages if s.index not in plan.options.resident)
        plan.options = replace(plan.options, prefetch_bytes=int(share * largest))
        return plans, prof, hw
    monkeypatch.setitem(planning.PLANNERS, "pipeline", buffered)


@pytest.mark.parametrize("workers,update", [(2, "sync"), (4, "delayed")])
def test_round_robin_moves_the_bytes_simulated(tmp_path: Path, aligned_checkpoint: Path, corpus: Path, workers: int,
                                                update: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The round-robin runtime with the cuts its plan chose: per-round uploads of every op, the inputs of the
    backward ops' first units to host memory and back, per-round gradient downloads, activations through host
    memory, as the simulator counts them for the same cuts (cuts with kept inputs and more ops than workers)."""
    round_robin_cuts_with_kept_inputs(monkeypatch, workers)
    raw = {"model": {"checkpoint": str(aligned_checkpoint)},
           "data": {"path": str(corpus), "seq_len": 16, "cache_dir": str(tmp_path / "cache")},
           "train": {"max_steps": 2, "micro_batch_size": 2, "micro_batches": 3, "eval_every": 0, "seed": 3,
                     "update": update},
           "parallel": {"mode": "pipeline", "device": "cpu", "devices": workers, "schedule": "round_robin"},
           "partition": {"cache_dir": str(tmp_path / "cache")}, "output": {"dir": str(tmp_path / "run"), "plot": False}}
    train(config_from_dict(raw, "test.yaml"))
    plan = ScheduleComparison.from_json(json.loads((tmp_path / "run" / "plan.json").read_text())).runs
    cuts = plan.cuts  # as plan.json keeps them
    measured = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert isinstance(plan, RoundRobinPlan) and measured["schedule"] == "round_robin" and measured["update"] == update
    prof = estimate_units(unit_specs(read_config(aligned_checkpoint)), 2, 16, "fp32", "h100")
    hw = Hardware.uniform(workers, 2**34, 1e9)
    options = PipelineOptions(barrier=plan.options.barrier, delayed=plan.options.delayed)
    sim = simulate_round_robin(prof, cuts, hw, plan.worker_gpus, 3, options)
    assert sim.bytes_by_kind["ckpt"] > 0 and cuts.num_ops > workers, (cuts, sim.bytes_by_kind)  # inputs kept
    assert measured["h2d_bytes"] == pytest.approx(sum(sim.h2d_bytes), rel=1e-9), sim.bytes_by_kind
    assert measured["d2h_bytes"] == pytest.approx(sum(sim.d2h_bytes), rel=1e-9), sim.bytes_by_kind
    assert measured["p2p_bytes"] == sum(sim.p2p_bytes) == 0
    assert measured["overflow_bytes"] == 0  # every message found a slot in its mailbox


@pytest.mark.parametrize("zero", [{"chunk_size": 20_000, "gpu_chunks": 3, "cache_blocks": 4},
                                  {"chunk_size": 50_000, "gpu_chunks": 0}])
def test_zero_modes_counted_bytes_equal_its_plans(tmp_path: Path, aligned_checkpoint: Path, corpus: Path,
                                                   zero: dict) -> None:
    """Zero mode on two ranks: the bytes each rank counts where it gathers, uploads, reduce-scatters and
    downloads equal the plan's per-rank traffic (its simulation of the same program and rCache)."""
    raw = {"model": {"checkpoint": str(aligned_checkpoint)},
           "data": {"path": str(corpus), "seq_len": 16, "cache_dir": str(tmp_path / "cache")},
           "train": {"max_steps": 2, "micro_batch_size": 2, "micro_batches": 4, "eval_every": 0, "seed": 3},
           "parallel": {"mode": "zero", "device": "cpu", "devices": 2}, "zero": zero,
           "partition": {"cache_dir": str(tmp_path / "cache")}, "output": {"dir": str(tmp_path / "run"), "plot": False}}
    train(config_from_dict(raw, "test.yaml"))
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    measured = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert plan["num_chunks"] > plan["gpu_chunks"]  # some chunks live in host memory
    for kind, predicted in plan["traffic"].items():
        assert measured[kind] == pytest.approx(predicted, rel=1e-9), kind
    assert measured["forward_s"] > 0 and measured["backward_s"] > 0  # beside the plan's compute (zero_phases)
