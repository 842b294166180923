"""The zero-mode search engine (Elixir §4-5, Appendix A): chunk size, rCache blocks, and which chunks
keep their states on the GPU, from the model's parameters, a unit profile and the machine's rates.

Memory per rank (bytes; ``P`` padded chunk length, ``s = P / N`` one rank's shard, ``L_c`` the
compute precision's bytes):

* rCache: ``n_block x P x L_c`` -- the only data duplicated across ranks;
* gradient buffers: ``(min_blocks + 1) x P x 4`` -- fp32 gradients of the chunks in backward use;
* reduce-scatter staging: ``2 x s x 4``;
* a chunk kept on the GPU: ``16 s`` (fp32 master, AdamW m and v, fp32 gradient shard); an offloaded
  chunk keeps these (and a pinned half-precision copy) in host memory and costs the GPU nothing;
* activations from the profile (checkpointed: every unit's input for each of the rank's
  micro-batches, plus one unit's recompute; otherwise every unit's saved activations).

The usable part is Appendix A.1's ``U_allowed = F_alloc (capacity - F_frag x activations)``
(``capacity`` already excludes the CUDA context). Choices, in the paper's order:

1. **chunk size** -- the candidate that replaces the fewest bytes in rCache per step (Belady, simulated,
   with the rCache the memory allows when every chunk is offloaded), ties broken by predicted time;
2. **n_block** -- at least the most chunks one unit calls (A.3), and room to prefetch the next
   operator's chunks when it fits;
3. **GPU or CPU** -- eq. 1-2 adapted to this runtime's traffic (offloaded chunks upload half-precision
   parameters from the CPU master copy and download fp32 gradients; nothing is written back on
   eviction): ``I`` = seconds saved per byte by one more rCache block (one re-upload in the
   backward), ``J`` = seconds saved per byte by keeping one more chunk on the GPU (two uploads, one
   gradient download and the CPU update, less the GPU update). If ``J >= I`` chunks go to the GPU
   first (from the front: the first chunks are updated last, so their CPU update would hold up the
   next step), then the rest of the memory extends rCache; otherwise the other way round.

The step time is predicted by an event simulation of the runtime's streams (compute, gathers,
collectives, downloads, the CPU optimizer thread) over two steps, so the CPU updates that run into
the next step are counted.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from mobius.errors import ConfigError
from partition.costs import PRECISION_BYTES, ModelProfile
from partition.zero.cache import simulate_cache
from partition.zero.layout import ALIGN, ChunkLayout, OpKind, ParamInfo, build_layout, chunk_trace, grad_flushes, \
    train_program

GiB = 2**30
GB = 1e9
F_ALLOC = 0.95  # Appendix A.1: share of the device Elixir can use
F_FRAG = 1.25  # Appendix A.1: activations reserved with this factor for fragmentation
STATE_BYTES = 16  # per shard element of a chunk on the GPU: fp32 master, AdamW m and v, fp32 gradient
HOST_BYTES = 16  # the same in host memory for an offloaded chunk (plus a pinned half copy in bf16/fp16)
GRAD_BYTES = 4  # gradient buffers, reduce-scatters and downloads are fp32
ADAM_BYTES = 28  # device bytes per parameter of a fused AdamW step (read p, g, m, v; write p, m, v)
MIN_CHUNK_BYTES = 32 * 2**20  # chunks of at least this many half-precision bytes keep transfers efficient
CHUNK_FACTORS = (0.25, 1 / 3, 0.5, 2 / 3, 1.0, 1.5, 2.0, 3.0, 4.0)  # candidates: x the largest unit
TIE = 0.01  # replaced bytes within 1% count as equal


@dataclass(frozen=True)
class ZeroHardware:
    """Per-rank rates the cost model uses (the paper's B(n), V(n) are ``ranks`` times these)."""

    ranks: int
    memory_bytes: int  # usable device memory per rank (the CUDA context already excluded)
    c2g_Bps: float  # host -> device, per rank, all ranks uploading at once
    g2c_Bps: float  # device -> host, per rank
    g2g_Bps: float  # all-gather / reduce-scatter bus bandwidth per rank (NVLink); unused for one rank
    device_Bps: float  # device memory bandwidth (casts, gradient sums)
    cpu_adam_params_per_s: float  # CPU AdamW (with the half-copy refresh) of one rank's thread share
    gpu_adam_params_per_s: float
    collective_s: float = 30e-6  # fixed cost of one copy or collective
    name: str = ""

    def describe(self) -> str:
        g2g = f", collectives {self.g2g_Bps / GB:.0f} GB/s per rank" if self.ranks > 1 else ""
        return (f"{self.name}: {self.ranks} rank(s), {self.memory_bytes / GiB:.1f} GiB usable each; per rank: "
                f"host->GPU {self.c2g_Bps / GB:.1f} GB/s, GPU->host {self.g2c_Bps / GB:.1f} GB/s{g2g}, "
                f"CPU AdamW {self.cpu_adam_params_per_s / 1e9:.2f} G params/s, GPU AdamW "
                f"{self.gpu_adam_params_per_s / 1e9:.1f} G params/s")


@dataclass(frozen=True)
class Workload:
    """What a step runs, for the cost model."""

    micro_batches: int  # this rank's share of the step
    precision: str
    checkpointing: bool
    barrier: bool  # updates wait for the global norm (clipping, fp16 loss scaling)
    prefetch: bool = True

    @property
    def elem(self) -> int:
        return PRECISION_BYTES[self.precision]


@dataclass(frozen=True)
class Setting:
    """One configuration: rCache blocks and how many chunks (from the front) stay on the GPU."""

    cache_blocks: int
    gpu_chunks: int


# ---------------------------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------------------------
def activation_bytes(prof: ModelProfile, w: Workload) -> int:
    """Activation memory of a step under the unit-major order (profile figures per micro-batch)."""
    units = prof.units
    M = w.micro_batches
    if w.checkpointing:  # every unit's input waits for its backward; one unit recomputes at a time
        return M * sum(u.act_bytes for u in units[:-1]) + max(u.saved_bytes + u.work_bytes + 2 * u.act_bytes
                                                              for u in units)
    return M * sum(u.saved_bytes + u.act_bytes for u in units) + max(u.work_bytes + u.act_bytes for u in units)


def usable_bytes(capacity: int, activations: int) -> int:
    """Appendix A.1: what chunks, rCache and gradient buffers may take."""
    return int(F_ALLOC * (capacity - F_FRAG * activations))


def model_state_bytes(layout: ChunkLayout, s: Setting, elem: int) -> dict[str, int]:
    """GPU bytes per rank of rCache, gradient buffers, staging and the GPU chunks' shards."""
    return {"rcache": s.cache_blocks * layout.padded * elem,
            "grad_buffers": (layout.min_blocks + 1) * layout.padded * GRAD_BYTES,
            "staging": 2 * layout.shard * GRAD_BYTES,
            "gpu_shards": s.gpu_chunks * layout.shard * STATE_BYTES}


def host_bytes(layout: ChunkLayout, s: Setting, elem: int) -> int:
    """Host bytes per rank of the offloaded chunks' shards."""
    half = 0 if elem == 4 else elem
    return (layout.num_chunks - s.gpu_chunks) * layout.shard * (HOST_BYTES + half)


# ---------------------------------------------------------------------------------------------
# Eq. 1-2 (adapted) and the choice of a setting
# ---------------------------------------------------------------------------------------------
def rcache_benefit(hw: ZeroHardware, elem: int) -> float:
    """I: seconds per byte saved by one more rCache block -- the backward re-upload of one offloaded
    shard it spares (``s L_c / B_c2g``) over the block's ``P L_c`` bytes."""
    return 1.0 / (hw.ranks * hw.c2g_Bps)


def gpu_benefit(hw: ZeroHardware, elem: int) -> float:
    """J: seconds per byte saved by keeping one more chunk on the GPU -- its two uploads, its fp32
    gradient download and its CPU update, less its GPU update -- over its ``16 s`` bytes."""
    saved = 2 * elem / hw.c2g_Bps + GRAD_BYTES / hw.g2c_Bps + 1 / hw.cpu_adam_params_per_s \
        - 1 / hw.gpu_adam_params_per_s
    return saved / STATE_BYTES


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
    block, chunk = layout.padded * elem, layout.shard * STATE_BYTES
    fixed = sum(model_state_bytes(layout, Setting(0, 0), elem).values())
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
    if gpu_benefit(hw, elem) >= rcache_benefit(hw, elem):
        g = min(n_max, free // chunk)
        return Setting(min(n_max, start + (free - g * chunk) // block), g)
    extra = min(n_max - start, free // block)
    return Setting(start + extra, min(n_max, (free - extra * block) // chunk))


# ---------------------------------------------------------------------------------------------
# Step time: an event simulation of the runtime's streams
# ---------------------------------------------------------------------------------------------
@dataclass
class Prediction:
    """A simulated step (the second of two, so CPU updates running into it are counted)."""

    step_s: float
    compute_s: float
    stall_s: float  # compute waiting for gathers
    cpu_adam_s: float
    gathers: int
    traffic: dict[str, float]  # bytes per rank per step


@dataclass
class _Lanes:
    gather: float = 0.0  # the gather stream (uploads, casts)
    g2g: float = 0.0  # the collectives (one communicator: all-gathers and reduce-scatters in issue order)
    d2h: float = 0.0
    cpu: float = 0.0  # the CPU optimizer thread
    compute: float = 0.0


def _op_seconds(prof: ModelProfile, op: Any, w: Workload) -> float:
    u = prof.units[op.unit]
    if op.kind in (OpKind.FORWARD, OpKind.EVAL):
        return w.micro_batches * u.fwd_s
    if op.kind == OpKind.LOSS or w.checkpointing:
        return w.micro_batches * u.bwd_s  # forward (or recompute) and backward
    return w.micro_batches * max(u.bwd_s - u.fwd_s, 0.0)


def predict(layout: ChunkLayout, prof: ModelProfile, hw: ZeroHardware, s: Setting, w: Workload) -> Prediction:
    """Predicted steady-state step time and per-step traffic of one setting."""
    sim = _StepSim(layout, prof, hw, s, w)
    ends, stats = [], {}
    for _ in range(2):
        stats = sim.step()
        ends.append(sim.lanes.compute)
    N, P, sh, e, run = hw.ranks, layout.padded, layout.shard, w.elem, sim.run
    off = [c for c in run.gathered_chunks() if c >= s.gpu_chunks]
    flush_count = sum(len(f) for f in sim.flushes)
    traffic = {"replaced_bytes": run.gathers * P * e, "allgather_bytes": run.gathers * (N - 1) * sh * e,
               "reduce_scatter_bytes": flush_count * (N - 1) * sh * GRAD_BYTES,
               "h2d_bytes": len(off) * sh * e, "d2h_bytes": (layout.num_chunks - s.gpu_chunks) * sh * GRAD_BYTES}
    return Prediction(ends[1] - ends[0], stats["compute"], stats["stall"], stats["cpu"], run.gathers, traffic)


class _StepSim:
    """Steps of the runtime on its lanes (carried from step to step, as are the CPU updates' ends)."""

    def __init__(self, layout: ChunkLayout, prof: ModelProfile, hw: ZeroHardware, s: Setting, w: Workload):
        self.layout, self.prof, self.hw, self.s, self.w = layout, prof, hw, s, w
        self.program = train_program(layout.num_units)
        self.trace = chunk_trace(self.program, layout)
        self.flushes = grad_flushes(self.program, layout)
        self.run = simulate_cache(self.trace, s.cache_blocks, w.prefetch)
        self.runs = {c: sum(c in f for f in self.flushes) for c in range(layout.num_chunks)}
        sh, e, N, lat = layout.shard, w.elem, hw.ranks, hw.collective_s
        self.cost = {"upload": lat + sh * e / hw.c2g_Bps, "cast": lat + sh * (4 + e) / hw.device_Bps,
                     "allgather": lat + (N - 1) * sh * e / hw.g2g_Bps if N > 1 else 0.0,
                     "reduce": lat + ((N - 1) * sh * GRAD_BYTES / hw.g2g_Bps if N > 1
                                      else 2 * sh * GRAD_BYTES / hw.device_Bps),
                     "download": lat + sh * GRAD_BYTES / hw.g2c_Bps, "cpu_adam": sh / hw.cpu_adam_params_per_s}
        self.fold_s = w.micro_batches * (e + 8) / hw.device_Bps  # per parameter: its gradient into the fp32 sums
        self.lanes, self.cpu_ready = _Lanes(), [0.0] * layout.num_chunks
        self.stats: dict[str, float] = {}
        self.block_free: list[float] = []  # per step: when each block's last reader ends
        self.ready: dict[int, float] = {}  # per step: when each gathered chunk is complete
        self.where: dict[int, int] = {}
        self.seen: dict[int, int] = {}  # per step: flushes so far per chunk
        self.barrier_jobs: list[tuple[int, float]] = []  # CPU updates that wait for the norm
        self.flush_end = 0.0

    def step(self) -> dict[str, float]:
        """One step from the end of the previous one; returns its compute, stall and CPU seconds."""
        start = self.lanes.compute
        self.block_free, self.ready, self.where = [start] * self.s.cache_blocks, {}, {}
        self.seen, self.barrier_jobs, self.flush_end = dict.fromkeys(self.runs, 0), [], start
        self.stats = {"compute": 0.0, "stall": 0.0, "cpu": 0.0}
        for t, op in enumerate(self.program):
            self._operator(t, op)
        lanes = self.lanes
        lanes.compute = max(lanes.compute, self.flush_end) + self.hw.collective_s  # the step's statistics
        for c, done in self.barrier_jobs:
            self._cpu_update(c, max(done, lanes.compute))
        lanes.compute += self.s.gpu_chunks * self.layout.shard / self.hw.gpu_adam_params_per_s
        return self.stats

    def _operator(self, t: int, op: Any) -> None:
        for c, b in self.run.demand[t] + self.run.prefetched[t]:
            self._gather(c, b)
        lanes = self.lanes
        begin = max([lanes.compute] + [self.ready[c] for c in self.trace[t]])
        dt = _op_seconds(self.prof, op, self.w) + (self.fold_s * _unit_numel(self.layout, op.unit)
                                                  if op.makes_grads else 0.0)
        self.stats["stall"] += begin - lanes.compute
        self.stats["compute"] += dt
        lanes.compute = begin + dt
        for c in self.trace[t]:
            self.block_free[self.where[c]] = lanes.compute
        for c in self.flushes[t]:
            self._flush(c)

    def _gather(self, c: int, b: int) -> None:
        lanes, offloaded = self.lanes, c >= self.s.gpu_chunks
        begin = max(lanes.gather, self.block_free[b], self.cpu_ready[c] if offloaded else 0.0)
        lanes.gather = begin + (self.cost["upload"] if offloaded else self.cost["cast"])
        lanes.g2g = max(lanes.g2g, lanes.gather) + self.cost["allgather"]
        self.ready[c] = lanes.g2g if self.hw.ranks > 1 else lanes.gather
        self.where[c] = b

    def _flush(self, c: int) -> None:
        lanes = self.lanes
        lanes.g2g = max(lanes.g2g, lanes.compute) + self.cost["reduce"]
        self.seen[c] += 1
        done = lanes.g2g
        if self.seen[c] == self.runs[c] and c >= self.s.gpu_chunks:
            lanes.d2h = max(lanes.d2h, done) + self.cost["download"]
            done = lanes.d2h
            if self.w.barrier:
                self.barrier_jobs.append((c, done))
            else:
                self._cpu_update(c, done)
        self.flush_end = max(self.flush_end, done)

    def _cpu_update(self, c: int, arrived: float) -> None:
        self.lanes.cpu = max(self.lanes.cpu, arrived) + self.cost["cpu_adam"]
        self.cpu_ready[c] = self.lanes.cpu
        self.stats["cpu"] += self.cost["cpu_adam"]


def _unit_numel(layout: ChunkLayout, unit: int) -> int:
    return sum(p.numel for p in layout.params if unit in p.units)


# ---------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------
@dataclass
class ZeroPlan:
    """What zero mode runs: chunk size, rCache blocks, GPU chunks, and what it is predicted to cost."""

    chunk_size: int
    padded_chunk: int
    align: int
    world: int
    num_chunks: int
    cache_blocks: int
    min_blocks: int
    gpu_chunks: int
    micro_batches: int  # per step, all ranks
    micro_batch_size: int
    seq_len: int
    precision: str
    checkpointing: bool
    prefetch: bool
    barrier: bool
    predicted_step_s: float
    compute_s: float
    stall_s: float
    cpu_adam_s: float
    fits: bool
    memory: dict[str, int]  # per rank: rcache, grad_buffers, staging, gpu_shards, activations, usable, capacity, host
    traffic: dict[str, float]  # bytes per rank per step
    benefits: dict[str, float]  # I and J in seconds per GiB
    alternatives: dict[str, dict | None]  # rcache-min, rcache-max, all-offload: setting and prediction
    candidates: list[dict] = field(default_factory=list)  # the chunk-size search
    decided: dict[str, str] = field(default_factory=dict)  # key -> "search" or "config"
    param_count: int = 0
    waste: float = 0.0
    hardware: str = ""
    profile_source: str = ""
    device_name: str = ""

    @property
    def peak_bytes(self) -> int:
        m = self.memory
        return m["rcache"] + m["grad_buffers"] + m["staging"] + m["gpu_shards"] + m["activations"]

    def to_json(self) -> dict:
        out = asdict(self)
        out["peak_bytes"] = self.peak_bytes
        return out

    @classmethod
    def from_json(cls, data: dict) -> "ZeroPlan":
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})

    def summary(self) -> str:
        """A human-readable report (what ``mobius plan`` prints for ``parallel.mode: zero``)."""
        return "\n".join(_summary_lines(self))


def _size(n: float) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e5 else f"{n:.0f}"


def _gb(n: float) -> str:
    return f"{n / GB:.2f} GB" if n >= 1e7 else f"{n / 1e6:.2f} MB"


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB / 100 else f"{n / 2**20:.1f} MiB"


def _summary_lines(p: ZeroPlan) -> list[str]:
    e = PRECISION_BYTES[p.precision]
    m, t = p.memory, p.traffic
    offloaded = p.num_chunks - p.gpu_chunks
    lines = [
        f"zero: {p.world} rank(s), {p.micro_batches // p.world} of the step's {p.micro_batches} micro-batches each; "
        f"activation checkpointing {'on' if p.checkpointing else 'off'}",
        f"chunks: {p.num_chunks} of {_size(p.chunk_size)} parameters ({p.chunk_size * e / 2**20:.1f} MiB in "
        f"{p.precision}; buffers of {_size(p.padded_chunk)}, shards of {_size(p.padded_chunk // p.world)}), "
        f"{100 * p.waste:.1f}% padding [{p.decided.get('chunk_size', 'search')}]",
        f"rCache: {p.cache_blocks} blocks = {_gib(m['rcache'])} (rCache-min {p.min_blocks}, rCache-max "
        f"{p.num_chunks}) [{p.decided.get('cache_blocks', 'search')}]",
        f"chunk states: {p.gpu_chunks} chunk(s) on the GPU (GPU AdamW), {offloaded} offloaded (CPU master copy and "
        f"CPU AdamW; {_gib(m['host'])} of host memory) [{p.decided.get('gpu_chunks', 'search')}]",
        f"predicted step time: {p.predicted_step_s:.3f} s (compute {p.compute_s:.3f} s, waiting for gathers "
        f"{p.stall_s:.3f} s, CPU AdamW {p.cpu_adam_s:.3f} s)",
        f"GPU memory per rank: {_gib(p.peak_bytes)} predicted of {_gib(m['capacity'])} (rCache "
        f"{_gib(m['rcache'])}, gradient buffers {_gib(m['grad_buffers'] + m['staging'])}, GPU shards "
        f"{_gib(m['gpu_shards'])}, activations {_gib(m['activations'])}; chunks may use {_gib(m['usable'])})"
        + ("" if p.fits else " -- DOES NOT FIT"),
        f"traffic per rank and step: replaced in rCache {_gb(t['replaced_bytes'])}, all-gather "
        f"{_gb(t['allgather_bytes'])}, reduce-scatter {_gb(t['reduce_scatter_bytes'])}, host->GPU "
        f"{_gb(t['h2d_bytes'])}, GPU->host {_gb(t['d2h_bytes'])}",
        f"eq. 1-2: I = {p.benefits['I_s_per_GiB'] * 1e3:.2f} ms/GiB (one more rCache block), J = "
        f"{p.benefits['J_s_per_GiB'] * 1e3:.2f} ms/GiB (one more chunk on the GPU): "
        + ("chunks to the GPU first" if p.benefits["J_s_per_GiB"] >= p.benefits["I_s_per_GiB"]
           else "rCache first"),
    ]
    alts = []
    for name, a in p.alternatives.items():
        if a is None:
            alts.append(f"{name}: does not fit")
        else:
            alts.append(f"{name} {a['step_s']:.3f} s ({a['cache_blocks']} blocks, {a['gpu_chunks']} on GPU, "
                        f"{_gib(a['peak_bytes'])})")
    lines.append("alternatives (predicted): " + "; ".join(alts))
    if len(p.candidates) > 1:
        cands = ", ".join(f"{_size(c['chunk_size'])}: {_gb(c['replaced_bytes'])}" if c["fits"]
                          else f"{_size(c['chunk_size'])}: does not fit" for c in p.candidates)
        lines.append(f"chunk sizes simulated (bytes replaced in rCache per step): {cands}")
    return lines


# ---------------------------------------------------------------------------------------------
# The search
# ---------------------------------------------------------------------------------------------
def chunk_candidates(params: list[ParamInfo], num_units: int, elem: int, align: int = ALIGN) -> list[int]:
    """Chunk sizes to simulate: multiples of the largest unit's parameters, and the largest parameter,
    no smaller than ``MIN_CHUNK_BYTES`` (or an eighth of a small model)."""
    per_unit = [0] * num_units
    for p in params:
        per_unit[p.units[0]] += p.numel
    total, largest = sum(per_unit), max(per_unit)
    floor = min(MIN_CHUNK_BYTES // elem, max(1, total // 8))
    raw = {int(largest * f) for f in CHUNK_FACTORS} | {max(p.numel for p in params)}
    return sorted({-(-c // align) * align for c in raw if floor <= c <= total} or {-(-max(floor, 1) // align) * align})


def _evaluate(layout: ChunkLayout, prof: ModelProfile, hw: ZeroHardware, w: Workload, s: Setting,
              act: int) -> dict:
    pred = predict(layout, prof, hw, s, w)
    peak = sum(model_state_bytes(layout, s, w.elem).values()) + act
    return {"cache_blocks": s.cache_blocks, "gpu_chunks": s.gpu_chunks, "step_s": pred.step_s, "peak_bytes": peak,
            "replaced_bytes": pred.traffic["replaced_bytes"], "prediction": pred}


def alternatives(layout: ChunkLayout, prof: ModelProfile, hw: ZeroHardware, w: Workload, allowed: int,
                 act: int) -> dict[str, dict | None]:
    """rCache-min, rCache-max and all-offload, each filling the memory left the paper's way."""
    out: dict[str, dict | None] = {}
    block = layout.padded * w.elem
    fixed = sum(model_state_bytes(layout, Setting(0, 0), w.elem).values())
    fill = {"rcache-min": layout.min_blocks, "rcache-max": layout.num_chunks}
    for name, n in fill.items():
        s = choose_setting(layout, hw, allowed, w, cache_blocks=n) if fixed + n * block <= allowed else None
        out[name] = _public(_evaluate(layout, prof, hw, w, s, act)) if s else None
    n = min(layout.num_chunks, (allowed - fixed) // block) if allowed > fixed else 0
    ok = n >= layout.min_blocks
    out["all-offload"] = _public(_evaluate(layout, prof, hw, w, Setting(n, 0), act)) if ok else None
    return out


def _public(row: dict) -> dict:
    return {k: v for k, v in row.items() if k != "prediction"}


def search(params: list[ParamInfo], num_units: int, prof: ModelProfile, hw: ZeroHardware, w: Workload, *,
           chunk_size: int = 0, cache_blocks: int = 0, gpu_chunks: int = -1,
           align: int = ALIGN) -> tuple[ChunkLayout, Setting, dict, list[dict]]:
    """The chosen layout and setting, its evaluation, and the chunk-size table (module docstring)."""
    act = activation_bytes(prof, w)
    allowed = usable_bytes(hw.memory_bytes, act)
    sizes = [chunk_size] if chunk_size else chunk_candidates(params, num_units, w.elem, align)
    layouts = [build_layout(params, num_units, size, hw.ranks, align) for size in sizes]
    if cache_blocks and not chunk_size:  # only the chunk sizes that this many blocks can run
        allowed_sizes = [lay for lay in layouts if lay.min_blocks <= cache_blocks <= lay.num_chunks]
        if not allowed_sizes:
            raise ConfigError(f"zero.cache_blocks={cache_blocks} suits none of the chunk sizes searched (they need "
                              f"{min(lay.min_blocks for lay in layouts)} to {max(lay.num_chunks for lay in layouts)} "
                              f"blocks); set zero.chunk_size too, or zero.cache_blocks=0")
        layouts = allowed_sizes
    rows = []
    for layout in layouts:
        size = layout.chunk_size
        setting = choose_setting(layout, hw, allowed, w, cache_blocks, gpu_chunks)
        if setting is None:
            rows.append({"chunk_size": size, "fits": False, "layout": layout})
            continue
        ev = _evaluate(layout, prof, hw, w, setting, act)
        all_off = choose_setting(layout, hw, allowed, w, cache_blocks, gpu_chunks=0) or setting
        ranking = simulate_cache(chunk_trace(train_program(num_units), layout), all_off.cache_blocks, w.prefetch)
        rows.append({"chunk_size": size, "fits": True, "layout": layout, "setting": setting, "eval": ev,
                     "replaced_bytes": ranking.gathers * layout.padded * w.elem})
    fitting = [r for r in rows if r["fits"]]
    if not fitting:
        if chunk_size:  # a chunk size given: run it as configured and say it may not fit
            r = rows[0]
            s = Setting(cache_blocks or r["layout"].min_blocks, max(gpu_chunks, 0))
            return r["layout"], s, _evaluate(r["layout"], prof, hw, w, s, act), _table(rows)
        raise ConfigError(_too_small(rows, hw, act, allowed, w))
    least = min(r["replaced_bytes"] for r in fitting)
    near = [r for r in fitting if r["replaced_bytes"] <= least * (1 + TIE)]
    best = min(near, key=lambda r: (r["eval"]["step_s"], -r["chunk_size"]))
    return best["layout"], best["setting"], best["eval"], _table(rows)


def _table(rows: list[dict]) -> list[dict]:
    return [{"chunk_size": r["chunk_size"], "fits": r["fits"], "num_chunks": r["layout"].num_chunks,
             "replaced_bytes": r.get("replaced_bytes", 0), "step_s": r["eval"]["step_s"] if r["fits"] else None}
            for r in rows]


def _too_small(rows: list[dict], hw: ZeroHardware, act: int, allowed: int, w: Workload) -> str:
    need = min(sum(model_state_bytes(r["layout"], Setting(r["layout"].min_blocks, 0), w.elem).values()) for r in rows)
    return (f"zero mode does not fit in {hw.memory_bytes / GiB:.1f} GiB per rank: activations take "
            f"{act / GiB:.2f} GiB (x{F_FRAG} for fragmentation), leaving {max(allowed, 0) / GiB:.2f} GiB for chunks, "
            f"but the smallest rCache needs {need / GiB:.2f} GiB; use a smaller train.micro_batch_size, turn on "
            f"model.activation_checkpointing, or use more devices")


def plan(params: list[ParamInfo], num_units: int, prof: ModelProfile, hw: ZeroHardware, *, micro_batches: int,
         checkpointing: bool, barrier: bool, prefetch: bool = True, chunk_size: int = 0, cache_blocks: int = 0,
         gpu_chunks: int = -1, align: int = ALIGN) -> ZeroPlan:
    """The zero plan: search (or take the configured values), predict, and compare the alternatives."""
    if micro_batches % hw.ranks:
        raise ConfigError(f"train.micro_batches={micro_batches} must be a multiple of the {hw.ranks} zero ranks")
    w = Workload(micro_batches // hw.ranks, prof.precision, checkpointing, barrier, prefetch)
    layout, s, ev, table = search(params, num_units, prof, hw, w, chunk_size=chunk_size, cache_blocks=cache_blocks,
                                  gpu_chunks=gpu_chunks, align=align)
    act = activation_bytes(prof, w)
    allowed = usable_bytes(hw.memory_bytes, act)
    pred: Prediction = ev["prediction"]
    states = model_state_bytes(layout, s, w.elem)
    memory = {**states, "activations": act, "usable": allowed, "capacity": hw.memory_bytes,
              "host": host_bytes(layout, s, w.elem)}
    decided = {"chunk_size": "config" if chunk_size else "search",
               "cache_blocks": "config" if cache_blocks else "search",
               "gpu_chunks": "config" if gpu_chunks >= 0 else "search"}
    return ZeroPlan(
        chunk_size=layout.chunk_size, padded_chunk=layout.padded, align=align, world=hw.ranks,
        num_chunks=layout.num_chunks, cache_blocks=s.cache_blocks, min_blocks=layout.min_blocks,
        gpu_chunks=s.gpu_chunks, micro_batches=micro_batches, micro_batch_size=prof.micro_batch_size,
        seq_len=prof.seq_len, precision=prof.precision, checkpointing=checkpointing, prefetch=prefetch,
        barrier=barrier, predicted_step_s=pred.step_s, compute_s=pred.compute_s, stall_s=pred.stall_s,
        cpu_adam_s=pred.cpu_adam_s, fits=sum(states.values()) <= allowed, memory=memory, traffic=pred.traffic,
        benefits={"I_s_per_GiB": rcache_benefit(hw, w.elem) * GiB, "J_s_per_GiB": gpu_benefit(hw, w.elem) * GiB},
        alternatives=alternatives(layout, prof, hw, w, allowed, act), candidates=table, decided=decided,
        param_count=layout.param_numel, waste=layout.waste, hardware=hw.describe(), profile_source=prof.source,
        device_name=prof.device_name)
