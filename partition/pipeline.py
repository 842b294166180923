"""The shape of one Mobius pipeline step, shared by the simulator and the MIP.

``S`` stages on ``N`` GPU slots; stage ``j`` runs on slot ``j % N`` (the physical GPU is
``slots[j % N]``). Each slot runs its *phases* in order: the forward of each of its stages
(ascending), then the backward of each (descending). A phase processes all ``M`` micro-batches.

* The slot's last forward stage ``K`` stays resident: its backward phase follows on the same GPU
  with no upload (parameters and input checkpoints are still there).
* Every other phase uploads its data first: the stage's parameters before its forward; parameters
  plus the ``M`` input checkpoints (kept in host memory) before its backward.
* The upload of a phase may start once the previous phase on the slot is running (prefetch), into
  the memory that phase leaves free; the rest uploads when the previous phase ends. A backward
  phase's prefetch also waits until the gradients of the phase before are downloaded.
* After a backward phase its gradients are downloaded; the CPU optimizer updates stages in
  backward order (stage ``S-1`` first) as their gradients arrive.
"""

from __future__ import annotations

from dataclasses import dataclass

from partition.costs import StageCost
from partition.hardware import Hardware


@dataclass(frozen=True)
class Phase:
    """One stage's forward or backward on its slot, for all micro-batches."""

    stage: int
    backward: bool
    resident: bool  # no upload: the backward right after the same stage's forward

    @property
    def label(self) -> str:
        return f"{'B' if self.backward else 'F'}{self.stage}"


@dataclass(frozen=True)
class PipelineShape:
    """Stage count, slot count and micro-batches of one pipeline step."""

    num_stages: int
    num_slots: int
    micro_batches: int

    def slot_of(self, stage: int) -> int:
        return stage % self.num_slots

    def stages_of(self, slot: int) -> list[int]:
        return list(range(slot, self.num_stages, self.num_slots))

    def last_of(self, slot: int) -> int | None:
        """The slot's last forward stage (resident for its backward), or None for an idle slot."""
        stages = self.stages_of(slot)
        return stages[-1] if stages else None

    def is_resident(self, stage: int) -> bool:
        """True when the stage's backward reuses what its forward left on the GPU."""
        return stage + self.num_slots >= self.num_stages

    def phases(self, slot: int) -> list[Phase]:
        """The slot's phases in execution order."""
        stages = self.stages_of(slot)
        fwd = [Phase(j, False, False) for j in stages]
        bwd = [Phase(j, True, self.is_resident(j)) for j in reversed(stages)]
        return fwd + bwd

    @property
    def same_gpu_neighbours(self) -> bool:
        """Consecutive stages share the GPU (one slot): activations stay on it."""
        return self.num_slots == 1

    def fwd_peak(self, sc: StageCost, stage: int) -> int:
        keep = self.same_gpu_neighbours and stage < self.num_stages - 1
        return sc.fwd_peak(self.micro_batches, keep_out=keep)

    def bwd_peak(self, sc: StageCost, stage: int) -> int:
        keep = self.same_gpu_neighbours and stage > 0
        return sc.bwd_peak(self.micro_batches, keep_in_grad=keep)

    def phase_peak(self, sc: StageCost, phase: Phase) -> int:
        return self.bwd_peak(sc, phase.stage) if phase.backward else self.fwd_peak(sc, phase.stage)

    def upload_bytes(self, sc: StageCost, phase: Phase) -> int:
        """Bytes the phase needs uploaded before it can compute."""
        if phase.resident:
            return 0
        return sc.bwd_upload(self.micro_batches) if phase.backward else sc.param_bytes


def activation_latency(hw: Hardware, slots: list[int], shape: PipelineShape, src_stage: int, dst_stage: int,
                       nbytes: float) -> float:
    """Uncontended time for an activation (or its gradient) to go from one stage's GPU to another's."""
    src, dst = slots[shape.slot_of(src_stage)], slots[shape.slot_of(dst_stage)]
    if src == dst or nbytes == 0:
        return 0.0
    peer = hw.p2p_rate(src, dst)
    if peer:
        return nbytes / min(peer, hw.uncontended_d2h(src), hw.uncontended_h2d(dst))
    return nbytes / hw.uncontended_d2h(src) + nbytes / hw.uncontended_h2d(dst)


@dataclass(frozen=True)
class MemoryViolation:
    """A stage whose memory need exceeds the GPU budget."""

    stage: int
    what: str
    need_bytes: int
    budget_bytes: int

    @property
    def shortfall(self) -> int:
        return self.need_bytes - self.budget_bytes


def memory_violations(stages: list[StageCost], shape: PipelineShape, budget: int) -> list[MemoryViolation]:
    """Every memory rule a partition breaks (empty when the partition is valid).

    Rules: each stage's forward and backward peak fits; a non-resident backward stage fits beside
    the gradients of the stage before it on the slot, which may still be downloading.
    """
    out = []
    n = shape.num_slots
    for j, sc in enumerate(stages):
        fwd, bwd = shape.fwd_peak(sc, j), shape.bwd_peak(sc, j)
        if fwd > budget:
            out.append(MemoryViolation(j, "forward", fwd, budget))
        if bwd > budget:
            out.append(MemoryViolation(j, "backward", bwd, budget))
        elif not shape.is_resident(j) and bwd + stages[j + n].grad_bytes > budget:
            out.append(MemoryViolation(j, "backward beside the previous stage's gradients",
                                       bwd + stages[j + n].grad_bytes, budget))
    return out
