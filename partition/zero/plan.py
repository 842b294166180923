"""What zero mode runs (:class:`ZeroPlan`: chunk size, rCache blocks, GPU chunks and their predicted
cost), as JSON and as the report ``mobius plan`` prints."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from partition.costs import PRECISION_BYTES
from partition.spread import drawn_text
from partition.zero.memory import GB, GiB


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
    delayed: bool = False  # train.update: delayed (the memory figures count the compute copies)
    states: str = "fp32"  # train.optimizer_states (the moments' bytes on the GPU and on the host)
    decided: dict[str, str] = field(default_factory=dict)  # key -> "search" or "config"
    param_count: int = 0
    waste: float = 0.0
    hardware: str = ""
    profile_source: str = ""
    device_name: str = ""
    time_split: dict[str, float] = field(default_factory=dict)  # the compute's forward and backward phases
    # (Prediction.time_split), as a zero run's metrics measure them
    compute_scale: dict = field(default_factory=dict)  # the factors the profile's times were scaled by to the
    # compute earlier zero runs of the setting measured on this machine (partition.calibrate; empty: as profiled)
    spread_s: float = 0.0  # of predicted_step_s, what the ranks' computes varying add (their spreads, which earlier
    # runs measured, drawn: partition.zero.step_sim.with_spread)

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


def _spread_text(p: ZeroPlan) -> str:
    """What the ranks' spreads add to the step, and how far they were drawn (empty at the means)."""
    if not p.spread_s:
        return ""
    return f"; {drawn_text(p.compute_scale, 'ranks') or 'the spreads drawn'}: {p.spread_s:+.3f} s"


def _summary_lines(p: ZeroPlan) -> list[str]:
    e = PRECISION_BYTES[p.precision]
    m, t = p.memory, p.traffic
    offloaded = p.num_chunks - p.gpu_chunks
    lines = [
        f"zero: {p.world} rank(s), {p.micro_batches // p.world} of the step's {p.micro_batches} micro-batches each; "
        f"activation checkpointing {'on' if p.checkpointing else 'off'}"
        + ("; train.update=delayed (a compute copy of every trainable shard)" if p.delayed else ""),
        f"chunks: {p.num_chunks} of {_size(p.chunk_size)} parameters ({p.chunk_size * e / 2**20:.1f} MiB in "
        f"{p.precision}; buffers of {_size(p.padded_chunk)}, shards of {_size(p.padded_chunk // p.world)}), "
        f"{100 * p.waste:.1f}% padding [{p.decided.get('chunk_size', 'search')}]",
        f"rCache: {p.cache_blocks} blocks = {_gib(m['rcache'])} (rCache-min {p.min_blocks}, rCache-max "
        f"{p.num_chunks}) [{p.decided.get('cache_blocks', 'search')}]",
        f"chunk states: {p.gpu_chunks} chunk(s) on the GPU (GPU AdamW), {offloaded} offloaded (CPU master copy and "
        f"CPU AdamW; {_gib(m['host'])} of host memory) [{p.decided.get('gpu_chunks', 'search')}]",
        f"predicted step time: {p.predicted_step_s:.3f} s (compute {p.compute_s:.3f} s, waiting for gathers "
        f"{p.stall_s:.3f} s, CPU AdamW {p.cpu_adam_s:.3f} s{_spread_text(p)})",
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
