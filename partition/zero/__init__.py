"""partition.zero: the plan of ``parallel.mode: zero`` (chunked, sharded model states with rCache; Elixir).

Numbers in, a plan out; no torch:

* :mod:`partition.zero.layout` -- parameters into chunks in forward-use order; the step's operators
  and the chunks each one calls (the trace), and where gradients are reduced;
* :mod:`partition.zero.cache` -- rCache replacement (Belady's rule on the trace, LRU while recording,
  prefetch of the next operator), shared by the planner's simulation and the runtime;
* :mod:`partition.zero.search` -- memory model, eq. 1-2, the step-time simulation, the search over
  chunk sizes and settings, and :class:`ZeroPlan`.
"""

from partition.zero.cache import CachePolicy, CacheRun, CacheTooSmall, simulate_cache
from partition.zero.layout import (ALIGN, ChunkLayout, Op, OpKind, ParamInfo, build_layout, chunk_trace, eval_program,
                                   grad_flushes, train_program)
from partition.zero.search import Prediction, Setting, Workload, ZeroHardware, ZeroPlan, plan, predict

__all__ = ["ALIGN", "CachePolicy", "CacheRun", "CacheTooSmall", "ChunkLayout", "Op", "OpKind", "ParamInfo", "Prediction",
           "Setting", "Workload", "ZeroHardware", "ZeroPlan", "build_layout", "chunk_trace", "eval_program",
           "grad_flushes", "plan", "predict", "simulate_cache", "train_program"]
