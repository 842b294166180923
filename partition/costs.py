"""The cost model shared by the profiler, simulator, MIP and baselines: numbers only, no torch.

A model is an ordered list of units (embedding, blocks, head). :class:`UnitCost` holds what one
unit costs for one micro-batch; :class:`ModelProfile` holds all of them plus the setting they were
measured or estimated for. :func:`stage_cost` sums a contiguous range of units into a
:class:`StageCost`; how stages become a step (times and memory) is :mod:`partition.timing`.

The bytes per element and per parameter every planner (and the runtimes' host-memory checks) count
with are here, once: :data:`PRECISION_BYTES`, :data:`STATE_BYTES`, :data:`ADAM_BYTES`,
:data:`MOMENT_BYTES` (by ``train.optimizer_states``) and :func:`host_bytes_per_param`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Literal

ProfileSource = Literal["measured", "datasheet", "file", "learnt"]  # where a profile's unit times come from: measured
# here (partition.measure), a GPU's datasheet (partition.estimate), a profile file (partition.profile_file), or measured
# and scaled to the compute earlier runs measured in their steps (partition.calibrate)
PRECISION_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}  # one element in each training precision (a frozen
# parameter -- LoRA's base weights -- is one such copy wherever it lives)
STATE_BYTES = 16  # device memory of a trainable parameter whose states live on the device: fp32 weight (master),
# fp32 gradient, AdamW m and v (plain training; a zero chunk's shard kept on the GPU)
ADAM_BYTES = 28  # memory traffic of one fused AdamW step per parameter: read fp32 p, g, m, v; write p, m, v (what
# torch's fused kernel moves on a device; a resident stage also writes its half copy:
# partition.hardware.DEVICE_ADAM_BYTES)
UPDATE_BYTES = ADAM_BYTES + 2  # one update's traffic with the half copy it writes, on the CPU (the measure of the
# CPU update rates, partition.hardware) or on a device (partition.hardware.DEVICE_ADAM_BYTES)
HOST_SUM_BYTES = 12  # adding a later round's downloaded fp32 gradient sums into the host sum: read 4 + 4, write 4
TIE_SUM_BYTES = 12  # a tied weight's two ends' gradients summed on the host into a worker's own end (ends on two
# workers; one worker holding both sums them on the device): read 4 + 4, write 4 (its norm reads the sum from cache: scheduler.stages.add_tied; into both ends, 16 bytes, measured at 1.8x the
# CPU AdamW's parameters per second)


STATES_ORDER = ("fp32", "bf16", "int8")  # train.optimizer_states, most bytes first
MOMENT_BYTES = {"fp32": 8.0, "bf16": 4.0, "int8": 2.0 + 2 * 4 / 64}  # AdamW's m and v per parameter, by
# train.optimizer_states (int8: two 8-bit codes and two fp32 scales per block of 64 elements; mobius/states.py)


def moment_savings(states: str) -> float:
    """Bytes per trained parameter that ``states``' moments take fewer than fp32's."""
    return MOMENT_BYTES["fp32"] - MOMENT_BYTES[states]


def host_bytes_per_param(precision: str, half_grads: bool, delayed: bool = False, states: str = "fp32") -> float:
    """Host bytes of a swapped pipeline stage's trainable parameter (``precision``: "fp32", or any
    half precision): fp32 master (4) + AdamW moments (8 in fp32, :data:`MOMENT_BYTES` by ``states``) + the
    pinned half-precision upload copy (2; in fp32 the master is the upload copy) + the pinned fp32 gradient
    the GPU's sums come down to (4; none when gradients come down in the half dtype, into the half copy).
    ``delayed`` (train.update=delayed): the upload copy holds the compute weights, one update behind the
    master, so fp32 training keeps a separate pinned fp32 copy (4 more); a half-precision copy is separate
    already (and takes no gradients then: delayed downloads fp32 gradients). Zero mode's offloaded
    chunk shards hold the same as fp32 downloads. What ``scheduler/stage_store.py`` allocates."""
    if precision == "fp32":
        base = 20 if delayed else 16
    else:
        base = 14 if half_grads else 18
    return base - moment_savings(states)


def states_advice(need: dict[str, int], states: str, host_memory: int) -> str:
    """What a plan that does not fit its host says of the other ``train.optimizer_states`` rules: those with fewer
    bytes that would fit, with their need, or that none would."""
    smaller = [r for r in STATES_ORDER if need[r] < need[states]]
    fits = [r for r in smaller if need[r] <= host_memory]
    if not smaller:
        return ""
    if not fits:
        return ("; neither would fewer bytes of optimizer states ("
                + ", ".join(f"{r}: {need[r] / 2**30:.1f} GiB" for r in smaller) + ")")
    return "; it fits with " + " or ".join(f"train.optimizer_states={r} ({need[r] / 2**30:.1f} GiB)" for r in fits)


def update_bytes(states: str = "fp32") -> float:
    """Memory traffic of one CPU update of a parameter with ``states``' moments (they are read and written once):
    :data:`UPDATE_BYTES` with fp32 moments, 22 with bf16, 18.25 with int8."""
    return UPDATE_BYTES - 2 * moment_savings(states)


def compute_copy_work(precision: str) -> float:
    """Under ``train.update: delayed`` with one compute copy, a stage's copy from its master (fp32 read, the
    training dtype written) in CPU updates of its parameters (:data:`UPDATE_BYTES` each): what the runtime
    reports for it beside its AdamW, and what the simulator queues ahead of the updates (``precision``: "fp32",
    or any half precision)."""
    return (4 + (4 if precision == "fp32" else 2)) / UPDATE_BYTES


def tie_copy_work(precision: str) -> float:
    """The round-robin's tied weight, in CPU updates of its parameters (:data:`UPDATE_BYTES` each): the
    embedding's end runs its AdamW, then copies the result into the head's end: the fp32 master (read 4, write
    4) and the compute copy (the training dtype, read and written)."""
    return (8 + 2 * PRECISION_BYTES[precision]) / UPDATE_BYTES


def tied_end_held(profile: "ModelProfile", num_stages: int, num_workers: int) -> int:
    """Parameters of a trained tied weight's head end that the embedding's store updates, when one worker
    holds both ends' stages (stage j on worker j mod N; :class:`scheduler.stage_store.TiedEnd`): the head
    stage's CPU update and host stores leave them out. 0 otherwise (both ends update)."""
    S, N = num_stages, num_workers
    return profile.tied_params if S > 1 and (S - 1) % N == 0 else 0


def tied_end_bytes_per_param(precision: str, half_grads: bool) -> int:
    """Host bytes of a parameter of a tied head's end that the embedding's store updates (both ends'
    stages on one worker, :class:`scheduler.stage_store.TiedEnd`): its copy in the training dtype and the
    pinned fp32 gradient (none with half downloads); no master or moments."""
    return (4 if precision == "fp32" else 2) + (0 if half_grads else 4)


@dataclass(frozen=True)
class UnitCost:
    """What one unit costs for one micro-batch at the profile's batch size, sequence and precision."""

    name: str
    kind: str  # embed | block | head
    signature: str  # equal for identical units
    param_count: int
    fwd_s: float  # forward of one micro-batch
    bwd_s: float  # backward of one micro-batch, including the recompute of its forward
    param_bytes: int  # parameters in the training dtype (what is uploaded)
    grad_bytes: int  # gradients in the training dtype (what is downloaded)
    in_bytes: int  # input per micro-batch (token ids for the embedding)
    act_bytes: int  # output per micro-batch (what crosses a stage boundary after this unit)
    saved_bytes: int  # activations autograd keeps for one micro-batch during the recompute
    work_bytes: int  # transient working memory of one micro-batch beyond params, grads and saved
    acc_s: float = 0.0  # adding one micro-batch's gradients into the fp32 sums (half precision only)
    frozen_count: int = 0  # of param_count, parameters that do not train (LoRA's base weights)

    @property
    def trainable_count(self) -> int:
        """Parameters with a master copy, moments, gradients and an update."""
        return self.param_count - self.frozen_count


@dataclass
class ModelProfile:
    """Per-unit costs for one setting (micro-batch size, sequence length, precision, device)."""

    units: list[UnitCost]
    micro_batch_size: int
    seq_len: int
    precision: str
    device_name: str
    source: ProfileSource
    profile_s: float = 0.0  # wall time spent measuring (0 for estimates and cache hits)
    notes: dict = field(default_factory=dict)
    tied_params: int = 0  # parameters of a weight shared by the first and last unit (counted in both)
    action_s: float = 0.0  # CPU workers: the dispatch thread's own time per compute action beyond its messages
    # (binding the stage, the step's other actions spread over its computes), which holds up its next compute;
    # learnt from the runs on the machine (:mod:`partition.calibrate`). 0: none, or a GPU's, which runs ahead
    worker_spread: float = 0.0  # how much a worker's compute in a step varies against the step's mean over the workers
    # (standard deviation over mean): the slower worker of a step holds the others up. Learnt from the runs on the
    # machine (:mod:`partition.calibrate`); the plan's step is the mean period of a simulation that draws it at every
    # step (:func:`partition.simulate.with_spread`). 0: workers alike
    compute_spread: float = 0.0  # how much one compute's time varies inside a step (standard deviation over mean of
    # one stage's computes of one kind: the runtime's ``compute_spread``); learnt and drawn alike. 0: none
    doc_tokens: int | None = None  # rows packed with documents of about this many tokens: attention within each
    # (the kernel mobius.models.packing picks, measured so; its FLOPs estimated so). None: one sequence per row
    reduce_scatter_x: float = 1.0  # zero mode on CPU workers: its gradient flushes' time inside the steps (each a
    # reduce-scatter, entered straight from the compute, and the copy into the rank's shard; one rank: the copy) over
    # the hardware model's, which the dispatch thread waits for; learnt from the runs on the machine
    # (:mod:`partition.calibrate`). 1: as modelled

    @property
    def num_units(self) -> int:
        return len(self.units)

    def param_bytes(self) -> int:
        """Parameter bytes of all units in the training dtype (a tied weight counts at both ends)."""
        return sum(u.param_bytes for u in self.units)

    def param_count(self) -> int:
        return sum(u.param_count for u in self.units)

    def identical_blocks(self) -> bool:
        """True when the units are ``prefix + run of identical units + suffix`` with at most one
        unit in each of the prefix and suffix (the normal embed / blocks / head shape)."""
        sigs = [u.signature for u in self.units]
        if len(sigs) < 3:
            return False
        return len(set(sigs[1:-1])) == 1

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "ModelProfile":
        """A profile from :meth:`to_json`; keys of another version that this one has no field for are left out (a
        cached profile stays usable when a field is added or dropped; a change in how units are measured changes
        the cache's key instead, ``partition.profile.PROFILE_METHOD``)."""
        units = [UnitCost(**_known(UnitCost, u)) for u in data["units"]]
        return cls(units=units, **_known(cls, {k: v for k, v in data.items() if k != "units"}))

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1)


def _known(cls: type, data: dict) -> dict:
    """The items of ``data`` that name a field of the dataclass ``cls``."""
    return {k: v for k, v in data.items() if k in cls.__dataclass_fields__}


@dataclass(frozen=True)
class StageCost:
    """A contiguous range of units ``[first, end)`` summed into one stage."""

    first: int
    end: int
    fwd_s: float
    bwd_s: float
    param_count: int
    param_bytes: int
    grad_bytes: int
    in_bytes: int
    out_bytes: int
    saved_bytes: int
    work_bytes: int
    acc_s: float = 0.0
    frozen_count: int = 0

    @property
    def trainable_count(self) -> int:
        return self.param_count - self.frozen_count


def stage_cost(profile: ModelProfile, first: int, end: int) -> StageCost:
    """Sum units ``[first, end)`` of ``profile`` into a :class:`StageCost`."""
    assert 0 <= first < end <= profile.num_units, (first, end)
    units = profile.units[first:end]
    return StageCost(
        first=first, end=end,
        fwd_s=sum(u.fwd_s for u in units), bwd_s=sum(u.bwd_s for u in units),
        param_count=sum(u.param_count for u in units),
        param_bytes=sum(u.param_bytes for u in units), grad_bytes=sum(u.grad_bytes for u in units),
        in_bytes=units[0].in_bytes, out_bytes=units[-1].act_bytes,
        saved_bytes=sum(u.saved_bytes for u in units), work_bytes=max(u.work_bytes for u in units),
        acc_s=sum(u.acc_s for u in units), frozen_count=sum(u.frozen_count for u in units),
    )


def stage_costs(profile: ModelProfile, boundaries: list[int]) -> list[StageCost]:
    """Stage costs for a partition given as boundaries ``[0, b1, ..., num_units]``."""
    check_boundaries(boundaries, profile.num_units)
    return [stage_cost(profile, a, b) for a, b in zip(boundaries, boundaries[1:])]


def check_boundaries(boundaries: list[int], num_units: int) -> None:
    """Assert that ``boundaries`` is a strictly increasing cover of ``[0, num_units]``."""
    assert boundaries[0] == 0 and boundaries[-1] == num_units, (boundaries, num_units)
    assert all(a < b for a, b in zip(boundaries, boundaries[1:])), boundaries
