"""Zero mode's step as data: the operators a rank runs, the chunks each calls, where gradients are reduced.

The step as the runtime runs it (:func:`train_program`): the forward of each unit for all of a
rank's micro-batches, in model order; the last unit's forward, loss and backward; then each unit's
backward in reverse order. With activation checkpointing a unit is one checkpointed function, so
every operator is one unit and each chunk is called once in the forward and once in the backward
(Elixir §5.1's "common computation graph"). The planner's cache simulation and the runtime read the
same program; :func:`program_timeline` prints it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from mobius.layout import ChunkLayout


class OpKind(str, Enum):
    FORWARD = "F"  # a unit's forward for all of the rank's micro-batches
    LOSS = "L"  # the last unit: forward, loss and backward (training)
    BACKWARD = "B"  # a unit's backward (recomputing its forward with activation checkpointing)
    EVAL = "E"  # the last unit: forward and loss (evaluation)


@dataclass(frozen=True)
class Op:
    kind: OpKind
    unit: int

    @property
    def makes_grads(self) -> bool:
        return self.kind in (OpKind.LOSS, OpKind.BACKWARD)

    def __str__(self) -> str:
        return f"{self.kind.value}{self.unit}"


def train_program(num_units: int) -> tuple[Op, ...]:
    """Forward in model order, the last unit's loss, backward in reverse order."""
    last = num_units - 1
    return (tuple(Op(OpKind.FORWARD, u) for u in range(last)) + (Op(OpKind.LOSS, last),)
            + tuple(Op(OpKind.BACKWARD, u) for u in reversed(range(last))))


def eval_program(num_units: int) -> tuple[Op, ...]:
    last = num_units - 1
    return tuple(Op(OpKind.FORWARD, u) for u in range(last)) + (Op(OpKind.EVAL, last),)


def chunk_trace(program: tuple[Op, ...], layout: ChunkLayout) -> list[tuple[int, ...]]:
    """The chunks each operator calls, in order (what the runtime records on its warm-up step)."""
    return [layout.unit_chunks[op.unit] for op in program]


def grad_flushes(program: tuple[Op, ...], layout: ChunkLayout) -> list[tuple[int, ...]]:
    """Per operator: the trainable chunks whose run of consecutive gradient-making calls ends with it
    (their gradient is reduce-scattered then). A chunk used by two separate runs (a tied weight)
    flushes twice; frozen chunks never do."""
    trace = chunk_trace(program, layout)
    out = []
    for t, op in enumerate(program):
        if not op.makes_grads:
            out.append(())
            continue
        following = set(trace[t + 1]) if t + 1 < len(program) and program[t + 1].makes_grads else set()
        out.append(tuple(c for c in trace[t] if c not in following and layout.trains(c)))
    return out


def program_timeline(program: tuple[Op, ...], layout: ChunkLayout) -> str:
    """The program as text: one operator a line with the chunks it calls and those it reduces."""
    flushes = grad_flushes(program, layout)
    lines = [f"{str(op):>5}  chunks {list(layout.unit_chunks[op.unit])}"
             + (f"  reduce {list(flushes[t])}" if flushes[t] else "") for t, op in enumerate(program)]
    return "\n".join(lines + ["F=forward (all of the rank's micro-batches) L=last unit's forward, loss and backward "
                               "B=backward E=last unit's forward and loss (evaluation); reduce: chunks whose "
                               "gradient is reduce-scattered after the operator"])
