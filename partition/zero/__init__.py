"""partition.zero: the plan of ``parallel.mode: zero`` (chunked, sharded model states with rCache; Elixir).

Numbers in, a plan out; no torch (``tests/test_partition_torch_free.py`` plans without it). The chunk
layout itself is :mod:`mobius.layout` (torch-free too, and shared with the pipeline's stages:
``scheduler/stages.py``) and the step's program :mod:`partition.schedule.zero` (beside the pipeline's
schedule); here:

* :mod:`partition.zero.memory` -- the cost model's vocabulary (hardware, workload, setting) and memory;
* :mod:`partition.zero.choice` -- eq. 1-2 and the choice of rCache blocks and GPU chunks;
* :mod:`partition.zero.replacement` -- rCache replacement (Belady's rule on the trace, LRU while recording,
  prefetch of the next operator), shared by the planner's simulation and the runtime;
* :mod:`partition.zero.step_sim` -- the step-time simulation and each rank's traffic;
* :mod:`partition.zero.plan` -- :class:`ZeroPlan` and its report;
* :mod:`partition.zero.search` -- the search over chunk sizes, and :func:`plan`.
"""

from partition.zero.replacement import CachePolicy, CacheRun, CacheTooSmall, simulate_cache
from partition.zero.memory import Setting, Workload, ZeroHardware
from partition.zero.plan import ZeroPlan
from partition.zero.search import plan, replay
from partition.zero.step_sim import Prediction, predict

__all__ = ["CachePolicy", "CacheRun", "CacheTooSmall", "Prediction", "Setting", "Workload", "ZeroHardware", "ZeroPlan",
           "plan", "predict", "replay", "simulate_cache"]
