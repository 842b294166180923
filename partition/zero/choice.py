"""Elixir's eq. 1-2, adapted to this runtime's traffic, and the choice of rCache blocks and GPU chunks.

1. **n_block** -- at least the most chunks one unit calls (A.3), and room to prefetch the next
   operator's chunks when it fits;
2. **GPU or CPU** -- offloaded chunks upload half-precision parameters from the CPU master copy and
   download fp32 gradients; nothing is written back on eviction: ``I`` = seconds saved per byte by
   one more rCache block (one re-upload in the backward), ``J`` = seconds saved per byte by keeping
   one more chunk on the GPU (two uploads, one gradient download and the CPU update, less the GPU
   update). If ``J >= I`` chunks go to the GPU first (from the front: the first chunks are updated
   last, so their CPU update would hold up the next step), then the rest of the memory extends
   rCache; otherwise the other way round.
"""

from __future__ import annotations

import math

from mobius.errors import ConfigError
from mobius.layout import ChunkLayout
from partition.schedule.zero import chunk_trace, train_program
from partition.zero.memory import GRAD_BYTES, STATE_BYTES, Setting, Workload, ZeroHardware, model_state_bytes


def rcache_benefit(hw: ZeroHardware, elem: int) -> float:
    """I: seconds per byte saved by one more rCache block -- the backward re-upload of one offloaded
    shard it spares (``s L_c / B_c2g``) over the block's ``P L_c`` bytes."""
    return 1.0 / (hw.ranks * hw.c2g_Bps)


def gpu_benefit(hw: ZeroHardware, elem: int, state_bytes: float = STATE_BYTES) -> float:
    """J: seconds per byte saved by keeping one more chunk on the GPU -- its two uploads, its fp32
    gradient download and its CPU update, less its GPU update -- over its ``16 s`` bytes (``state_bytes``
    per element: more under train.update=delayed, :attr:`Workload.state_bytes`)."""
    saved = 2 * elem / hw.c2g_Bps + GRAD_BYTES / hw.g2c_Bps + 1 / hw.cpu_adam_params_per_s \
        - 1 / hw.gpu_adam_params_per_s
    return saved / state_bytes


def prefetch_window(layout: ChunkLayout) -> int:
    """Blocks for one operator's chunks and the next one's (prefetch without waiting)."""
    trace = chunk_trace(train_program(layout.num_units), layout)
    return min(layout.num_chunks, max(len(set(a) | set(b)) for a, b in zip(trace, trace[1:])))


def choose_setting(layout: ChunkLayout, hw: ZeroHardware, allowed: int, w: Workload, cache_blocks: int = 0,
                   gpu_chunks: int = -1) -> Setting | None:
    """rCache blocks and GPU chunks for one layout (module docstring, 2-3); ``cache_blocks`` > 0 and
    ``gpu_chunks`` >= 0 are taken as given. None when not even rCache-min fits."""
    n_min, n_max = layout.min_blocks, layout.num_chunks
    if cache_blocks and not n_min <= cache_blocks <= n_max:
        raise ConfigError(f"zero.cache_blocks={cache_blocks} must be between {n_min} (the most chunks one unit "
                          f"uses with zero.chunk_size={layout.chunk_size}) and {n_max} (every chunk)")
    elem = w.elem
    block, chunk = layout.padded * elem, math.ceil(layout.shard * w.state_bytes)
    fixed = sum(model_state_bytes(layout, Setting(0, 0), elem, w.delayed, w.states).values())
    start = cache_blocks or n_min
    window = prefetch_window(layout)
    if not cache_blocks and w.prefetch and fixed + window * block <= allowed:
        start = max(start, window)
    gpu = min(gpu_chunks, n_max) if gpu_chunks >= 0 else -1
    free = allowed - fixed - start * block
    if gpu >= 0 and cache_blocks:
        return Setting(cache_blocks, gpu)
    if free < 0 and gpu < 0:
        return None
    if cache_blocks:
        return Setting(cache_blocks, max(0, min(n_max, free // chunk)))
    if gpu >= 0:
        return Setting(min(n_max, start + max(0, (free - gpu * chunk) // block)), gpu)
    if gpu_benefit(hw, elem, w.state_bytes) >= rcache_benefit(hw, elem):
        g = min(n_max, free // chunk)
        return Setting(min(n_max, start + (free - g * chunk) // block), g)
    extra = min(n_max - start, free // block)
    return Setting(start + extra, min(n_max, (free - extra * block) // chunk))
