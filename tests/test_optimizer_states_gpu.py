"""train.optimizer_states on a real GPU (skipped without one): the rules' torch-op version on CUDA (resident stages,
zero's GPU chunks, single mode on a GPU) bit for bit the host kernel's, and runs that update there against the
reference on the GPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mobius.app.run import train
from mobius.states import Moments, RuleUpdate, StepScalars
from test_optimizer_states import _special
from test_pipeline import _cfg
from test_zero import _run_cfg

pytestmark = pytest.mark.gpu
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@gpu
@pytest.mark.parametrize("rule", ["bf16", "int8"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_the_gpu_update_is_the_host_kernels_to_the_bit(rule: str, grad_dtype: torch.dtype) -> None:
    """The same runs (a parameter continued past a cut, a gap, a short last block), five steps, on the GPU (torch
    ops, one block) and through the host kernel: master, bf16 half copy and moments bitwise equal (CUDA's division
    and square root round correctly, as the kernel's do)."""
    n, runs = 5000, [(0, 1000, True), (1024, 2500, False), (2560, 4999, True)]
    origins = [(0, 0), (1024, 0), (1600, 576), (2560, 0)]
    out = []
    for device in ("cuda", "cpu"):
        g = torch.Generator().manual_seed(5)
        master, mo = torch.randn(n, generator=g).to(device), Moments.zeros(n, rule, device)
        half = torch.zeros(n, dtype=torch.bfloat16, device=device)
        upd = RuleUpdate(rule, runs, origins, [(0, n)], torch.device(device))
        assert (upd.tasks is None) == (device == "cuda")
        for t in range(1, 6):
            grad = _special(n, g).to(grad_dtype).to(device)
            upd.run(0, StepScalars.of(0.9, 0.95, 1e-8, 0.1, 1e-2, t, 0.7), t, master, grad, half, mo)
        out.append([x.cpu() for x in (master, half, *mo.tensors().values())])
    for a, b in zip(*out):
        assert torch.equal(a, b)


def _losses(run: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines()]


@gpu
@pytest.mark.parametrize("rule", ["bf16", "int8"])
def test_resident_stages_with_these_moments_match_the_reference_on_cuda(tmp_path: Path, deep_checkpoint: Path,
                                                                        corpus: Path, rule: str) -> None:
    """fp32, one worker, two resident stages (the GPU's update) beside swapped ones (the host kernel), against single
    mode on the GPU with the same moments: losses within 1e-4 (TF32 off)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    dev, t = {"device": "cuda"}, {"optimizer_states": rule}
    train(_cfg(tmp_path, deep_checkpoint, corpus, "ref", parallel=dev, train=t))
    train(_cfg(tmp_path, deep_checkpoint, corpus, "pipe", partition={"gpu_memory_gib": 4.0}, train=t,
               parallel={**dev, "mode": "pipeline", "devices": 1, "stages": 4, "resident_stages": [1, 2]}))
    torch.testing.assert_close(torch.tensor(_losses(tmp_path / "pipe")), torch.tensor(_losses(tmp_path / "ref")),
                               rtol=0, atol=1e-4)


@gpu
@pytest.mark.parametrize("rule", ["bf16", "int8"])
def test_zero_gpu_chunks_with_these_moments_match_the_reference_on_cuda(tmp_path: Path, deep_checkpoint: Path,
                                                                        corpus: Path, rule: str) -> None:
    """Zero mode on one GPU, some chunks' moments on the GPU and the rest offloaded, against single mode on the GPU
    with the same moments: losses and evaluations within 1e-4 (TF32 off; chunks of a multiple of 64 elements)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    dev, t = {"device": "cuda"}, {"optimizer_states": rule}
    ref = train(_run_cfg(tmp_path, deep_checkpoint, corpus, "ref", parallel=dev, train=t))
    zero = train(_run_cfg(tmp_path, deep_checkpoint, corpus, "zero", partition={"gpu_memory_gib": 4.0}, train=t,
                          parallel={**dev, "mode": "zero"}, zero={"chunk_size": 4992, "gpu_chunks": 10}))
    torch.testing.assert_close(torch.tensor(zero.losses), torch.tensor(ref.losses), rtol=0, atol=1e-4)
    torch.testing.assert_close(torch.tensor([e for _, e in zero.eval_losses]),
                               torch.tensor([e for _, e in ref.eval_losses]), rtol=0, atol=1e-4)
