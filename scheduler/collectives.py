"""Zero mode's collectives over flat buffers: every rank's equal slice gathered, a sum scattered."""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_gather_flat(out: torch.Tensor, mine: torch.Tensor, group: "dist.ProcessGroup | None" = None,
                    async_op: bool = False) -> "dist.Work | None":
    """All-gather every rank's equal slice into one flat tensor (``all_gather_single`` where torch
    has it, ``all_gather_into_tensor`` before)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, mine, group=group, async_op=async_op)


def reduce_scatter_flat(out: torch.Tensor, full: torch.Tensor, group: "dist.ProcessGroup | None" = None) -> None:
    """Sum a flat tensor over ranks and keep this rank's equal slice (``reduce_scatter_single`` where
    torch has it, ``reduce_scatter_tensor`` before)."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, full, group=group)
