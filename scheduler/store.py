"""The host side of a stage: fp32 master weights, AdamW states, the half-precision upload copy and
the gradient download buffer, all flat; and the CPU AdamW update that runs on them.

Host bytes per parameter: 4 (fp32 master) + 8 (AdamW m, v) + 2 (pinned half copy; none in fp32) +
4 (pinned fp32 gradient) = 18. Gradients come down in fp32 (summed over micro-batches on the GPU):
twice the bytes of half-precision gradients on the GPU->host direction, which uploads do not use,
and no conversion pass on the CPU, whose AdamW is the slowest part of a step.
:func:`check_host_memory` computes this before anything is allocated.
"""

from __future__ import annotations

import logging
import threading

import torch
from torch import nn

from mobius.config import TrainSection
from mobius.errors import MobiusError
from mobius.optim import adamw, set_lr
from scheduler.stages import StageLayout

log = logging.getLogger(__name__)


def host_bytes(layouts: list[StageLayout], train_dtype: torch.dtype) -> int:
    """Host memory the stores of these stages need (see the module docstring)."""
    half = 0 if train_dtype == torch.float32 else 2
    return sum(lay.numel for lay in layouts) * (4 + 8 + half + 4)


def available_host_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_host_memory(needed: int, what: str) -> None:
    avail = available_host_bytes()
    if avail is not None and needed > avail:
        raise MobiusError(f"{what} needs {needed / 2**30:.1f} GiB of host memory for weights, optimizer states and "
                          f"transfer buffers, but only {avail / 2**30:.1f} GiB is available")


class HostStage:
    """One stage's flat host buffers and its AdamW."""

    def __init__(self, layout: StageLayout, train_dtype: torch.dtype, cfg: TrainSection, pin: bool):
        self.layout, self.dtype = layout, train_dtype
        n = layout.numel
        self.master = torch.zeros(n, dtype=torch.float32, pin_memory=pin and train_dtype == torch.float32)
        self.half = self.master if train_dtype == torch.float32 else torch.empty(n, dtype=train_dtype, pin_memory=pin)
        self.grad = torch.zeros(n, dtype=torch.float32, pin_memory=pin)  # fp32 gradients arrive here
        d = layout.decay_numel
        self._flat = [nn.Parameter(self.master[:d]), nn.Parameter(self.master[d:])]
        self.optimizer = adamw([f for f in self._flat[:1] if f.numel()], [f for f in self._flat[1:] if f.numel()],
                               cfg, fused=True)
        self.updated = threading.Event()  # set when master/half hold this step's weights
        self.updated.set()

    def load(self, weights: dict[str, torch.Tensor]) -> None:
        """Fill the master (and half) copy from full-precision tensors by name."""
        for p in self.layout.params:
            self.master[p.offset:p.offset + p.numel].copy_(weights[p.names[0]].reshape(-1))
        self.refresh_half()

    def refresh_half(self) -> None:
        if self.half is not self.master:
            self.half.copy_(self.master)

    def update(self, lr: float, grad_factor: float) -> None:
        """AdamW on the master weights with grad = host grad * grad_factor; refresh the half copy."""
        g = self.grad
        if grad_factor != 1.0:
            g.mul_(grad_factor)
        d = self.layout.decay_numel
        self._flat[0].grad, self._flat[1].grad = g[:d], g[d:]
        set_lr(self.optimizer, lr)
        self.optimizer.step()
        self._flat[0].grad = self._flat[1].grad = None
        self.refresh_half()

    def moments(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """AdamW (exp_avg, exp_avg_sq) by parameter name (so a run can resume under any partition or
        mode); empty before the first update."""
        out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        d = self.layout.decay_numel
        for p in self.layout.params:
            flat, off = (self._flat[0], p.offset) if p.offset < d else (self._flat[1], p.offset - d)
            st = self.optimizer.state.get(flat)
            if st:
                out[p.names[0]] = (st["exp_avg"][off:off + p.numel].view(p.shape),
                                   st["exp_avg_sq"][off:off + p.numel].view(p.shape))
        return out

    def load_moments(self, moments: dict[str, tuple[torch.Tensor, torch.Tensor]], step: int) -> None:
        """Set the AdamW state from moments by parameter name (every parameter of the stage)."""
        if not moments:
            return
        d = self.layout.decay_numel
        for k, flat in enumerate(self._flat):
            if flat.numel() == 0:
                continue
            lo, hi = (0, d) if k == 0 else (d, self.layout.numel)
            m, v = torch.zeros(flat.numel()), torch.zeros(flat.numel())
            for p in self.layout.params:
                if lo <= p.offset < hi:
                    m[p.offset - lo:p.offset - lo + p.numel] = moments[p.names[0]][0].reshape(-1)
                    v[p.offset - lo:p.offset - lo + p.numel] = moments[p.names[0]][1].reshape(-1)
            self.optimizer.state[flat] = {"step": torch.tensor(float(step)), "exp_avg": m, "exp_avg_sq": v}
