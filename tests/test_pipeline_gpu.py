"""The pipeline on a real GPU (skipped without one): one worker, and two workers sharing one GPU
(each capped; NCCL refuses two ranks on one GPU, so activations go through pinned host memory)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import round_robin_cuts_with_kept_inputs
from test_pipeline import _cfg
from mobius.app.run import train

pytestmark = pytest.mark.gpu
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _losses(run: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines()]


@gpu
@pytest.mark.parametrize("workers,stages", [(1, 3), (2, 4)])
def test_pipeline_on_cuda_matches_reference(tmp_path: Path, deep_checkpoint: Path, corpus: Path, workers: int,
                                            stages: int) -> None:
    """fp32 on the GPU: the same losses as the single-GPU reference (TF32 off, tolerance 1e-4)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = {"device": "cuda"}
    train(_cfg(tmp_path, deep_checkpoint, corpus, "ref", parallel=dev))
    train(_cfg(tmp_path, deep_checkpoint, corpus, "pipe", partition={"gpu_memory_gib": 4.0},
               parallel={**dev, "mode": "pipeline", "devices": workers, "stages": stages}))
    torch.testing.assert_close(torch.tensor(_losses(tmp_path / "pipe")), torch.tensor(_losses(tmp_path / "ref")),
                               rtol=0, atol=1e-4)


@gpu
@pytest.mark.parametrize("workers,stages,kept", [(1, 4, [0, 1, 2]), (2, 6, [0, 1, 2, 3])])
def test_kept_swapped_stages_on_cuda_match_reference(tmp_path: Path, deep_checkpoint: Path, corpus: Path,
                                                     workers: int, stages: int, kept: list[int]) -> None:
    """Swapped stages keep their graphs while their slots take other stages (copy stream, slot reuse):
    fp32 losses within 1e-4 of the reference."""
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = {"device": "cuda"}
    train(_cfg(tmp_path, deep_checkpoint, corpus, "ref", parallel=dev))
    train(_cfg(tmp_path, deep_checkpoint, corpus, "pipe", partition={"gpu_memory_gib": 4.0},
               parallel={**dev, "mode": "pipeline", "devices": workers, "stages": stages, "resident_stages": [],
                         "kept_stages": kept}))
    assert json.loads((tmp_path / "pipe" / "plan.json").read_text())["kept"] == kept
    torch.testing.assert_close(torch.tensor(_losses(tmp_path / "pipe")), torch.tensor(_losses(tmp_path / "ref")),
                               rtol=0, atol=1e-4)


@gpu
@pytest.mark.parametrize("workers,stages,share", [(1, 4, 0.5), (2, 6, 1.0)])
def test_one_slot_with_a_prefetch_buffer_on_cuda_matches_reference(tmp_path: Path, deep_checkpoint: Path,
                                                                   corpus: Path, workers: int, stages: int,
                                                                   share: float, monkeypatch: pytest.MonkeyPatch
                                                                   ) -> None:
    """Partial prefetch on the copy stream: the buffer's part moves into the slot on the device after
    the slot's last use, the rest from the host; fp32 losses within 1e-4 of the reference."""
    from test_traffic import _with_buffer

    torch.backends.cuda.matmul.allow_tf32 = False
    dev = {"device": "cuda"}
    _with_buffer(monkeypatch, share)
    train(_cfg(tmp_path, deep_checkpoint, corpus, "ref", parallel=dev))
    train(_cfg(tmp_path, deep_checkpoint, corpus, "pipe", partition={"gpu_memory_gib": 4.0},
               parallel={**dev, "mode": "pipeline", "devices": workers, "stages": stages, "prefetch": False}))
    assert json.loads((tmp_path / "pipe" / "plan.json").read_text())["prefetch_bytes"] > 0
    torch.testing.assert_close(torch.tensor(_losses(tmp_path / "pipe")), torch.tensor(_losses(tmp_path / "ref")),
                               rtol=0, atol=1e-4)


@gpu
@pytest.mark.parametrize("update", ["sync", "delayed"])
def test_round_robin_on_cuda_matches_reference(tmp_path: Path, deep_checkpoint: Path, corpus: Path,
                                               update: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The round-robin runtime on two workers sharing the GPU (uploads on the copy stream from page-locked shared
    memory, kept inputs back on the reload stream, downloads on their own stream, activations through pinned host
    memory): fp32 losses within 1e-4 of the reference under the same update rule."""
    torch.backends.cuda.matmul.allow_tf32 = False
    round_robin_cuts_with_kept_inputs(monkeypatch, 2)
    dev = {"device": "cuda"}
    train(_cfg(tmp_path, deep_checkpoint, corpus, "ref", parallel=dev, train={"update": update}))
    train(_cfg(tmp_path, deep_checkpoint, corpus, "rr", partition={"gpu_memory_gib": 4.0}, train={"update": update},
               parallel={**dev, "mode": "pipeline", "devices": 2, "schedule": "round_robin"}))
    rows = [json.loads(x) for x in (tmp_path / "rr" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["schedule"] == "round_robin" for r in rows)
    assert len(json.loads((tmp_path / "rr" / "plan.json").read_text())["round_robin"]["backward"]) > 2  # reloads
    torch.testing.assert_close(torch.tensor(_losses(tmp_path / "rr")), torch.tensor(_losses(tmp_path / "ref")),
                               rtol=0, atol=1e-4)


@gpu
@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_delayed_pipeline_on_cuda_matches_reference(tmp_path: Path, deep_checkpoint: Path, corpus: Path,
                                                    clip: float) -> None:
    """train.update=delayed, every stage swapped, two workers sharing the GPU: each stage's compute copy taken on the
    optimizer thread once its download's CUDA event has passed, ahead of every AdamW (with clipping the AdamWs after
    the norm, in the downloads' order): fp32 losses within 1e-4 of the single-GPU delayed reference."""
    torch.backends.cuda.matmul.allow_tf32 = False
    dev, t = {"device": "cuda"}, {"update": "delayed", "grad_clip": clip, "max_steps": 5}
    train(_cfg(tmp_path, deep_checkpoint, corpus, "ref", parallel=dev, train=t))
    train(_cfg(tmp_path, deep_checkpoint, corpus, "pipe", train=t, partition={"gpu_memory_gib": 4.0},
               parallel={**dev, "mode": "pipeline", "devices": 2, "stages": 6, "resident_stages": []}))
    torch.testing.assert_close(torch.tensor(_losses(tmp_path / "pipe")), torch.tensor(_losses(tmp_path / "ref")),
                               rtol=0, atol=1e-4)


@gpu
def test_pipeline_on_cuda_bf16(tmp_path: Path, deep_checkpoint: Path, corpus: Path) -> None:
    """bf16 on the GPU, two workers on one GPU: close to the reference (3e-2 on the loss)."""
    dev = {"device": "cuda"}
    t = {"precision": "bf16"}
    train(_cfg(tmp_path, deep_checkpoint, corpus, "ref", parallel=dev, train=t))
    train(_cfg(tmp_path, deep_checkpoint, corpus, "pipe", train=t, partition={"gpu_memory_gib": 4.0},
               parallel={**dev, "mode": "pipeline", "devices": 2, "stages": 6}))
    torch.testing.assert_close(torch.tensor(_losses(tmp_path / "pipe")), torch.tensor(_losses(tmp_path / "ref")),
                               rtol=0, atol=3e-2)


@gpu
def test_host_buffers_are_page_locked_at_their_exact_size() -> None:
    """cudaHostRegister takes the stores' buffers (torch's pinned allocator would round 6 MB up to 8 MiB):
    page-locked, copied both ways without staging, unregistered with their owner."""
    import gc

    from scheduler import pinned

    class Owner:
        pass

    stats = getattr(torch.cuda, "host_memory_stats", lambda: {})
    before = stats().get("allocated_bytes.all.current", 0)
    owner = Owner()
    t = pinned.host_zeros(3_000_001, torch.bfloat16, True, owner)
    assert pinned._state["register"], "cudaHostRegister was refused on this machine"
    assert t.is_pinned() and t.data_ptr() % 4096 == 0
    assert stats().get("allocated_bytes.all.current", 0) == before, "not torch's pinned allocator"
    t.copy_(torch.arange(t.numel()) % 251)
    d = t.to("cuda", non_blocking=True)
    back = pinned.host_zeros(t.numel(), torch.bfloat16, True, owner)
    back.copy_(d * 2, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, t * 2)
    del owner
    gc.collect()
    assert not t.is_pinned()


@gpu
def test_a_run_plans_with_the_gpu_at_hand_when_partition_gpu_names_another(tmp_path: Path, deep_checkpoint: Path,
                                                                          corpus: Path,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    """partition.gpu: rtx3090 on this GPU: the plan is made with a profile measured here, and says so."""
    import logging

    caplog.set_level(logging.INFO)
    train(_cfg(tmp_path, deep_checkpoint, corpus, "pipe", partition={"gpu_memory_gib": 4.0, "gpu": "rtx3090"},
               parallel={"device": "cuda", "mode": "pipeline", "devices": 1, "stages": 3}))
    here = torch.cuda.get_device_name(0)
    plan = json.loads((tmp_path / "pipe" / "plan.json").read_text())
    assert plan["profile_source"] == "measured" and plan["device_name"] == here
    assert f"profile: measured on {here}" in caplog.text
    assert f"partition.gpu=rtx3090 names another GPU than this machine's {here}" in caplog.text
