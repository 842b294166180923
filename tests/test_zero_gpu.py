"""Zero mode on a real GPU (skipped without one): one rank with CUDA streams, pinned host shards and
the CPU AdamW thread; fp32 against the reference, bf16 close to it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mobius.app.run import train
from test_zero import _run_cfg

pytestmark = pytest.mark.gpu
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@gpu
@pytest.mark.parametrize("ac,blocks,update", [(True, 4, "sync"), (False, 0, "sync"), (True, 4, "delayed")])
def test_zero_on_cuda_matches_reference(tmp_path: Path, deep_checkpoint: Path, corpus: Path, ac: bool,
                                        blocks: int, update: str) -> None:
    """fp32, half the chunks offloaded, rCache-min or the search's: the reference's losses and evaluations
    (TF32 off, 1e-4); train.update=delayed too (GPU compute copies, CPU updates beside the next step)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    dev, t = {"device": "cuda"}, {"update": update}
    model = {"activation_checkpointing": ac}
    ref = train(_run_cfg(tmp_path, deep_checkpoint, corpus, "ref", parallel=dev, model=model, train=t))
    zero = train(_run_cfg(tmp_path, deep_checkpoint, corpus, "zero", model=model, partition={"gpu_memory_gib": 4.0},
                          parallel={**dev, "mode": "zero"}, zero={"chunk_size": 4999, "cache_blocks": blocks,
                                                                  "gpu_chunks": 15}, train=t))
    torch.testing.assert_close(torch.tensor(zero.losses), torch.tensor(ref.losses), rtol=0, atol=1e-4)
    torch.testing.assert_close(torch.tensor([e for _, e in zero.eval_losses]),
                               torch.tensor([e for _, e in ref.eval_losses]), rtol=0, atol=1e-4)


@gpu
def test_zero_on_cuda_bf16_is_close(tmp_path: Path, deep_checkpoint: Path, corpus: Path) -> None:
    dev, t = {"device": "cuda"}, {"precision": "bf16"}
    ref = train(_run_cfg(tmp_path, deep_checkpoint, corpus, "ref", parallel=dev, train=t))
    zero = train(_run_cfg(tmp_path, deep_checkpoint, corpus, "zero", train=t, partition={"gpu_memory_gib": 4.0},
                          parallel={**dev, "mode": "zero"}, zero={"chunk_size": 4999, "gpu_chunks": 10}))
    torch.testing.assert_close(torch.tensor(zero.losses), torch.tensor(ref.losses), rtol=0, atol=3e-2)
