"""A device slot: one stage's (or round-robin op's) worth of device memory, which both pipeline dispatchers
upload weights into and compute on."""

from __future__ import annotations

import threading
from typing import Callable

import torch
from torch import nn


class DeviceSlot:
    """One stage's worth of device memory: parameters, gradients of what trains (and their fp32
    accumulator). A resident stage's slot computes on its store's half copy (``params``) and is never
    freed."""

    def __init__(self, numel: int, grad_numel: int, dtype: torch.dtype, device: torch.device, accumulate_fp32: bool,
                 params: torch.Tensor | None = None):
        self.params = torch.empty(numel, dtype=dtype, device=device) if params is None else params
        self.grads = torch.zeros(grad_numel, dtype=dtype, device=device)
        self.acc = torch.zeros(grad_numel, dtype=torch.float32, device=device) if accumulate_fp32 else None
        self.stage: int | None = None
        self.ready = threading.Event()  # set by the upload thread once the copy is enqueued (or done, on the CPU)
        self.ready_event: torch.cuda.Event | None = None  # upload finished (CUDA)
        self.released: torch.cuda.Event | None = None  # last use finished (CUDA); the next upload waits on it
        self.grads_live = False  # gradients zeroed for this residency
        self.bound: tuple[int, str] | None = None  # (stage, "grads" | "graph" | "infer") the modules point here for
        self.pairs: list[tuple[nn.Parameter, torch.Tensor]] = []  # with ``acc``: (bound parameter, its fp32 sum)
        self.bindings: dict[tuple, tuple[list[tuple[nn.Module, str, nn.Parameter]], list]] = {}  # see point()

    @property
    def sums(self) -> torch.Tensor:
        """The gradients summed over the step's micro-batches: the fp32 accumulator in half precision, the
        gradient buffer itself in fp32."""
        return self.acc if self.acc is not None else self.grads

    def point(self, key: tuple, units: nn.Module, make: Callable[[], list[tuple[nn.Parameter, torch.Tensor]]]) -> None:
        """Point ``units``' parameters at this slot's buffers the way ``key`` names (what computes and how): the
        first time through ``make`` (:func:`~scheduler.stages.bind`, which returns the gradient pairs), after that
        by putting back the parameters it made. Making them costs about 40 us a parameter (an op of 3 GPT-2
        blocks, 36 parameters: 1.5 ms of the dispatch thread at every switch), putting them back a dict store
        each. The parameters are views of the slot's buffers, which never move."""
        if key not in self.bindings:
            pairs = make()
            self.bindings[key] = ([(m, leaf, p) for m in units.modules() for leaf, p in m._parameters.items()
                                   if p is not None], pairs)
        params, self.pairs = self.bindings[key]
        for module, leaf, param in params:
            module._parameters[leaf] = param

    def gradients_to(self, lo: int, hi: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Where elements ``[lo, hi)`` of a backward's gradients go, as :func:`~scheduler.stages.bind` takes them
        (``grads``, ``sums``): in fp32 ``.grad`` views autograd accumulates into; in half precision the fp32
        sums, each micro-batch's handed over to :func:`~scheduler.stages.add_gradients`."""
        return (None, self.acc[lo:hi]) if self.acc is not None else (self.grads[lo:hi], None)
