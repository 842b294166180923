"""Zero mode's cost model, its vocabulary and its memory (Elixir Appendix A.1).

Memory per rank (bytes; ``P`` padded chunk length, ``s = P / N`` one rank's shard, ``L_c`` the
compute precision's bytes):

* rCache: ``n_block x P x L_c`` -- the only data duplicated across ranks;
* gradient buffers: ``(min_blocks + 1) x P x 4`` -- fp32 gradients of the chunks in backward use;
* reduce-scatter staging: ``2 x s x 4``;
* a chunk kept on the GPU: ``16 s`` (fp32 master, AdamW m and v, fp32 gradient shard); an offloaded
  chunk keeps these (and a pinned half-precision copy) in host memory and costs the GPU nothing;
  ``train.update: delayed`` adds a compute copy of each trainable shard in the training dtype
  (``(16 + L_c) s`` on the GPU; on the host a separate fp32 copy in fp32 training, 4 bytes more);
* activations from the profile (checkpointed: every unit's input for each of the rank's
  micro-batches, plus one unit's recompute; otherwise every unit's saved activations).

The usable part is Appendix A.1's ``U_allowed = F_alloc (capacity - F_frag x activations)``
(``capacity`` already excludes the CUDA context).
"""

from __future__ import annotations

from dataclasses import dataclass

from mobius.layout import ChunkLayout
from partition.costs import PRECISION_BYTES, STATE_BYTES, ModelProfile, host_bytes_per_param, moment_savings

GiB = 2**30
GB = 1e9
F_ALLOC = 0.95  # Appendix A.1: share of the device Elixir can use
F_FRAG = 1.25  # Appendix A.1: activations reserved with this factor for fragmentation
GRAD_BYTES = PRECISION_BYTES["fp32"]  # gradient buffers, reduce-scatters and downloads are fp32
# STATE_BYTES: a GPU chunk's shard element (fp32 master, AdamW m and v, fp32 gradient), partition.costs's


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
    host_staged: bool = False  # collectives go through host memory (no P2P): over the same PCIe links as uploads
    blocking: bool = False  # CPU workers (no streams): the dispatch thread itself fills the chunks it gathers and
    # reduce-scatters gradients (gloo's reduce-scatter returns when done), so the compute waits for both

    def describe(self) -> str:
        via = " through host memory" if self.host_staged else ""
        g2g = f", collectives {self.g2g_Bps / GB:.1f} GB/s per rank{via}" if self.ranks > 1 else ""
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
    delayed: bool = False  # train.update: delayed (a compute copy of every trainable shard)
    states: str = "fp32"  # train.optimizer_states: the AdamW moments' precision

    @property
    def elem(self) -> int:
        return PRECISION_BYTES[self.precision]

    @property
    def state_bytes(self) -> float:
        """GPU bytes of one element of a trainable chunk's shard kept on the GPU: :func:`gpu_state_bytes`."""
        return gpu_state_bytes(self.elem, self.delayed, self.states)


def gpu_state_bytes(elem: int, delayed: bool = False, states: str = "fp32") -> float:
    """GPU bytes of one element of a trainable chunk's shard kept on the GPU: fp32 master, AdamW m and v (in
    ``states``' precision), fp32 gradient (STATE_BYTES with fp32 moments) and, ``delayed``, the compute copy in the
    training dtype (``elem``)."""
    return STATE_BYTES - moment_savings(states) + (elem if delayed else 0)


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


def model_state_bytes(layout: ChunkLayout, s: Setting, elem: int, delayed: bool = False,
                      states: str = "fp32") -> dict[str, int]:
    """GPU bytes per rank of rCache, gradient buffers, staging and the GPU chunks' shards (``delayed``:
    with their compute copies; ``states``: their moments' precision)."""
    state = gpu_state_bytes(elem, delayed, states)
    return {"rcache": s.cache_blocks * layout.padded * elem,
            "grad_buffers": (layout.min_blocks + 1) * layout.padded * GRAD_BYTES,
            "staging": 2 * layout.shard * GRAD_BYTES,
            "gpu_shards": round(sum(state if layout.trains(c) else elem
                                    for c in range(min(s.gpu_chunks, layout.num_chunks))) * layout.shard)}


def host_bytes(layout: ChunkLayout, s: Setting, precision: str, delayed: bool = False, states: str = "fp32") -> int:
    """Host bytes per rank of the offloaded chunks' shards: fp32 master, AdamW moments (in ``states``' precision),
    fp32 gradient and (bf16/fp16) the pinned half copy -- as a swapped pipeline stage's with fp32 downloads
    (``delayed``: the half copy holds the compute weights, a separate fp32 copy in fp32 training)."""
    per = host_bytes_per_param(precision, half_grads=False, delayed=delayed, states=states)
    frozen = PRECISION_BYTES[precision]  # LoRA's base weights: one copy in the training dtype
    return round(sum(per if layout.trains(c) else frozen for c in range(s.gpu_chunks, layout.num_chunks))
                 * layout.shard)
