"""A stage's optimizer-side memory: fp32 master weights, AdamW moments, the half-precision copy
the GPU computes with and where its gradients arrive, all flat; and the AdamW update on them.

A *swapped* stage keeps all of it in host memory (the half copy pinned, for uploads) and updates on
the CPU; a *resident* stage keeps it on its GPU and updates there. Host bytes per swapped parameter:

=============================  ====  ==========================================================
train precision / gradients    B     what
=============================  ====  ==========================================================
bf16/fp16, fp32 downloads      18    4 master + 8 AdamW (m, v) + 2 pinned half copy + 4 pinned fp32 gradient
bf16, half downloads           14    the gradient lands in the half copy (it is rewritten by the update)
fp32                           16    the master is the upload copy; 4 pinned fp32 gradient
=============================  ====  ==========================================================

fp32 downloads carry the gradient sums exactly as the GPU accumulated them (the reference trainer's
numbers); half downloads round them to bf16 first (half the GPU->host bytes and 4 fewer host bytes
per parameter). Every gradient of a step waits in host memory for the global norm when the run clips
(or scales fp16 losses), so a smaller pool of fp32 buffers would not bound anything there.
:func:`check_host_memory` computes the need before anything is allocated.
"""

from __future__ import annotations

import logging
import threading

import torch

from mobius.config import TrainSection
from mobius.errors import MobiusError
from mobius.optim import FlatAdamW, host_bytes_per_param
from scheduler.pinned import host_zeros
from scheduler.stages import StageLayout
from topology.host import HOST_USABLE_FRACTION, available_host_bytes

log = logging.getLogger(__name__)


def host_bytes(layouts: list[StageLayout], train_dtype: torch.dtype, half_grads: bool = False) -> int:
    """Host memory the stores of these swapped stages need (see the module docstring)."""
    precision = "fp32" if train_dtype == torch.float32 else "half"
    return sum(lay.numel for lay in layouts) * host_bytes_per_param(precision, half_grads)


def check_host_memory(needed: int, what: str) -> None:
    avail = available_host_bytes()
    if avail is not None and needed > avail:
        raise MobiusError(f"{what} needs {needed / 2**30:.1f} GiB of host memory for weights, optimizer states and "
                          f"transfer buffers, but only {avail / 2**30:.1f} GiB is available to them "
                          f"({HOST_USABLE_FRACTION:.0%} of the free memory)")


class StageStore:
    """One stage's flat buffers and its AdamW, in host memory (``device`` cpu) or on a GPU (resident).

    ``half`` is the copy the GPU computes with (the master itself in fp32). On the host it is pinned
    for uploads, and the stage's gradients arrive in ``grad`` (fp32) or, with ``half_grads``, in
    ``half`` itself; a resident stage's gradients stay in its device slot.
    """

    def __init__(self, layout: StageLayout, train_dtype: torch.dtype, cfg: TrainSection, pin: bool = False,
                 half_grads: bool = False, device: torch.device | str = "cpu"):
        self.layout, self.dtype = layout, train_dtype
        n, device = layout.numel, torch.device(device)
        on_host = device.type == "cpu"
        fp32 = train_dtype == torch.float32
        if on_host:  # page-locked at the exact size (scheduler/pinned.py): what host_bytes counts
            self.master = host_zeros(n, torch.float32, pin and fp32, self)
            self.half = self.master if fp32 else host_zeros(n, train_dtype, pin, self)
        else:
            self.master = torch.zeros(n, dtype=torch.float32, device=device)
            self.half = self.master if fp32 else torch.empty(n, dtype=train_dtype, device=device)
        assert not (half_grads and fp32), "half-precision downloads need a half-precision copy"
        self.grad = host_zeros(n, torch.float32, pin, self) if on_host and not half_grads else None
        self.optimizer = FlatAdamW(self.master, None if fp32 else self.half, layout.runs, cfg)
        self.updated = threading.Event()  # set when master/half hold this step's weights
        self.updated.set()

    @property
    def grads_in(self) -> torch.Tensor:
        """Where a download puts the stage's gradients (host stores)."""
        return self.grad if self.grad is not None else self.half

    def load(self, weights: dict[str, torch.Tensor]) -> None:
        """Fill the master (and half) copy from full-precision tensors by name."""
        for p in self.layout.params:
            self.master[p.offset:p.offset + p.numel].copy_(weights[p.names[0]].reshape(-1))
        if self.half is not self.master:
            self.half.copy_(self.master)

    def update(self, lr: float, grad_factor: float, grad: torch.Tensor | None = None) -> None:
        """AdamW with gradient ``grad * grad_factor`` (default: the downloaded gradients); the half
        copy is rewritten in the same pass."""
        self.optimizer.step(self.grads_in if grad is None else grad, lr, grad_factor)

    def moments(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """AdamW (exp_avg, exp_avg_sq) by parameter name, in host memory (so a run can resume under
        any partition or mode); empty before the first update."""
        if self.optimizer.steps == 0:
            return {}
        m, v = self.optimizer.m.cpu(), self.optimizer.v.cpu()
        return {p.names[0]: (m[p.offset:p.offset + p.numel].view(p.shape), v[p.offset:p.offset + p.numel].view(p.shape))
                for p in self.layout.params}

    def load_moments(self, moments: dict[str, tuple[torch.Tensor, torch.Tensor]], step: int) -> None:
        """Set the AdamW state from moments by parameter name (every parameter of the stage)."""
        if not moments:
            return
        m, v = torch.zeros(self.layout.numel), torch.zeros(self.layout.numel)
        for p in self.layout.params:
            m[p.offset:p.offset + p.numel] = moments[p.names[0]][0].reshape(-1)
            v[p.offset:p.offset + p.numel] = moments[p.names[0]][1].reshape(-1)
        self.optimizer.load(m, v, step)
