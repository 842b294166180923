"""A rank's part of a checkpoint in zero mode: which rank writes each parameter (:func:`owners`), the chunks'
masters, compute copies and AdamW moments gathered from every rank's shard to write this rank's parameters
(:meth:`ZeroCheckpoint.rank_state`), and a resumed run's moments and compute weights put back into the shards
(:meth:`ZeroCheckpoint.load_state`), by parameter name, whichever mode wrote them.
"""

from __future__ import annotations

import torch

from mobius.checkpoint import RankState, ResumeState
from mobius.layout import ChunkLayout
from mobius.models import ModelConfig
from mobius.optim import UpdateRule
from mobius.states import Moments
from scheduler.collectives import all_gather_flat
from scheduler.zero.chunk_store import ChunkStore

SYNC_FROM_DELAYED = ("train.update=sync: resuming a delayed checkpoint from its newest weights; the compute weights of "
                     "its update in flight are dropped")
DELAYED_FROM_SYNC = "train.update=delayed: resuming a sync checkpoint; the first step computes with its newest weights"


def owners(layout: ChunkLayout, world: int) -> list[int]:
    """The rank that writes each parameter: contiguous runs of about equal size; a LoRA adapter goes
    with its layer's weight (so that each rank can merge what it writes)."""
    total, acc, out = layout.param_numel, 0, []
    for p in layout.params:
        out.append(min(world - 1, acc * world // max(total, 1)))
        acc += p.numel
    index = {n: i for i, p in enumerate(layout.params) for n in p.names}
    for i, p in enumerate(layout.params):
        layer, adapter, _ = p.names[0].partition(".lora_")
        if adapter and f"{layer}.weight" in index:
            out[i] = out[index[f"{layer}.weight"]]
    return out


class ZeroCheckpoint:
    """Checkpoint state of this rank's shards (``store``) of ``world`` ranks, with the update ``rule``'s step and
    loss scale. Call with no update in flight."""

    def __init__(self, store: ChunkStore, world: int, rule: UpdateRule, model_cfg: ModelConfig):
        self.store, self.layout, self.rank, self.world = store, store.layout, store.rank, world
        self.rule, self.model_cfg, self.delayed = rule, model_cfg, store.delayed

    # ---- writing --------------------------------------------------------------------------------
    def rank_state(self, with_moments: bool, frozen: bool = True) -> RankState:
        """This rank's share of complete fp32 weights (the newest; ``frozen``: also those that do not train)
        and, ``with_moments`` (a resumable checkpoint), AdamW moments (in the rule's storage) and under
        train.update=delayed the compute weights, by parameter name."""
        owner = owners(self.layout, self.world)
        mine = [i for i, r in enumerate(owner) if r == self.rank and (frozen or self.layout.params[i].trains)]
        moments = with_moments and self.rule.optimizer_step > 0
        compute = with_moments and self.delayed
        parts = 1 + compute  # master, compute copy
        full = {i: torch.zeros(parts, self.layout.params[i].numel) for i in mine}  # [parts, numel]
        pieces: dict[int, list[tuple[int, Moments]]] = {i: [] for i in mine}  # param -> (start, moments) in order
        for c in range(self.layout.num_chunks):
            if c in self.store.frozen and not frozen:  # LoRA's base weights (the same chunks on every rank)
                continue
            chunk = self.gather_state(c, compute)  # [parts, P]
            held = self.gather_moments(c) if moments and c not in self.store.frozen else None
            for seg in self.layout.chunks[c].segments:
                if owner[seg.param] == self.rank:
                    full[seg.param][:, seg.start:seg.start + seg.numel] = chunk[:, seg.offset:seg.offset + seg.numel]
                    if held is not None:
                        pieces[seg.param].append((seg.start, held.part(seg.offset, seg.numel)))
        return self._by_name(mine, full, pieces, moments, compute)

    def _by_name(self, mine: list[int], full: dict[int, torch.Tensor], pieces: dict[int, list[tuple[int, Moments]]],
                 moments: bool, compute: bool) -> RankState:
        """The :class:`RankState` of parameters ``mine`` from their gathered rows ``full`` ([parts, numel] each:
        master, and ``compute``, compute copy) and moments' ``pieces`` (start, moments)."""
        weights, mom, kept = {}, {}, {}
        for i in mine:
            p = self.layout.params[i]
            for name in p.names:
                weights[name] = full[i][0].view(p.shape)
                if compute and p.trains:
                    kept[name] = full[i][-1].view(p.shape)
            if moments and p.trains:
                mom[p.names[0]] = Moments.cat([m for _, m in sorted(pieces[i], key=lambda x: x[0])]).to("cpu", p.shape)
        return RankState(weights, mom, *self.rule.state(), compute=kept if compute else None)

    def gather_state(self, chunk: int, compute: bool = False) -> torch.Tensor:
        """A whole chunk's fp32 master (and ``compute``, its compute copy) on every rank, on the CPU: [parts, P]
        (a frozen chunk: its weights, and zeros for the rest)."""
        frozen = self.store.frozen.get(chunk)
        shards = self.store.shards_of(chunk) if frozen is None else None
        rows = [shards.master_of(chunk) if frozen is None else frozen]
        if compute:
            rows.append(shards.compute_of(chunk) if shards is not None else torch.zeros(rows[0].shape))
        mine = torch.stack([r.detach().float().cpu() for r in rows])  # [parts, s]
        if self.world == 1:
            return mine
        out = torch.empty(self.world * mine.shape[0], mine.shape[1])  # [world * parts, s]
        all_gather_flat(out, mine)
        return out.view(self.world, -1, mine.shape[1]).permute(1, 0, 2).reshape(mine.shape[0], -1)

    def gather_moments(self, chunk: int) -> Moments:
        """A trainable chunk's AdamW moments on every rank, on the CPU, in the rule's storage: the ranks' shards
        gathered as bytes and joined."""
        mine = self.store.shards_of(chunk).moments_of(chunk).to("cpu")
        if self.world == 1:
            return mine
        names = list(mine.tensors())
        sizes = [t.numel() * t.element_size() for t in mine.tensors().values()]
        flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in mine.tensors().values()])  # [bytes]
        out = torch.empty(self.world * flat.numel(), dtype=torch.uint8)  # [world * bytes]
        all_gather_flat(out, flat)
        shards = []
        for part in out.view(self.world, -1):
            got = dict(zip(names, (b.view(t.dtype) for b, t in zip(part.split(sizes), mine.tensors().values()))))
            shards.append(Moments.from_tensors(got))
        return Moments.cat(shards)

    # ---- resuming -------------------------------------------------------------------------------
    def load_state(self, resume: ResumeState) -> str | None:
        """AdamW moments by parameter name (from any mode's checkpoint, another rule's converted), step count, loss
        scale and, under train.update=delayed, the compute weights (:meth:`load_compute`). Returns what to say of
        a checkpoint of the other update rule, or None."""
        self.rule.load(resume.optimizer_step, resume.scaler)
        for c in range(self.layout.num_chunks):
            if c in self.store.frozen:
                continue
            segs = self.store.segments(c)
            names = sorted({self.layout.params[p].names[0] for p, *_ in segs})
            moments = resume.moments(names, self.model_cfg) if names else {}
            if not moments:
                continue
            for p, start, at, n in segs:
                got = moments[self.layout.params[p].names[0]].part(start, n)
                self.store.shards_of(c).load_moments_of(c, got, resume.optimizer_step, at)
        return self.load_compute(resume)

    def load_compute(self, resume: ResumeState) -> str | None:
        """The compute copies from a delayed checkpoint's compute weights (by name, whichever mode wrote
        them). Returns the line that says what happens across update rules (a sync checkpoint has no compute
        weights: the first step computes with its newest weights, which the compute copies hold), or None."""
        if not self.delayed:
            return SYNC_FROM_DELAYED if resume.delayed else None
        trainable = [c for c in range(self.layout.num_chunks) if c not in self.store.frozen]
        names = sorted({self.layout.params[p].names[0] for c in trainable for p, *_ in self.store.segments(c)})
        compute = resume.compute_weights(names, self.model_cfg)
        if compute is None:
            return DELAYED_FROM_SYNC
        for c in trainable:
            dst = self.store.shards_of(c).compute_of(c)  # [s]
            for p, start, at, n in self.store.segments(c):
                flat = compute[self.layout.params[p].names[0]].reshape(-1)
                dst[at:at + n].copy_(flat[start:start + n])
        return None
