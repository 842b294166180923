"""The steps as data: what each worker (pipeline) or rank (zero) runs, in order, printable.

* :mod:`partition.schedule.pipeline` -- the swapped pipeline's per-worker action lists and the one
  :class:`PipelineOptions` value the planner, the simulator and the executor share;
* :mod:`partition.schedule.roundrobin_actions` -- the round-robin step (RoundPipe's class): ops dispatched to
  the workers in rotation, separate forward and backward cuts, several steps per list;
* :mod:`partition.schedule.zero` -- zero mode's unit-major program, the chunks each operator calls
  and where gradients are reduced.

The runtimes dispatch on these and the planners simulate them, so what is planned is what runs.
"""

from partition.schedule.pipeline import (COMPUTE, Action, Kind, PipelineOptions, Schedule, ScheduleError,
                                         add_offloads, add_swaps, add_transfers, add_updates, build_eval_schedule,
                                         build_schedule, check, compute_order, offloaded_stages, timeline,
                                         uploads_in_order)
from partition.schedule.zero import (Op, OpKind, chunk_trace, eval_program, grad_flushes, program_timeline,
                                     train_program)

__all__ = ["COMPUTE", "Action", "Kind", "Op", "OpKind", "PipelineOptions", "Schedule", "ScheduleError", "add_offloads",
           "add_swaps", "add_transfers", "add_updates", "build_eval_schedule", "build_schedule", "chunk_trace", "check",
           "compute_order", "eval_program", "grad_flushes", "offloaded_stages", "program_timeline", "timeline",
           "train_program", "uploads_in_order"]
