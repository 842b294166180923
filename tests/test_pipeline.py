"""The swapped pipeline against the single-device reference, on CPU worker processes (gloo)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mobius.config import config_from_dict
from mobius.models.hf import read_state_dict
from mobius.app.run import train
from partition.schedule import COMPUTE, Kind, build_schedule, timeline, uploads_in_order

ROOT = Path(__file__).resolve().parents[1]


# ---- the schedule as data -------------------------------------------------------------------------
@pytest.mark.parametrize("S,N,M", [(4, 2, 2), (6, 2, 3), (12, 4, 2), (3, 1, 4), (1, 1, 2), (8, 4, 1)])
@pytest.mark.parametrize("slots", [2, 1])
def test_schedule_invariants(S: int, N: int, M: int, slots: int) -> None:
    s = build_schedule(S, N, M, num_slots=slots)  # check() runs inside: residency, slots, one update
    computes = [a for acts in s.actions for a in acts if a.kind in COMPUTE]
    assert sorted((a.stage, a.micro) for a in computes if a.kind != Kind.BACKWARD) == [(j, m) for j in range(S)
                                                                                        for m in range(M)]
    assert len([a for a in computes if a.kind == Kind.BACKWARD]) == (S - 1) * M
    pairs = {Kind.SEND_ACT: "act", Kind.SEND_GRAD: "grad", Kind.RECV_ACT: "act", Kind.RECV_GRAD: "grad"}
    sends = sorted((pairs[a.kind], a.stage, a.micro) for acts in s.actions for a in acts
                   if a.kind in (Kind.SEND_ACT, Kind.SEND_GRAD))
    recvs = sorted((pairs[a.kind], a.stage + (-1 if a.kind == Kind.RECV_ACT else 1), a.micro)
                   for acts in s.actions for a in acts if a.kind in (Kind.RECV_ACT, Kind.RECV_GRAD))
    assert sends == recvs
    uploads = sum(a.kind == Kind.UPLOAD for acts in s.actions for a in acts)
    resident_turns = min(S, N)  # each worker's last forward stage stays for its first backward
    assert uploads == 2 * S - resident_turns
    grid = timeline(s)
    assert grid.count("gpu") == N and "FB" in grid


def test_prefetch_issues_the_next_upload_before_the_current_stage_computes() -> None:
    acts = [str(a) for a in build_schedule(6, 2, 2, num_slots=2).actions[0]]
    assert acts.index("Uf2") < acts.index("F0,0")  # stage 2 uploads while stage 0 computes
    assert acts.index("Uf4") < acts.index("F2,0")
    acts = [str(a) for a in build_schedule(6, 2, 2, num_slots=1).actions[0]]
    assert acts.index("Uf2") > acts.index("Xf0")  # only after stage 0 is freed
    order = uploads_in_order(build_schedule(6, 2, 2))
    assert order[:6] == [(j, "f") for j in range(6)] and order[6:] == [(3, "b"), (2, "b"), (1, "b"), (0, "b")]


def test_upload_arbiter_serves_the_earlier_stage_first(tmp_path: Path) -> None:
    """Two workers of one root complex: a later-ordered upload waits while an earlier one is pending."""
    import threading

    from scheduler.comm import UploadArbiter

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
    wa, wb = read_state_dict(a / "final"), read_state_dict(b / "final")
    assert set(wa) == set(wb)
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=0, atol=atol, msg=k)


@pytest.mark.parametrize("workers,stages", [(2, 4), (2, 6), (4, 8), (4, 12)])
def test_pipeline_matches_reference(tmp_path: Path, deep_checkpoint: Path, corpus: Path, workers: int,
                                    stages: int) -> None:
    train(_cfg(tmp_path, deep_checkpoint, corpus, "ref"))
    train(_cfg(tmp_path, deep_checkpoint, corpus, "pipe",
               parallel={"mode": "pipeline", "devices": workers, "stages": stages}))
    _compare(tmp_path / "ref", tmp_path / "pipe", atol=1e-5)


@pytest.mark.parametrize("variant", ["dropout-no-clip", "no-prefetch-sequential", "offload-inputs"])
def test_pipeline_variants_match_reference(tmp_path: Path, deep_checkpoint: Path, corpus: Path, variant: str) -> None:
    if variant == "dropout-no-clip":  # dropout masks seeded per unit; updates as gradients arrive
        extra = dict(model={"dropout": 0.1}, train={"grad_clip": 0.0})
        par = {}
    elif variant == "offload-inputs":  # boundary inputs wait in host memory, come back with the upload
        extra, par = {}, {"offload_inputs": "on"}
    else:
        extra, par = {}, {"prefetch": False, "mapping": "sequential"}
    train(_cfg(tmp_path, deep_checkpoint, corpus, "ref", **extra))
    train(_cfg(tmp_path, deep_checkpoint, corpus, "pipe",
               parallel={"mode": "pipeline", "devices": 2, "stages": 5, **par}, **extra))
    _compare(tmp_path / "ref", tmp_path / "pipe", atol=1e-5)


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
    from mobius.models import get_preset, tied_weights
    from scheduler import store
    from scheduler.stages import stage_layouts

    cfg = get_preset("opt-1.3b")
    layouts = stage_layouts(cfg, [0, 13, 26], tied_weights(cfg))
    need = store.host_bytes(layouts, torch.bfloat16)
    assert need == sum(lay.numel for lay in layouts) * 18  # fp32 master + AdamW + bf16 copy + fp32 grads
    monkeypatch.setattr(store, "available_host_bytes", lambda: 8 * 2**30)
    with pytest.raises(MobiusError, match=r"needs 2[0-9.]+ GiB of host memory .* only 8\.0 GiB is available"):
        store.check_host_memory(need, "worker 0's stages")


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


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"spawn_main" in cmd:
                out.append(int(entry))
    return out


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds worker processes through /proc")
def test_a_killed_worker_stops_the_run_with_a_clear_message(tmp_path: Path, deep_checkpoint: Path,
                                                           corpus: Path) -> None:
    cfg = tmp_path / "run.yaml"
    cfg.write_text(json.dumps(_cfg(tmp_path, deep_checkpoint, corpus, "killed", train={"max_steps": 100000},
                                   parallel={"mode": "pipeline", "devices": 2, "stages": 4}).to_dict()))
    proc = subprocess.Popen([sys.executable, "-m", "mobius.cli", "train", str(cfg)], stderr=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    metrics = tmp_path / "killed" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.is_file() and metrics.read_text().count("\n") >= 2):
        time.sleep(0.2)
    workers = _children(proc.pid)
    while len(workers) != 2 and time.time() < deadline:
        time.sleep(0.2)
        workers = _children(proc.pid)
    assert len(workers) == 2, workers
    os.kill(workers[-1], signal.SIGKILL)
    start = time.time()
    _, err = proc.communicate(timeout=60)
    assert time.time() - start < 35
    assert proc.returncode == 2
    assert "was killed (SIGKILL)" in err and "Traceback" not in err, err[-2000:]


def test_demo_pipeline_on_two_workers_matches_single(tmp_path: Path) -> None:
    """The issue's check: the demo config, planned by partition/, on 2 CPU workers == single."""
    common = [f"--data.cache_dir={tmp_path / 'cache'}", "--train.max_steps=4", "--train.eval_every=2",
              f"--partition.cache_dir={tmp_path / 'cache'}"]
    pipe = ["--parallel.mode=pipeline", "--parallel.devices=2", "--parallel.trace_step=2"]
    for name, extra in (("single", []), ("pipe", pipe)):
        r = subprocess.run([sys.executable, "-m", "mobius.cli", "train", str(ROOT / "configs" / "demo.yaml"),
                            f"--output.dir={tmp_path / name}", *common, *extra], capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
    assert "predicted step time" in r.stderr  # the plan summary is shown before training
    _compare(tmp_path / "single", tmp_path / "pipe", atol=1e-5)
    trace = json.loads((tmp_path / "pipe" / "trace-step2.json").read_text())["traceEvents"]
    spans = [e for e in trace if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {1, 2}  # both workers
    assert {e["name"][0] for e in spans} >= {"F", "B", "U", "D", "O"}  # compute, uploads, downloads, CPU AdamW
