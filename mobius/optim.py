"""Learning-rate schedule, the single engine's AdamW (torch's over decayed and undecayed parameters, or a
:class:`FlatAdamW` per parameter for bf16 and int8 moments), dynamic loss scaling and the update rule that ends every
engine's step (:class:`UpdateRule`), and the flat AdamW the runtimes run on host memory and GPU chunks, with its
moments in the precision ``train.optimizer_states`` names (:mod:`mobius.states`)."""

from __future__ import annotations

import contextlib
import math
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from torch import nn
from torch.optim.adamw import adamw as adamw_functional

from mobius.config import TrainSection
from mobius.states import BLOCK, Moments, RuleUpdate, StepScalars


def lr_at(step: int, cfg: TrainSection) -> float:
    """Linear warm-up to ``lr`` over ``warmup_steps``, then cosine decay to ``lr * min_lr_ratio``.
    ``step`` counts from 0 (the first optimizer step)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + 0.5 * (cfg.lr - floor) * (1.0 + math.cos(math.pi * progress))


def takes_decay(param: torch.Tensor) -> bool:
    """Weight decay applies to matrices (and embeddings), not to biases and norms."""
    return param.dim() >= 2


class AdamW:
    """``torch.optim.AdamW``'s update (the functional AdamW its ``step`` runs, on the same per-parameter state:
    a step count, ``exp_avg`` and ``exp_avg_sq``) without a ``torch.optim.Optimizer``, whose construction
    imports ``torch._dynamo`` (1.3 s of CPU on a 2-core VM, in every single-mode run): the single-device
    engine's optimizer. ``decay`` takes ``train.weight_decay``, ``no_decay`` none; ``fused``: torch's fused
    kernel (a GPU's), otherwise torch's default for the parameters' device."""

    def __init__(self, decay: list[nn.Parameter], no_decay: list[nn.Parameter], cfg: TrainSection,
                 fused: bool = False):
        self.cfg, self.fused = cfg, fused
        self.groups = [(params, wd) for params, wd in ((decay, cfg.weight_decay), (no_decay, 0.0)) if params]
        self.state: dict[nn.Parameter, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # (step, m, v)

    @torch.no_grad()
    def step(self, lr: float) -> None:
        """One update of every parameter that has a gradient, at learning rate ``lr``."""
        for params, decay in self.groups:
            live = [p for p in params if p.grad is not None]
            if not live:
                continue
            steps, ms, vs = zip(*(self.state.get(p) or self._fresh(p) for p in live))
            adamw_functional(live, [p.grad for p in live], list(ms), list(vs), [], list(steps),
                             fused=True if self.fused else None, amsgrad=False, beta1=self.cfg.beta1,
                             beta2=self.cfg.beta2, lr=lr, weight_decay=decay, eps=self.cfg.eps, maximize=False)

    def zero_grad(self) -> None:
        for params, _ in self.groups:
            for p in params:
                p.grad = None

    def moments(self, p: nn.Parameter) -> Moments | None:
        """``p``'s exp_avg and exp_avg_sq (fp32, its shape); None before its first update."""
        st = self.state.get(p)
        return None if st is None else Moments("fp32", st[1], st[2])

    def load(self, p: nn.Parameter, moments: Moments, steps: int) -> None:
        """Give ``p`` the moments (fp32) and the count of updates of a checkpoint."""
        step, m, v = self._fresh(p)
        step.fill_(float(steps))
        Moments("fp32", m, v).copy_(moments)

    def _fresh(self, p: nn.Parameter) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """New state for ``p`` as torch's AdamW makes it: the step count on ``p``'s device when fused (fp32),
        else on the CPU (fp64 only under a float64 default dtype)."""
        if self.fused:
            step = torch.zeros((), dtype=torch.float32, device=p.device)
        else:
            wide = torch.get_default_dtype() == torch.float64
            step = torch.tensor(0.0, dtype=torch.float64 if wide else torch.float32)
        st = self.state[p] = (step, torch.zeros_like(p, memory_format=torch.preserve_format),
                              torch.zeros_like(p, memory_format=torch.preserve_format))
        return st


class ParamAdamW:
    """The single engine's AdamW with bf16 or int8 moments: one :class:`FlatAdamW` per parameter (its elements one
    flat run, its own blocks), in a loop over the parameters -- the plain reference of the runtimes' flat buffers."""

    def __init__(self, named: list[tuple[str, nn.Parameter]], cfg: TrainSection):
        self.params = [p for _, p in named]
        self.cfg = cfg
        self.state: dict[nn.Parameter, FlatAdamW] = {}

    def _of(self, p: nn.Parameter) -> FlatAdamW:
        if p not in self.state:
            assert p.is_contiguous() and p.dtype == torch.float32, "the master weights train in fp32, contiguous"
            self.state[p] = FlatAdamW(p.data.view(-1), None, [(0, p.numel(), takes_decay(p))], self.cfg)
        return self.state[p]

    @torch.no_grad()
    def step(self, lr: float) -> None:
        """One update of every parameter that has a gradient, at learning rate ``lr``."""
        for p in self.params:
            if p.grad is not None:
                self._of(p).step(p.grad.reshape(-1), lr)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def moments(self, p: nn.Parameter) -> Moments | None:
        """``p``'s moments in the rule's storage; None before its first update."""
        opt = self.state.get(p)
        return None if opt is None or opt.steps == 0 else opt.moments

    def load(self, p: nn.Parameter, moments: Moments, steps: int) -> None:
        """Give ``p`` the moments (in the rule's storage) and the count of updates of a checkpoint."""
        self._of(p).load(moments, steps)


def make_adamw(named: list[tuple[str, nn.Parameter]], cfg: TrainSection, fused: bool = False) -> AdamW | ParamAdamW:
    """AdamW over named parameters, grouped by :func:`takes_decay`: torch's with fp32 moments, else
    :class:`ParamAdamW` (``train.optimizer_states``)."""
    if cfg.optimizer_states != "fp32":
        return ParamAdamW(named, cfg)
    return AdamW([p for _, p in named if takes_decay(p)], [p for _, p in named if not takes_decay(p)], cfg, fused)


@dataclass
class LossScaler:
    """Dynamic loss scaling for fp16: halve on overflow (and skip the step), double after
    ``growth_interval`` clean steps. Disabled (scale 1) for fp32 and bf16."""

    enabled: bool
    scale: float = 2.0**16
    growth_interval: int = 2000
    clean_steps: int = field(default=0)

    def loss_factor(self) -> float:
        return self.scale if self.enabled else 1.0

    def update(self, found_inf: bool) -> bool:
        """Record one step's outcome; returns True when the step must be skipped."""
        if not self.enabled:
            return False
        if found_inf:
            self.scale = max(self.scale / 2.0, 1.0)
            self.clean_steps = 0
            return True
        self.clean_steps += 1
        if self.clean_steps % self.growth_interval == 0:
            self.scale *= 2.0
        return False

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.clean_steps = state["scale"], state["clean_steps"]


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """Factor that scales gradients to ``max_norm`` (1.0 when clipping is off or not needed),
    computed exactly as ``torch.nn.utils.clip_grad_norm_`` does."""
    if max_norm <= 0 or not math.isfinite(total_norm):
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))


class UpdateRule:
    """How every engine ends a training step (one per engine, from the run's ``train`` section): from
    the step's gradients to the factor each takes in its update, with the state that rule keeps (the
    fp16 loss scaler, the count of optimizer steps taken)."""

    def __init__(self, cfg: TrainSection):
        self.grad_clip = cfg.grad_clip
        self.scaler = LossScaler(enabled=cfg.precision == "fp16")
        self.optimizer_step = 0  # updates made (a skipped step makes none)

    def loss_factor(self) -> float:
        """What a micro-batch's loss is multiplied by before its backward (the fp16 loss scale, or 1)."""
        return self.scaler.loss_factor()

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler.enabled else 1.0

    def end(self, sumsq: float) -> tuple[float, bool, float]:
        """The end of a step, from the sum of squares of its (loss-scaled) gradients over all ranks:
        the global norm (inf on overflow), whether the step is skipped (fp16 overflow; the scaler
        learns of it) and the factor each gradient takes in its update (clipping, and the loss scale
        removed): ``(norm, skipped, factor)``. A step not skipped counts as an optimizer step."""
        scale = self.scaler.loss_factor()
        norm = math.sqrt(sumsq) / scale if math.isfinite(sumsq) else math.inf
        skipped = self.scaler.update(not math.isfinite(norm))
        if not skipped:
            self.optimizer_step += 1
        return norm, skipped, clip_coefficient(norm, self.grad_clip) / scale

    def state(self) -> tuple[int, dict]:
        """What a checkpoint keeps of the rule: ``(optimizer steps, loss scaler state)``."""
        return self.optimizer_step, self.scaler.state_dict()

    def load(self, optimizer_step: int, scaler: dict) -> None:
        self.optimizer_step = optimizer_step
        self.scaler.load_state_dict(scaler)


UPDATE_BLOCK = 1 << 24  # elements per block of a host update (bounds the scratch of half gradients: 64 MB)
Run = tuple[int, int, bool]  # [lo, hi) of a flat buffer whose elements all take weight decay, or all do not


class FlatAdamW:
    """AdamW over one flat fp32 master buffer whose ``runs`` say which elements take weight decay,
    with its moments beside it on the same device (host memory, or a GPU) in the precision
    ``train.optimizer_states`` names (:class:`~mobius.states.Moments`); every host-side update of
    both runtimes, and the GPU-side ones of resident stages and zero's GPU chunks.

    One :meth:`step` runs block by block (on a GPU: one block). fp32 moments: torch's fused AdamW kernel;
    each block reads its gradient (fp32, or the half dtype converted into a small scratch buffer), updates
    master and moments of its runs (one kernel call over the decayed runs, one over the others), and
    writes the block's half-precision copy while the block is still in cache. bf16 and int8 moments: the
    rule's own update (:class:`~mobius.states.RuleUpdate`: one pass of a host kernel reading the gradient
    in its dtype and writing the half copy, or torch ops), over the runs cut where a parameter begins
    (``origins``: (index, position in its parameter) where positions restart; default: one parameter).
    The gradient factor (clipping, loss scale) is folded into the update, not a separate pass over the
    gradients. Elements outside every run are not touched.

    ``compute`` (``train.update: delayed``, instead of ``half``): the copy the device computes with, one
    update behind the master; :meth:`step` leaves it alone, :meth:`to_compute` refreshes it from the master
    (the first part of each delayed update, in both runtimes) and :meth:`newest` lends it the master.
    """

    def __init__(self, master: torch.Tensor, half: torch.Tensor | None, runs: list[Run], cfg: TrainSection,
                 block: int = UPDATE_BLOCK, compute: torch.Tensor | None = None, moments: Moments | None = None,
                 origins: list[tuple[int, int]] | None = None):
        assert half is None or compute is None, "a delayed update's AdamW writes no copy"
        self.master, self.half, self.cfg, self.compute = master, half, cfg, compute
        n = master.numel()
        self.rule = cfg.optimizer_states
        if self.rule == "int8":  # a block of the update holds whole blocks of the moments
            block = -(-block // BLOCK) * BLOCK
        self.block = block if master.device.type == "cpu" else max(n, 1)  # one kernel call per group on a GPU
        # zeros of its own, or buffers the caller owns (memory shared between processes)
        self.moments = moments if moments is not None else Moments.zeros(n, self.rule, master.device)
        assert self.moments.rule == self.rule and self.moments.numel == n, (self.moments.rule, self.moments.numel, n)
        self.steps = 0  # updates applied so far (AdamW's bias correction)
        bounds = [(a, min(n, a + self.block)) for a in range(0, n, self.block)]
        self._rule = None if self.rule == "fp32" else RuleUpdate(self.rule, runs, origins or [(0, 0)], bounds,
                                                                 master.device)
        self._blocks = [(a, b, _pieces(runs, a, b)) for a, b in bounds]
        dev = master.device  # one step count per piece: the kernel counts each of them up by one per step
        self._counts = [[torch.zeros((), device=dev) for _ in p] for _, _, groups in self._blocks for p in groups]
        self._scratch: torch.Tensor | None = None
        self.pause: Callable[[], None] | None = None  # called before each block (a caller's thread that comes first)

    def step(self, grad: torch.Tensor, lr: float, grad_factor: float = 1.0) -> None:
        """One AdamW step with gradient ``grad * grad_factor`` (fp32 moments: an fp32 ``grad`` is scaled in place)."""
        self.steps += 1
        if self._rule is not None:
            self._rule_step(grad, lr, grad_factor)
            return
        scale = torch.tensor(1.0 / grad_factor, device=self.master.device) if grad_factor != 1.0 else None
        counts = iter(self._counts)
        for a, b, groups in self._blocks:
            if self.pause is not None:
                self.pause()
            g = grad[a:b] if grad.dtype == torch.float32 else self._fp32(grad[a:b])  # [b - a]
            for decay, pieces in zip((True, False), groups):
                if not pieces:
                    next(counts)
                    continue
                m, v = self.moments.m, self.moments.v
                adamw_functional([self.master[lo:hi] for lo, hi in pieces], [g[lo - a:hi - a] for lo, hi in pieces],
                                 [m[lo:hi] for lo, hi in pieces], [v[lo:hi] for lo, hi in pieces], [],
                                 next(counts), fused=True, grad_scale=scale, amsgrad=False, beta1=self.cfg.beta1,
                                 beta2=self.cfg.beta2, lr=lr, weight_decay=self.cfg.weight_decay if decay else 0.0,
                                 eps=self.cfg.eps, maximize=False)
            if self.half is not None:
                self.half[a:b].copy_(self.master[a:b])

    def _rule_step(self, grad: torch.Tensor, lr: float, grad_factor: float) -> None:
        """One step of the bf16 or int8 rule, block by block (the half copy written in the same pass)."""
        c = self.cfg
        k = StepScalars.of(c.beta1, c.beta2, c.eps, c.weight_decay, lr, self.steps, grad_factor)
        for i in range(len(self._blocks)):
            if self.pause is not None:
                self.pause()
            self._rule.run(i, k, self.steps, self.master, grad, self.half, self.moments)

    def update(self, grad: torch.Tensor, lr: float, grad_factor: float = 1.0, skip: bool = False,
               copied: threading.Event | None = None) -> None:
        """One optimizer step as both runtimes' stores run it: with a compute copy (``train.update: delayed``)
        first the copy takes the master (w_{t-1}, what the next step computes with; a skipped step too) and
        ``copied`` is set -- after a failure too, so that what waits for it goes on and the failure is raised
        where it is checked -- then AdamW (:meth:`step`) unless ``skip`` (an fp16 overflow)."""
        if self.compute is not None:
            try:
                self.to_compute()
            finally:
                if copied is not None:
                    copied.set()
        if not skip:
            self.step(grad, lr, grad_factor)

    def to_compute(self) -> None:
        """The compute copy takes the master (w_{t-1}, what the next step computes with); none: nothing."""
        if self.compute is not None:
            self.compute.copy_(self.master)

    @contextlib.contextmanager
    def newest(self) -> Iterator[None]:
        """While open, the compute copy holds the master (the newest weights: an evaluation); the compute
        weights wait in host memory and come back. Call with no update in flight."""
        if self.compute is None or self.compute.numel() == 0:
            yield
            return
        aside = self.compute.to("cpu", copy=True)
        self.to_compute()
        try:
            yield
        finally:
            self.compute.copy_(aside)

    def _fp32(self, g: torch.Tensor) -> torch.Tensor:
        if self._scratch is None or self._scratch.numel() < g.numel():
            self._scratch = torch.empty(min(self.block, self.master.numel()), device=self.master.device)
        return self._scratch[:g.numel()].copy_(g)

    def load(self, moments: Moments, steps: int, offset: int = 0) -> None:
        """Set the moments of ``[offset, offset + moments.numel)`` (converted to this rule's storage when they are in
        another's) and the number of updates applied."""
        self.moments.part(offset, moments.numel).copy_(moments.as_rule(self.rule))
        self.set_steps(steps)

    def set_steps(self, steps: int) -> None:
        """Set the number of updates applied (AdamW's bias correction): where several processes take turns
        updating the same buffers, each sets it before its step."""
        self.steps = steps
        for counts in self._counts:
            for c in counts:
                c.fill_(float(steps))


def _pieces(runs: list[Run], a: int, b: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The parts of ``runs`` inside ``[a, b)``: (the decayed ones, the others)."""
    decayed: list[tuple[int, int]] = []
    other: list[tuple[int, int]] = []
    for lo, hi, decay in runs:
        lo, hi = max(lo, a), min(hi, b)
        if lo < hi:
            (decayed if decay else other).append((lo, hi))
    return decayed, other
