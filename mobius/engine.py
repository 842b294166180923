"""What an engine is to the :class:`~mobius.trainer.Trainer`: it runs one optimizer step over a list
of micro-batches, evaluates, and gives and takes its state; the loop around it (schedule, data,
metrics, checkpoints) is the trainer's, shared by every mode.

The engines themselves are in :mod:`scheduler` (``single``: the reference on one device;
``engine``: the swapped pipeline; ``roundrobin``: the pipeline's round-robin schedule, RoundPipe's class;
``zero``: chunked ZeRO); each ends its steps with :class:`mobius.optim.UpdateRule`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Protocol

import torch

from mobius.batch import MicroBatch
from mobius.checkpoint import Collective, RankState, ResumeState

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class StepStats:
    loss: float  # mean loss over the step's target tokens (every micro-batch and rank together)
    grad_norm: float  # global gradient norm before clipping (inf/nan on fp16 overflow)
    skipped: bool = False  # fp16 overflow: no update was made
    loss_scale: float = 1.0
    extra: dict | None = None  # engine-specific counters (bytes moved, stall time, ...)
    seconds: float | None = None  # the step's wall time, when the engine ran it outside this train_step call
    # (looks_ahead); None: the call's duration is the step's


class Engine(Protocol):
    """What every parallel mode implements; the :class:`~mobius.trainer.Trainer` drives it."""

    comm: Collective  # the ranks of the run (checkpoints are written through it)
    is_main: bool  # the process that logs and writes shared files
    looks_ahead: bool  # train_step may start the next step it is handed (``upcoming``) before it returns

    # ``upcoming``: the next step's batches and learning rate, when no checkpoint or evaluation comes between
    def train_step(self, step: int, batches: list[MicroBatch], lr: float,
                   upcoming: tuple[list[MicroBatch], float] | None = None) -> StepStats: ...
    def evaluate(self, batches: list[MicroBatch]) -> float: ...
    # finishes pending updates first; ``frozen``: also the weights that do not train (a LoRA checkpoint has none)
    def rank_state(self, with_moments: bool, frozen: bool = True) -> RankState: ...
    def load_state(self, resume: ResumeState) -> None: ...  # optimizer moments by name, step, loss scale
    def sync(self) -> None: ...  # wait for every piece of work in flight (updates, copies, kernels)
    def close(self) -> None: ...


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[precision])
