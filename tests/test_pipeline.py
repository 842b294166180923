"""The swapped pipeline against the single-device reference, on CPU worker processes (gloo)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from mobius.config import config_from_dict
from mobius.models.hf import read_state_dict
from partition import ScheduleComparison
from spawned import EXACT_EPS, case_model, spawn_cases, token_batches
from mobius.app.run import train
from in_process import mobius

ROOT = Path(__file__).resolve().parents[1]


def test_upload_arbiter_serves_the_earlier_stage_first(tmp_path: Path) -> None:
    """Two workers of one root complex: a later-ordered upload waits while an earlier one is pending."""
    import threading

    from scheduler.arbiter import UploadArbiter

    name = f"mobius-test-{os.getpid()}"
    a = UploadArbiter(name, 0, 2, [0, 1], create=True)
    b = UploadArbiter(name, 1, 2, [0, 1], create=False)
    events: list[str] = []
    a.acquire(3)  # worker 0's upload of an earlier stage is pending
    t = threading.Thread(target=lambda: (b.acquire(5), events.append("b")))
    start = time.process_time()
    t.start()
    time.sleep(0.3)
    events.append("a")
    a.release()
    t.join(timeout=5)
    assert events == ["a", "b"]
    assert time.process_time() - start < 0.1  # the waiter slept (no busy waiting)
    b.release()
    lone = UploadArbiter(name, 1, 2, [1], create=False)  # a worker alone on its root complex never waits
    lone.acquire(0)
    b.close()
    lone.close()
    a.close()
    assert not Path("/dev/shm", name).exists()


# ---- exactness against the reference trainer ------------------------------------------------------
def _cfg(tmp: Path, ck: Path, corpus: Path, out: str, **sections: dict):
    raw = {"model": {"checkpoint": str(ck)},
           "data": {"path": str(corpus), "seq_len": 16, "cache_dir": str(tmp / "cache")},
           "train": {"max_steps": 3, "micro_batch_size": 2, "micro_batches": 3, "lr": 1e-2, "warmup_steps": 1,
                     "weight_decay": 0.1, "eval_every": 0, "eval_batches": 2, "seed": 3},
           "parallel": {"mode": "single", "device": "cpu"},
           "output": {"dir": str(tmp / out), "plot": False}}
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return config_from_dict(raw, "test.yaml")


def _compare(a: Path, b: Path, atol: float) -> None:
    la = [json.loads(x)["loss"] for x in (a / "metrics.jsonl").read_text().splitlines()]
    lb = [json.loads(x)["loss"] for x in (b / "metrics.jsonl").read_text().splitlines()]
    torch.testing.assert_close(torch.tensor(lb), torch.tensor(la), rtol=0, atol=atol)
    _compare_weights(a, b, atol)


def _compare_weights(a: Path, b: Path, atol: float) -> None:
    wa, wb = read_state_dict(a / "final"), read_state_dict(b / "final")
    assert set(wa) == set(wb)
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=0, atol=atol, msg=k)


SWAPPED = {"resident_stages": [], "kept_stages": []}  # the paper's pipeline: every stage swapped, recomputed

# ---- exactness: every case against the single-device reference, batched per spawn ------------------
# Each case is planned here (as `mobius train` plans it: the measured CPU profile, the forced stages)
# and run by one engine after another inside one group of worker processes per world size, on the
# same token batches as a single-device reference (cached per training setting): losses, the
# evaluation loss and every parameter after 3 steps within 1e-5.
STEPS, MICRO = 3, 3

# 2 workers, 6 stages: worker 0 runs stages 0, 2, 4 and worker 1 runs 1, 3, 5; the tied embedding/head
# (stages 0 and 5) stay swapped. Any stage but the last may keep its activations: a swapped kept stage's
# slot takes other stages before its backward, which reads the weights from the backward's upload.
MIXES = {
    "kept-swapped-clipped": ({"resident_stages": [], "kept_stages": [0, 1, 2, 3]}, {}),
    "kept-swapped-offload-no-clip": ({"resident_stages": [], "kept_stages": [1, 2], "offload_inputs": "on"},
                                     {"grad_clip": 0.0}),
    "kept-swapped-and-resident": ({"resident_stages": [3], "kept_stages": [0, 2, 3]}, {}),
    "resident-clipped": ({"resident_stages": [1, 2], "kept_stages": []}, {}),
    "kept-last-swapped": ({"resident_stages": [], "kept_stages": [4]}, {}),
    "resident-kept-no-clip": ({"resident_stages": [2, 3], "kept_stages": [2, 3, 4]}, {"grad_clip": 0.0}),
    "all-but-ends-offload": ({"resident_stages": [1, 2, 3, 4], "kept_stages": [1, 4], "offload_inputs": "on"}, {}),
    "worker-all-resident": ({"resident_stages": [1, 3], "kept_stages": [1, 3]}, {"grad_clip": 0.0}),
}
# 5 swapped stages on 2 workers: dropout masks seeded per unit (updates as gradients arrive); boundary
# inputs waiting in host memory; one device slot, where every stage's backward upload reuses the slot
# its forward had.
VARIANTS = {
    "dropout-no-clip": ({}, {"grad_clip": 0.0}, 0.1),
    "dropout-kept": ({"kept_stages": [0, 1, 2, 3]}, {"grad_clip": 0.0}, 0.1),
    "no-prefetch-sequential": ({"prefetch": False, "mapping": "sequential"}, {}, None),
    "no-prefetch-kept": ({"prefetch": False, "mapping": "sequential", "kept_stages": [0, 2, 3]}, {}, None),
    "offload-inputs": ({"offload_inputs": "on"}, {}, None),
}
# one device slot and a prefetch buffer (partial prefetch) of half the largest stage's weights, or of all
# of them: the next stage's first elements wait in the buffer and move into the slot on the device
BUFFERED = {
    "buffer-half-stage-kept": ({"prefetch": False, "kept_stages": [0, 2]}, {}, 0.5),
    "buffer-whole-stage-offload-no-clip": ({"prefetch": False, "offload_inputs": "on"}, {"grad_clip": 0.0}, 1.0),
}


def _cases(deep: Path, untied: Path, world: int) -> list[dict]:
    """The exactness matrix for ``world`` workers: name, checkpoint, parallel and train settings."""
    case = lambda name, ck, par, tr=None, dropout=None: {"name": name, "ck": ck, "parallel": par,  # noqa: E731
                                                          "train": tr or {}, "dropout": dropout}
    stages = (4, 6) if world == 2 else (8, 12)
    out = [case(f"swapped-{world}x{n}", deep, {"stages": n, **SWAPPED}) for n in stages]
    if world == 2:
        out += [case(name, deep, {"stages": 6, **par}, tr) for name, (par, tr) in MIXES.items()]
        out += [case(f"{name}", deep, {"stages": 5, **SWAPPED, **par}, tr, dropout)
                for name, (par, tr, dropout) in VARIANTS.items()]
        out += [{**case(name, deep, {"stages": 5, **SWAPPED, **par}, tr), "buffer": share}
                for name, (par, tr, share) in BUFFERED.items()]
        # an untied head lets the ends stay on the GPU: token ids and targets go to resident stages
        out += [case(f"resident-ends-clip-{clip:g}", untied, {"stages": 6, "resident_stages": [0, 1, 5],
                                                             "kept_stages": [0, 1]}, {"grad_clip": clip})
                for clip in (1.0, 0.0)]
    return out


def _exact_cfg(case: dict, world: int, tmp: Path):
    raw = {"model": {"checkpoint": str(case["ck"]), "dropout": case["dropout"]},
           "data": {"seq_len": 16},
           "train": {"max_steps": STEPS, "micro_batch_size": 2, "micro_batches": MICRO, "lr": 1e-2,
                     "warmup_steps": 1, "weight_decay": 0.1, "seed": 3, "eps": EXACT_EPS, **case["train"]},
           "parallel": {"mode": "pipeline" if world else "single", "device": "cpu", "devices": max(world, 1),
                        **(case["parallel"] if world else {})},
           "partition": {"cache_dir": str(tmp / "cache")}, "output": {"dir": str(tmp / "out")}}
    return config_from_dict(raw, case["name"])


def _model_cfg(case: dict):
    return case_model(case["ck"], case["dropout"])


def _batches(step: int, count: int = MICRO) -> list:
    return token_batches(step, count, 300)


def _train(engine, cfg) -> dict:
    from mobius.optim import lr_at

    losses = [engine.train_step(s, _batches(s), lr_at(s, cfg.train)).loss for s in range(STEPS)]
    return {"losses": losses, "eval": engine.evaluate(_batches(99, 2)), "weights": engine.rank_state(False).weights}


def _run_pipeline_case(case: dict, world: int) -> dict:
    """(In a worker) one planned case through the engine `mobius train` builds."""
    from mobius.app.launch import make_engine, open_device
    from mobius.assemble import WeightSource

    cfg = case["cfg"]
    engine = make_engine(cfg, _model_cfg(case), case["plan"], case["settings"],
                         open_device(case["settings"], int(os.environ["LOCAL_RANK"])),
                         WeightSource(str(case["ck"]), None, cfg.train.seed))
    try:
        out = _train(engine, cfg)
    finally:
        engine.close()
    out["weights"] = {k: v.numpy().copy() for k, v in out["weights"].items()}
    return out


def _reference(case: dict, tmp: Path) -> dict:
    from scheduler.single_engine import SingleEngine
    from mobius.models.hf import load_checkpoint

    cfg = _exact_cfg(case, 0, tmp)
    return _train(SingleEngine(load_checkpoint(case["ck"], _model_cfg(case)), cfg, torch.device("cpu")), cfg)


def _planned(case: dict, world: int, tmp: Path) -> dict:
    from mobius.app.planning import plan_pipeline
    from mobius.app.settings import Machine, resolve

    cfg = _exact_cfg(case, world, tmp)
    machine = Machine.detect(cfg)
    settings = resolve(cfg, machine)
    plan = plan_pipeline(cfg, _model_cfg(case), settings, machine)[0].swapped
    par = case["parallel"]
    for key in ("resident", "kept"):
        if f"{key}_stages" in par:
            assert sorted(getattr(plan.options, key)) == par[f"{key}_stages"], case["name"]
    if "buffer" in case:  # as the planner sizes it where two slots do not fit (here: a share of the largest stage)
        largest = max(s.param_bytes for s in plan.stages if s.index not in plan.options.resident)
        plan.options = replace(plan.options, prefetch_bytes=int(case["buffer"] * largest))
    return {**case, "cfg": cfg, "settings": settings, "plan": plan}


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_pipeline_matches_the_reference(tmp_path: Path, deep_checkpoint: Path, untied_checkpoint: Path,
                                        world: int) -> None:
    """Every stage swapped (4 and 6 stages on 2 workers, 8 and 12 on 4); on 2 workers also resident
    stages (device AdamW) and kept activations mixed with swapped stages, resident first and last
    stages, dropout, offloaded boundary inputs and a single device slot."""
    cases = [_planned(c, world, tmp_path) for c in _cases(deep_checkpoint, untied_checkpoint, world)]
    refs: dict[str, dict] = {}
    for case, ranks in zip(cases, spawn_cases(_run_pipeline_case, cases, world)):
        key = json.dumps({"ck": str(case["ck"]), "train": case["train"], "dropout": case["dropout"]}, sort_keys=True)
        ref = refs.setdefault(key, _reference(case, tmp_path))
        where = case["name"]
        torch.testing.assert_close(torch.tensor(ranks[0]["losses"]), torch.tensor(ref["losses"]), rtol=0, atol=1e-5,
                                   msg=where)
        got: dict = {}
        for part in ranks:
            for name, w in part["weights"].items():  # a tied weight comes from both of its stages' workers
                assert name not in got or (got[name] == w).all(), f"{where}: {name} differs between ranks"
                got[name] = w
        assert set(got) == set(ref["weights"]), where
        for name, w in ref["weights"].items():
            torch.testing.assert_close(torch.from_numpy(got[name]), w, rtol=0, atol=1e-5, msg=f"{where}: {name}")
        assert abs(ranks[0]["eval"] - ref["eval"]) <= 1e-5, where


def test_impossible_resident_or_kept_stages_are_config_errors(tmp_path: Path, deep_checkpoint: Path,
                                                              corpus: Path) -> None:
    from mobius.errors import ConfigError

    base = {"mode": "pipeline", "devices": 2, "stages": 6}
    for extra, match in (({"resident_stages": [0]}, r"stage\(s\) \[0\] hold an end of the tied"),
                         ({"resident_stages": [7]}, r"out of range: the plan has 6 stages"),
                         ({"kept_stages": [5]}, r"stage\(s\) \[5\] cannot keep activations: the last stage")):
        with pytest.raises(ConfigError, match=match):
            train(_cfg(tmp_path, deep_checkpoint, corpus, "x", parallel={**base, **extra}), overwrite=True)


def test_pipeline_fp16_with_loss_scaling(tmp_path: Path, deep_checkpoint: Path, corpus: Path) -> None:
    """fp16: dynamic loss scaling across workers (the overflow check is global); close to the reference."""
    t = {"precision": "fp16"}
    train(_cfg(tmp_path, deep_checkpoint, corpus, "ref", train=t))
    train(_cfg(tmp_path, deep_checkpoint, corpus, "pipe", train=t,
               parallel={"mode": "pipeline", "devices": 2, "stages": 4}))
    rows = [json.loads(x) for x in (tmp_path / "pipe" / "metrics.jsonl").read_text().splitlines()]
    assert all("loss_scale" in r for r in rows)
    la = [json.loads(x)["loss"] for x in (tmp_path / "ref" / "metrics.jsonl").read_text().splitlines()]
    torch.testing.assert_close(torch.tensor([r["loss"] for r in rows]), torch.tensor(la), rtol=0, atol=3e-2)


def test_host_memory_is_checked_before_allocating(monkeypatch: pytest.MonkeyPatch) -> None:
    from mobius.errors import MobiusError
    from mobius.models import get_preset
    from scheduler import stage_store
    from scheduler.stages import stage_layouts

    cfg = get_preset("opt-1.3b")
    layouts = stage_layouts(cfg, [0, 13, 26])
    need = stage_store.host_bytes(layouts, torch.bfloat16)
    assert need == sum(lay.numel for lay in layouts) * 18  # fp32 master + AdamW + bf16 copy + fp32 grads
    monkeypatch.setattr(stage_store, "available_host_bytes", lambda: 8 * 2**30)
    with pytest.raises(MobiusError, match=r"needs 2[0-9.]+ GiB of host memory .* only 8\.0 GiB is available"):
        stage_store.check_host_memory(need, "worker 0's stages")


def test_resident_stages_with_fp16_loss_scaling(tmp_path: Path, deep_checkpoint: Path, corpus: Path) -> None:
    """fp16 with resident stages: their device AdamW takes the loss scale out like the CPU one."""
    t = {"precision": "fp16"}
    train(_cfg(tmp_path, deep_checkpoint, corpus, "ref", train=t))
    train(_cfg(tmp_path, deep_checkpoint, corpus, "pipe", train=t,
               parallel={"mode": "pipeline", "devices": 2, "stages": 4, "resident_stages": [1, 2], "kept_stages": [1]}))
    la = [json.loads(x)["loss"] for x in (tmp_path / "ref" / "metrics.jsonl").read_text().splitlines()]
    lb = [json.loads(x)["loss"] for x in (tmp_path / "pipe" / "metrics.jsonl").read_text().splitlines()]
    torch.testing.assert_close(torch.tensor(lb), torch.tensor(la), rtol=0, atol=3e-2)


def test_half_gradient_downloads_stay_close_to_fp32_downloads(tmp_path: Path, deep_checkpoint: Path,
                                                              corpus: Path) -> None:
    """bf16 gradients down (into the half copy): the update sees sums rounded to bf16, so the run
    stays within bf16 rounding of the fp32-download run; the host needs 14 bytes per parameter, but the
    tied head's end (the embedding's store updates it; both ends on worker 0 of 5 stages) its half copy
    and gradient alone: 2 (its gradient comes down into that copy) and 6."""
    t = {"precision": "bf16"}
    hf = json.loads((deep_checkpoint / "config.json").read_text())
    tied = hf["vocab_size"] * hf["n_embd"]
    runs = {}
    for dtype in ("fp32", "half"):
        par = {"mode": "pipeline", "devices": 2, "stages": 5, "grad_download": dtype, **SWAPPED}
        runs[dtype] = train(_cfg(tmp_path, deep_checkpoint, corpus, dtype, train=t, parallel=par))
        plan = json.loads((tmp_path / dtype / "plan.json").read_text())
        per, end = (18, 6) if dtype == "fp32" else (14, 2)
        assert plan["grad_dtype"] == dtype and plan["host_bytes"] == per * plan["param_count"] - (per - end) * tied
    torch.testing.assert_close(torch.tensor(runs["half"].losses), torch.tensor(runs["fp32"].losses), rtol=0, atol=2e-2)
    down = {d: json.loads((tmp_path / d / "metrics.jsonl").read_text().splitlines()[0])["d2h_bytes"] for d in runs}
    assert down["half"] < 0.6 * down["fp32"]  # gradient bytes halved (activation hops are the same)
    wa, wb = read_state_dict(tmp_path / "fp32" / "final"), read_state_dict(tmp_path / "half" / "final")
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=0, atol=2e-2, msg=k)


def test_pipeline_bf16_is_close_to_reference(tmp_path: Path, deep_checkpoint: Path, corpus: Path) -> None:
    """bf16: half-precision weights and boundary activations in the pipeline, fp32 masters and
    autocast in the reference: close, not equal (tolerance 3e-2 on the loss)."""
    t = {"precision": "bf16"}
    train(_cfg(tmp_path, deep_checkpoint, corpus, "ref", train=t))
    train(_cfg(tmp_path, deep_checkpoint, corpus, "pipe", train=t,
               parallel={"mode": "pipeline", "devices": 2, "stages": 4}))
    la = [json.loads(x)["loss"] for x in (tmp_path / "ref" / "metrics.jsonl").read_text().splitlines()]
    lb = [json.loads(x)["loss"] for x in (tmp_path / "pipe" / "metrics.jsonl").read_text().splitlines()]
    torch.testing.assert_close(torch.tensor(lb), torch.tensor(la), rtol=0, atol=3e-2)


@pytest.mark.slow
def test_pipeline_resume_and_checkpoint_loads_in_transformers(tmp_path: Path, deep_checkpoint: Path,
                                                              corpus: Path) -> None:
    import shutil

    import transformers

    from mobius.models.hf import load_checkpoint

    par = {"parallel": {"mode": "pipeline", "devices": 2, "stages": 4}}
    tr = {"max_steps": 4, "eval_every": 2}
    straight = train(_cfg(tmp_path, deep_checkpoint, corpus, "straight", train=tr, **par))
    train(_cfg(tmp_path, deep_checkpoint, corpus, "first", train=tr, output={"save_every": 2}, **par))
    (tmp_path / "second" / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "first" / "checkpoints" / "step-000002",
                    tmp_path / "second" / "checkpoints" / "step-000002")
    # resume under another partition: optimizer states are stored by parameter name
    resumed = train(_cfg(tmp_path, deep_checkpoint, corpus, "second", train=tr,
                         parallel={"mode": "pipeline", "devices": 2, "stages": 6}), resume="auto")
    torch.testing.assert_close(torch.tensor(resumed.losses), torch.tensor(straight.losses), rtol=0, atol=1e-5)
    final = straight.final_dir
    assert (final / "model.safetensors.index.json").is_file()
    hf = transformers.AutoModelForCausalLM.from_pretrained(final).eval()
    ids = torch.randint(0, 257, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(load_checkpoint(final)(ids), hf(ids).logits, atol=1e-5, rtol=0)


def test_resume_single_then_pipeline_then_single_matches_the_uninterrupted_run(tmp_path: Path, deep_checkpoint: Path,
                                                                               corpus: Path) -> None:
    """One checkpoint format for every mode: 2 steps single, 2 steps pipeline, 2 steps single."""
    import shutil

    tr, out = {"max_steps": 6, "eval_every": 0}, {"save_every": 2, "keep_last": 3}
    pipe = {"mode": "pipeline", "devices": 2, "stages": 4}
    straight = train(_cfg(tmp_path, deep_checkpoint, corpus, "straight", train=tr))
    train(_cfg(tmp_path, deep_checkpoint, corpus, "a", train=tr, output=out))
    for name, source in (("b", tmp_path / "a" / "checkpoints" / "step-000002"),
                         ("c", tmp_path / "b" / "checkpoints" / "step-000004")):
        (tmp_path / name / "checkpoints").mkdir(parents=True)
        shutil.copytree(source, tmp_path / name / "checkpoints" / source.name)
        run = train(_cfg(tmp_path, deep_checkpoint, corpus, name, train=tr, output=out,
                         parallel=pipe if name == "b" else {}), resume="auto")
        torch.testing.assert_close(torch.tensor(run.losses), torch.tensor(straight.losses), rtol=0, atol=1e-5)
    _compare_weights(tmp_path / "straight", tmp_path / "c", atol=1e-5)


@pytest.mark.slow
def test_demo_pipeline_on_two_workers_matches_single(tmp_path: Path, demo_single: Path, demo_data_cache: Path) -> None:
    """The issue's check: the demo config, planned by partition/, on 2 CPU workers == single."""
    from conftest import DEMO_SHORT

    common = [f"--data.cache_dir={demo_data_cache}", *DEMO_SHORT, f"--partition.cache_dir={tmp_path / 'cache'}"]
    pipe = ["--parallel.mode=pipeline", "--parallel.devices=2", "--parallel.trace_step=2"]
    shown = mobius(["plan", str(ROOT / "configs" / "demo.yaml"), "--json", *common, *pipe])
    assert shown.returncode == 0, shown.stderr[-3000:]
    r = subprocess.run([sys.executable, "-m", "mobius.cli", "train", str(ROOT / "configs" / "demo.yaml"),
                        f"--output.dir={tmp_path / 'pipe'}", *common, *pipe], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "predicted step time" in r.stderr  # the plan summary is shown before training
    assert "plan reused: made on " in r.stderr  # the plan shown, kept: not searched again
    _compare(demo_single, tmp_path / "pipe", atol=1e-5)
    shown_plan = ScheduleComparison.from_json(json.loads(shown.stdout)).runs
    ran = ScheduleComparison.from_json(json.loads((tmp_path / "pipe" / "plan.json").read_text())).runs
    assert shown_plan.runtime_settings() == ran.runtime_settings()  # the plan shown is the plan run
    trace = json.loads((tmp_path / "pipe" / "trace-step2.json").read_text())["traceEvents"]
    spans = [e for e in trace if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {1, 2}  # both workers
    assert {e["name"][0] for e in spans} >= {"F", "B", "U", "D", "O"}  # compute, uploads, downloads, CPU AdamW
    assert _received_after_sent(spans) > 0
    from scheduler.trace import TRACE_TRACKS

    dispatched = {e["name"] for e in spans if e["tid"] == TRACE_TRACKS.index("dispatch")}
    assert "R" in dispatched and any(n.startswith("U") for n in dispatched)  # the dispatch thread's own time
    lines = [json.loads(x) for x in (tmp_path / "pipe" / "metrics.jsonl").read_text().splitlines()]
    # the traced step ran as any other; the next one waited to write its trace: left out of the medians
    assert [r.get("traced", False) for r in lines] == [r["step"] == 3 for r in lines]
    assert all(0 <= r["reduce_wait_s"] <= r["reduce_s"] < r["step_s"] for r in lines)
    # the dispatch thread's own time, its compute, what held it and the step's end are apart: they fit in the step
    assert all(0 < r["dispatch_s"] and r["dispatch_s"] + r["forward_s"] + r["backward_s"] + r["upload_wait_s"]
               + r["reduce_s"] <= r["step_s"] for r in lines), lines
    # on CPU workers the dispatch thread's time inside its computes is the compute (a GPU's: launching it)
    assert all(r["launch_s"] == pytest.approx(r["forward_s"] + r["backward_s"], rel=0.05, abs=1e-3) for r in lines)
    assert all(0 < r["compute_spread"] < 2 for r in lines)  # one stage's micro-batches vary some, on a busy VM


def _received_after_sent(spans: list[dict]) -> int:
    """Each forward whose input came from the other worker starts after that worker's forward ended (the workers'
    tracks on one clock); how many such pairs the trace holds."""
    import re

    at = {}
    for e in spans:
        m = re.fullmatch(r"F(\d+),(\d+)", e["name"])
        if m and e["tid"] == 0:
            at[int(m[1]), int(m[2])] = e
    pairs = [(at[j - 1, m], e) for (j, m), e in at.items() if (j - 1, m) in at and at[j - 1, m]["pid"] != e["pid"]]
    for sent, got in pairs:
        assert got["ts"] >= sent["ts"] + sent["dur"] - 1, (sent, got)  # (microseconds)
    return len(pairs)


def test_a_step_trace_puts_every_worker_on_one_clock(tmp_path: Path) -> None:
    """Each worker times its spans from where it began the step; the trace shifts them to where the first began."""
    from scheduler.trace import StepTrace, write_step_trace

    first, second = StepTrace(torch.device("cpu")), StepTrace(torch.device("cpu"))
    second.t0 = first.t0 + 0.25  # the second worker began the step 250 ms later
    for trace in (first, second):
        trace.add("compute", "F0,0", trace.t0 + 0.001, trace.t0 + 0.002)

    class Two:
        def all_gather_object(self, mine: object) -> list[object]:
            return [mine, (second.t0, second.events(2))]

    write_step_trace(first, Two(), 0, torch.device("cpu"), str(tmp_path), 1)
    spans = [e for e in json.loads((tmp_path / "trace-step1.json").read_text())["traceEvents"] if e["ph"] == "X"]
    assert sorted((e["pid"], round(e["ts"])) for e in spans) == [(1, 1000), (2, 251000)]


def test_a_run_measures_its_cpu_adamw_rate_for_the_next_plan(tmp_path: Path, deep_checkpoint: Path,
                                                             corpus: Path) -> None:
    """After a few steps the engine keeps the CPU AdamW rate it saw inside its steps; the next plan on
    this machine uses it instead of a fixed share of the rate measured alone."""
    from mobius.app.planning import hardware
    from mobius.app.settings import Machine, resolve
    from partition.cpu_rate import CPU_UPDATE_IN_STEP, cpu_update_rate, cpu_update_rate_in_step
    from scheduler.pipeline_engine import IN_STEP_STEPS, IN_STEP_WARMUP

    cache = tmp_path / "plan-cache"
    par = {"mode": "pipeline", "devices": 2, "stages": 4, **SWAPPED}
    cfg = _cfg(tmp_path, deep_checkpoint, corpus, "pipe", parallel=par, partition={"cache_dir": str(cache)},
               train={"max_steps": IN_STEP_WARMUP + IN_STEP_STEPS})
    settings = resolve(cfg, Machine.detect(cfg))
    before = hardware(cfg, settings, Machine.detect(cfg)).cpu_adam_params_per_s
    alone = cpu_update_rate(settings.cpu_threads, "fp32", cache / "partition")
    assert before == pytest.approx(CPU_UPDATE_IN_STEP * alone)
    train(cfg)
    rate, source = cpu_update_rate_in_step(settings.cpu_threads, "fp32", cache / "partition", "cpu")
    assert source == "measured inside training steps on this machine" and 1e5 < rate < 1e11
    assert hardware(cfg, settings, Machine.detect(cfg)).cpu_adam_params_per_s == rate


def test_receives_from_gloo_links_are_posted_when_the_step_begins() -> None:
    """Gloo moves a message only once its receive is posted: a step's receives from CPU workers' links are posted
    up front, in list order; those from the worker itself (in place) and from NCCL links (matched in order) are
    posted where the list has them."""
    from partition.schedule import Action, Kind
    from scheduler.counters import Counters
    from scheduler.links import DirectLink, LocalLink, post_early

    gloo = DirectLink(1, Counters())
    assert gloo.posts_early and not LocalLink.posts_early and not DirectLink(1, Counters(), torch.device("cuda")).posts_early
    actions = [Action(Kind.RECV_ACT, 1, 0, peer=1), Action(Kind.FORWARD, 1, 0), Action(Kind.RECV_ACT, 2, 0, peer=0),
               Action(Kind.FORWARD, 2, 0), Action(Kind.RECV_GRAD, 1, 1, peer=1), Action(Kind.SEND_ACT, 2, 0, peer=1)]
    posted: list[Action] = []
    post_early(actions, {0: LocalLink(), 1: gloo}, posted.append)
    assert posted == [actions[0], actions[4]]


def test_compute_spread_pools_the_variation_of_one_kind_and_stage() -> None:
    """``ComputeSpans.spread``: the standard deviation over the mean of one stage's computes of one kind within a
    step, pooled over the kinds and stages with two or more (here 0.8, 1.0 and 1.2 times their mean, and one
    backward alone, which says nothing)."""
    from scheduler.trace import ComputeSpans

    spans = ComputeSpans(torch.device("cpu"))
    assert spans.spread() == 0.0
    spans.alike = {("F", 0): [(0.0, 0.8), (1.0, 2.0), (2.0, 3.2)], ("B", 0): [(0.0, 2.0)],
                   ("F", 1): [(0.0, 0.5), (1.0, 1.5)]}
    assert spans.spread() == pytest.approx((0.08 / 3) ** 0.5)


def test_compute_spans_report_each_workers_own_phases_through_the_sum_over_workers() -> None:
    """``ComputeSpans.stats``: summed over the workers (the step's all-reduce), the phases are the workers' total
    and ``by_worker`` gives each worker's own back, in rank order."""
    from scheduler.trace import ComputeSpans, by_worker

    stats = []
    for rank, (f, b) in enumerate([(0.2, 0.5), (0.3, 0.4)]):
        spans = ComputeSpans(torch.device("cpu"))
        spans.spans = {"forward": [(0.0, f)], "backward": [(1.0, 1.0 + b)]}
        stats.append(spans.stats(rank, 2))
    total = {k: sum(s[k] for s in stats) for k in stats[0]}
    assert (total["forward_s"], total["backward_s"]) == (pytest.approx(0.5), pytest.approx(0.9))
    assert by_worker(total, 2) == {"forward_by_worker": [0.2, 0.3], "backward_by_worker": [0.5, 0.4]}


def test_a_trace_is_written_by_the_step_after_the_traced_one_or_at_once_by_the_last() -> None:
    """``HeldTrace``: the traced step runs as any other; the step after it writes the trace (and says it waited),
    so the traced step is a steady one; a trace of the run's last step is written by that step."""
    from scheduler.trace import HeldTrace

    written: list[tuple[object, int]] = []
    held = HeldTrace(last_step=5)
    waited = [held.step_ran("trace" if s == 1 else None, s, lambda t, n: written.append((t, n))) for s in range(5)]
    assert waited == [False, False, True, False, False] and written == [("trace", 2)]
    written.clear()
    last = HeldTrace(last_step=3)
    waited = [last.step_ran("trace" if s == 2 else None, s, lambda t, n: written.append((t, n))) for s in range(3)]
    assert waited == [False, False, True] and written == [("trace", 3)]
