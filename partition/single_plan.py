"""The step of plain training on one device (``parallel.mode: single``), predicted from the unit profile
that the pipeline and zero planners use, so that ``parallel.mode: auto`` can compare the three.

Plain training keeps the whole model on the device: fp32 weights, their fp32 gradients and AdamW's
two moments (16 bytes per parameter, a tied weight counted once; a frozen parameter -- LoRA's base
weights -- one copy in the training dtype, 2 bytes in bf16/fp16), plus one micro-batch's activations
at a time (micro-batches run one after another, their gradients accumulating). It fits when those
states stay within Appendix A.1's usable memory, the rule zero mode plans with
(:func:`partition.zero.memory.usable_bytes`: 95% of the device after 1.25 x the activations).

Time per micro-batch: every unit's forward with autograd and its backward without recompute -- the
profile's ``bwd_s`` (recompute + backward) is exactly that -- and, with activation checkpointing, the
recompute of every unit but the embedding on top. Then one AdamW pass over all parameters on the
device. Numbers only; no torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from partition.costs import PRECISION_BYTES, STATE_BYTES, ModelProfile, moment_savings
from partition.zero.memory import Workload, activation_bytes, usable_bytes

GiB = 2**30


@dataclass(frozen=True)
class SinglePlan:
    """What plain training on one device is predicted to cost."""

    predicted_step_s: float
    compute_s: float  # forward and backward of all the step's micro-batches
    update_s: float  # AdamW over every parameter on the device
    fits: bool
    memory: dict[str, int]  # states, activations, usable (for the states), capacity
    param_count: int  # a tied weight counted once
    frozen_count: int  # of param_count, parameters that do not train
    micro_batches: int
    micro_batch_size: int
    seq_len: int
    precision: str
    checkpointing: bool
    device_name: str = ""
    profile_source: str = ""
    states: str = "fp32"  # train.optimizer_states: the moments' precision

    @property
    def peak_bytes(self) -> int:
        return self.memory["states"] + self.memory["activations"]

    def to_json(self) -> dict:
        return {**asdict(self), "peak_bytes": self.peak_bytes}

    @classmethod
    def from_json(cls, data: dict) -> "SinglePlan":
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})

    def summary(self) -> str:
        """What ``mobius plan`` prints for ``parallel.mode: single``."""
        m = self.memory
        recompute = "with activation checkpointing" if self.checkpointing else "no recompute"
        return "\n".join([
            f"single: plain training on one device ({self.device_name}): {self.micro_batches} micro-batch(es) of "
            f"{self.micro_batch_size} x {self.seq_len} tokens one after another, forward + backward ({recompute}), "
            f"AdamW on the device",
            f"predicted step time: {self.predicted_step_s:.3f} s (forward and backward {self.compute_s:.3f} s, "
            f"AdamW {self.update_s:.3f} s)",
            f"memory: {m['states'] / GiB:.2f} GiB of model states ({STATE_BYTES - moment_savings(self.states):g} bytes "
            f"x "
            f"{(self.param_count - self.frozen_count) / 1e6:.1f}M parameters"
            + (f" + {PRECISION_BYTES[self.precision]} x {self.frozen_count / 1e6:.1f}M frozen"
               if self.frozen_count else "")
            + f") + {m['activations'] / GiB:.2f} GiB of activations; the "
            f"states may use {m['usable'] / GiB:.2f} GiB of {m['capacity'] / GiB:.2f} GiB"
            + ("" if self.fits else " -- DOES NOT FIT"),
        ])


def micro_batch_seconds(prof: ModelProfile, checkpointing: bool) -> float:
    """Forward + backward of one micro-batch through every unit (recomputing all but the embedding
    when ``checkpointing``: its input is token ids, nothing to recompute from)."""
    return sum(u.bwd_s + (u.fwd_s if checkpointing and u.kind != "embed" else 0.0) for u in prof.units)


def plan_single(prof: ModelProfile, memory_bytes: int, *, micro_batches: int, checkpointing: bool,
                adam_params_per_s: float, states: str = "fp32") -> SinglePlan:
    """Predict a step of plain training with ``memory_bytes`` of device memory (context excluded) and
    an AdamW pass at ``adam_params_per_s`` parameters per second on the device; ``states``: the moments'
    precision (train.optimizer_states)."""
    params = prof.param_count() - prof.tied_params
    frozen = sum(u.frozen_count for u in prof.units)
    activations = activation_bytes(prof, Workload(1, prof.precision, checkpointing, barrier=False))
    held = (STATE_BYTES - moment_savings(states)) * (params - frozen) + PRECISION_BYTES[prof.precision] * frozen  # a
    # frozen one: its weight
    usable = usable_bytes(memory_bytes, activations)
    compute = micro_batches * micro_batch_seconds(prof, checkpointing)
    update = (params - frozen) / adam_params_per_s
    return SinglePlan(predicted_step_s=compute + update, compute_s=compute, update_s=update, fits=held <= usable,
                      memory={"states": round(held), "activations": activations, "usable": max(usable, 0),
                              "capacity": memory_bytes},
                      param_count=params, frozen_count=frozen, micro_batches=micro_batches,
                      micro_batch_size=prof.micro_batch_size,
                      seq_len=prof.seq_len, precision=prof.precision, checkpointing=checkpointing,
                      device_name=prof.device_name, profile_source=prof.source, states=states)
