"""Host memory every worker of a run maps: the round-robin runtime's weights, optimizer states, gradient
sums and kept inputs, which any worker may read or write because any worker may run any stage.

:class:`SharedHost` is one anonymous memory file (``memfd``) that rank 0 creates and every other rank maps
through ``/proc/<pid>/fd``; the file is closed once all have mapped it, so the memory goes when the last
worker ends, however it ends (nothing is left in ``/dev/shm``). The ranks fault its pages in at start-up,
each a share, so that no step pays for a first touch. On a GPU machine the mapping is page-locked
(``cudaHostRegister``) for uploads and downloads.

:class:`UnitStores` lays every unit's flat buffers (the pipeline's :class:`~scheduler.stages.StageLayout`, one
per unit) end to end in unit order, so that the units ``[a, b)`` of any op are one contiguous slice of each
buffer: an upload or a download is one copy. What trains comes first in each unit's buffer; the fp32 buffers
(master, AdamW moments, gradient sums) hold only what trains, unit after unit. Counters in the same memory
order the workers: how many rounds of each op's gradients are summed, how many updates of each owner op have
run.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from mobius.config import TrainSection
from mobius.errors import MobiusError
from mobius.models import ModelConfig, unit_specs
from mobius.optim import FlatAdamW
from mobius.states import Moments
from scheduler import pinned
from scheduler.stages import StageLayout, stage_layouts, tied_places, trains_last
from scheduler.stage_store import check_host_memory

log = logging.getLogger(__name__)
PAGE = 4096
WAIT_TIMEOUT_S = 1800.0  # a counter that does not move for this long has lost its worker (supervision acts first)


class SharedHost:
    """Named host buffers in one mapping shared by every rank of the default process group."""

    def __init__(self, spec: dict[str, tuple[int, torch.dtype]], pin: bool, label: str = "mobius-round-robin"):
        offsets, total = {}, 0
        for name, (numel, dtype) in spec.items():
            offsets[name] = total
            total += -(-max(numel, 1) * dtype.itemsize // PAGE) * PAGE
        box: list = [None]
        fd = -1
        if dist.get_rank() == 0:
            fd = os.memfd_create(label, 0)
            os.ftruncate(fd, total)
            box = [f"/proc/{os.getpid()}/fd/{fd}"]
        dist.broadcast_object_list(box, src=0)
        try:
            self.raw = torch.from_file(box[0], shared=True, size=total, dtype=torch.uint8)
        except RuntimeError as e:
            raise MobiusError(f"cannot map the shared host memory {label} ({total / 2**30:.1f} GiB) "
                              f"from {box[0]}: {e}") from e
        rank, world = dist.get_rank(), dist.get_world_size()
        share = -(-total // (world * PAGE)) * PAGE
        self.raw[rank * share:(rank + 1) * share].zero_()  # each rank faults its share in now, not in a step
        dist.barrier()
        if fd >= 0:
            os.close(fd)  # every rank has mapped it: the memory lives as long as some mapping does
        self.nbytes = total
        if pin and pinned.register(self.raw):
            weakref.finalize(self, pinned.unregister, self.raw).atexit = False
        self.buffers = {name: self.raw[offsets[name]:offsets[name] + numel * dtype.itemsize].view(dtype)
                        for name, (numel, dtype) in spec.items()}

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.buffers[name]


def wait_for(ready: Callable[[], bool], what: str, longest_pause: float = 1e-3) -> float:
    """Poll ``ready`` (a shared counter reached) until it holds, pausing at most ``longest_pause`` between
    looks; returns the seconds waited."""
    if ready():
        return 0.0
    t0 = time.perf_counter()
    pause = 1e-5
    while not ready():
        if time.perf_counter() - t0 > WAIT_TIMEOUT_S:
            raise MobiusError(f"waited {WAIT_TIMEOUT_S:.0f} s for {what}: a worker has stopped")
        time.sleep(pause)
        pause = min(pause * 2, longest_pause)
    return time.perf_counter() - t0


@dataclass(frozen=True)
class _Tie:
    """A trained tied weight's place: its offset in unit 0's buffers and in the last unit's, and its size."""

    embed: int
    head: int
    numel: int


@dataclass(frozen=True)
class Span:
    """Units ``[first, end)`` as slices of the shared buffers."""

    first: int
    end: int
    lo: int  # weights (every element, frozen ones included)
    hi: int
    glo: int  # what trains
    ghi: int

    @property
    def numel(self) -> int:
        return self.hi - self.lo

    @property
    def trainable(self) -> int:
        return self.ghi - self.glo


class UnitStores:
    """Every unit's weights (``copies`` compute copies: two alternate by step under ``train.update:
    delayed``), fp32 master, AdamW moments (in ``train.optimizer_states``' precision), gradient sums and the stash of
    kept inputs (one of each per compute
    copy), in host memory all workers share, with one :class:`FlatAdamW` per unit over its slices; ``stash``:
    (entries, elements per entry) of a step's kept inputs."""

    def __init__(self, model_cfg: ModelConfig, train_dtype: torch.dtype, cfg: TrainSection, delayed: bool,
                 num_ops: int, stash: tuple[int, int], pin: bool):
        self.layouts: list[StageLayout] = stage_layouts(model_cfg, list(range(len(unit_specs(model_cfg)) + 1)))
        self.dtype, self.delayed, self.copies = train_dtype, delayed, 2 if delayed else 1
        self.off, self.goff = [0], [0]
        for lay in self.layouts:
            self.off.append(self.off[-1] + lay.numel)
            self.goff.append(self.goff[-1] + lay.trainable_numel)
        H, T = self.off[-1], self.goff[-1]
        self.states = cfg.optimizer_states
        spec = {"master": (T, torch.float32), **Moments.spec(T, self.states), "counts": (2 * num_ops, torch.int64)}
        for c in range(self.copies):
            spec[f"half{c}"] = (H, train_dtype)
            spec[f"grad{c}"] = (T, torch.float32)
            spec[f"stash{c}"] = (stash[0] * stash[1], train_dtype)
            spec[f"stashed{c}"] = (stash[0], torch.int64)
        check_host_memory(sum(n * dtype.itemsize for n, dtype in spec.values()), "the round-robin runtime's shared "
                          "stores (weights, AdamW states, gradient sums, kept inputs)")
        self.host = SharedHost(spec, pin)
        counts = self.host["counts"]
        self.summed = counts[:num_ops]  # op -> rounds of its gradients summed in host memory (over the run)
        self.version = counts[num_ops:2 * num_ops]  # owner op -> updates that have run (over the run)
        self.tie = self._tie(model_cfg)
        self.optimizers = [self._optimizer(u, cfg) for u in range(len(self.layouts))]

    def _tie(self, model_cfg: ModelConfig) -> _Tie | None:
        """A tied weight that trains: its embedding's end (unit 0) runs its AdamW and copies the result into the
        head's end, the last thing that trains in the last unit (whose AdamW leaves it out)."""
        places = tied_places(model_cfg, self.layouts[0], self.layouts[-1]) if len(self.layouts) > 1 else None
        if places is None:
            return None
        a, b = places
        assert trains_last(self.layouts[-1], b.offset, b.numel), "a tied end must be the last that trains in its unit"
        return _Tie(a.offset, b.offset, a.numel)

    def _own(self, u: int) -> int:
        """The elements ``[0, n)`` of unit ``u``'s fp32 buffers that its AdamW updates (a tied head's end left
        out: :meth:`_tie`)."""
        return self.tie.head if self.tie is not None and u == len(self.layouts) - 1 else self.span(u, u + 1).trainable

    def _optimizer(self, u: int, cfg: TrainSection) -> FlatAdamW:
        """Unit ``u``'s AdamW over what it owns (:meth:`_own`), its moments in the shared buffers."""
        s, h, n = self.span(u, u + 1), self.host, self._own(u)
        half = None if self.delayed else h["half0"][s.lo:s.lo + n]
        runs = [(lo, min(hi, n), d) for lo, hi, d in self.layouts[u].runs if lo < n]
        origins = [(p.offset, 0) for p in self.layouts[u].params if p.offset < n]  # each parameter's first element
        return FlatAdamW(h["master"][s.glo:s.glo + n], half, runs, cfg,
                         moments=Moments.of(h.buffers, self.states, s.glo, n), origins=origins)

    def moments(self, u: int) -> dict[str, Moments]:
        """Unit ``u``'s AdamW moments by the first name of each parameter its AdamW updates, copies in the rule's
        storage."""
        whole = Moments.of(self.host.buffers, self.states, 0, self.goff[-1])
        return {name: whole.part(s.start, s.stop - s.start).to("cpu", shape)
                for name, s, shape in self.trained(u, True)}

    def load_moments(self, u: int, moments: dict[str, Moments]) -> None:
        """Unit ``u``'s moments from a checkpoint's by name (every parameter of the unit; another rule's converted)."""
        whole = Moments.of(self.host.buffers, self.states, 0, self.goff[-1])
        for name, s, _ in self.trained(u):
            whole.part(s.start, s.stop - s.start).copy_(moments[name].as_rule(self.states))

    @property
    def num_units(self) -> int:
        return len(self.layouts)

    def span(self, first: int, end: int) -> Span:
        return Span(first, end, self.off[first], self.off[end], self.goff[first], self.goff[end])

    def half(self, copy: int) -> torch.Tensor:
        return self.host[f"half{copy % self.copies}"]

    def grad(self, copy: int) -> torch.Tensor:
        return self.host[f"grad{copy % self.copies}"]

    def stash(self, copy: int) -> torch.Tensor:
        """The kept inputs of a step that computes with compute copy ``copy`` (under delayed a step's forwards,
        run ahead, may reach an entry before the step before's backwards have read it: each has its own)."""
        return self.host[f"stash{copy % self.copies}"]

    def stashed(self, copy: int) -> torch.Tensor:
        """Per entry of :meth:`stash`, the steps whose input it has taken (over the run)."""
        return self.host[f"stashed{copy % self.copies}"]

    # ---- weights in and out ---------------------------------------------------------------------
    def load(self, u: int, weights: dict[str, torch.Tensor]) -> set[str]:
        """Fill unit ``u``'s master (what trains) and every compute copy (everything) from ``weights`` by
        name; returns the names filled."""
        s, filled = self.span(u, u + 1), set()
        t = s.trainable
        for p in self.layouts[u].params:
            name = next((n for n in p.names if n in weights), None)
            if name is None:
                continue
            w = weights[name].reshape(-1)
            if p.offset < t:
                self.host["master"][s.glo + p.offset:s.glo + p.offset + p.numel].copy_(w)
            for c in range(self.copies):
                self.half(c)[s.lo + p.offset:s.lo + p.offset + p.numel].copy_(w)
            filled.update(p.names)
        return filled

    def weights(self, u: int, frozen: bool = True) -> dict[str, torch.Tensor]:
        """Unit ``u``'s parameters by name (``frozen``: else only those that train), fp32 (the master for what
        trains, the compute copy for the rest)."""
        s, lay = self.span(u, u + 1), self.layouts[u]
        master, half = self.host["master"][s.glo:s.ghi], self.half(0)[s.lo:s.hi]
        out = {}
        for p in lay.params:
            if p.offset >= s.trainable and not frozen:
                continue
            src = master if p.offset < s.trainable else half
            v = src[p.offset:p.offset + p.numel].float().clone().view(p.shape)
            out.update({n: v for n in p.names})
        return out

    def trained(self, u: int, own: bool = False) -> list[tuple[str, slice, tuple[int, ...]]]:
        """(first name, slice of the fp32 buffers, shape) of each parameter of unit ``u`` that trains (``own``:
        that unit ``u``'s AdamW updates, a tied head's end left out)."""
        s = self.span(u, u + 1)
        n = self._own(u) if own else s.trainable
        return [(p.names[0], slice(s.glo + p.offset, s.glo + p.offset + p.numel), p.shape)
                for p in self.layouts[u].params if p.offset < n]

    def compute_weights(self, u: int, copy: int) -> dict[str, torch.Tensor]:
        """What trains in unit ``u`` as compute copy ``copy`` holds it, fp32, by every name."""
        s = self.span(u, u + 1)
        half = self.half(copy)[s.lo:s.lo + s.trainable]
        out = {}
        for p in self.layouts[u].params:
            if p.offset < s.trainable:
                out.update({n: half[p.offset:p.offset + p.numel].float().clone().view(p.shape) for n in p.names})
        return out

    def load_compute(self, u: int, copy: int, weights: dict[str, torch.Tensor]) -> None:
        s = self.span(u, u + 1)
        for p in self.layouts[u].params:
            if p.offset < s.trainable:
                name = next(n for n in p.names if n in weights)
                self.half(copy)[s.lo + p.offset:s.lo + p.offset + p.numel].copy_(weights[name].reshape(-1))

    # ---- the update -----------------------------------------------------------------------------
    def update(self, u: int, grad: torch.Tensor, lr: float, factor: float, adam_step: int, skip: bool,
               refresh: int) -> int:
        """Unit ``u``'s optimizer step, its ``adam_step``-th AdamW of ``grad`` (the unit's gradient; ``skip``: none,
        an fp16 overflow); under delayed the new master then goes to compute copy ``refresh`` (the one the step
        after next computes with; a skipped step too); unit 0's tied weight then goes to the head's end. Returns
        the parameters updated."""
        opt, n = self.optimizers[u], self._own(u)
        if not skip:
            opt.set_steps(adam_step - 1)
            opt.step(grad[:n], lr, factor)
        s = self.span(u, u + 1)
        if self.delayed:
            self.half(refresh)[s.lo:s.lo + n].copy_(opt.master)
        if u == 0 and self.tie is not None:
            t, h = self.tie, self.span(self.num_units - 1, self.num_units)
            master, half = self.host["master"], self.half(refresh)
            master[h.glo + t.head:h.glo + t.head + t.numel].copy_(master[s.glo + t.embed:s.glo + t.embed + t.numel])
            half[h.lo + t.head:h.lo + t.head + t.numel].copy_(half[s.lo + t.embed:s.lo + t.embed + t.numel])
        return 0 if skip else n
