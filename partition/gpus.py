"""A small catalogue of GPUs' datasheet figures, for planning a server from a machine without its GPUs.

``half_tflops`` is the dense (no sparsity) tensor-core rate for fp16/bf16 inputs with FP32
accumulation: what PyTorch's half-precision matrix multiplies run (cuBLAS with a 32-bit compute
type), hence what mobius runs. GeForce cards run FP32 accumulation at half their FP16-accumulate
rate (``half_fp16acc_tflops``), which PyTorch uses only when
``torch.backends.cuda.matmul.allow_fp16_accumulation`` is set -- mobius never sets it; the catalogue
keeps it to compare with runs that did. ``fp32_tflops`` is the non-tensor FP32 rate (fp32 training:
PyTorch leaves TF32 off for matrix multiplies). Every rate names its source beside it. PCIe rates
are per direction and *effective* (what a pinned ``cudaMemcpy`` reaches), not the line rate:
Gen3 x16 13.1 GB/s (the Mobius paper's measured maximum), Gen5 x16 54.7 GB/s (measured with
`mobius topo --bench` on an H100 80GB PCIe host), Gen4 in between.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from mobius.errors import ConfigError

GB = 1e9
GiB = 1 << 30
PCIE_LANE_Bps = {3: 13.1e9 / 16, 4: 26.2e9 / 16, 5: 54.7e9 / 16}


@dataclass(frozen=True)
class GPUSpec:
    """Datasheet figures for one GPU model."""

    name: str
    half_tflops: float  # dense fp16/bf16 tensor throughput, FP32 accumulate (what mobius runs)
    fp32_tflops: float
    mem_GBps: float  # device memory bandwidth
    memory_bytes: int
    pcie_gen: int
    pcie_lanes: int = 16
    half_fp16acc_tflops: float | None = None  # dense fp16 tensor throughput, FP16 accumulate (None: half_tflops)

    def pcie_Bps(self) -> float:
        """Effective host<->GPU bandwidth per direction."""
        return PCIE_LANE_Bps[self.pcie_gen] * self.pcie_lanes

    def tflops(self, precision: str, accumulate: str = "fp32") -> float:
        """Dense matrix-multiply rate for ``precision`` with ``accumulate`` ("fp32", or "fp16": a
        half-precision run with ``allow_fp16_accumulation``)."""
        if precision == "fp32":
            return self.fp32_tflops
        if accumulate == "fp16" and precision == "fp16":
            return self.half_fp16acc_tflops or self.half_tflops
        return self.half_tflops


GPU_CATALOGUE: dict[str, GPUSpec] = {
    # NVIDIA Ampere GA102 whitepaper (v2.0), Appendix A, GeForce RTX 3090: peak FP16 / BF16 tensor
    # TFLOPS with FP32 accumulate 71 dense (142 sparse), with FP16 accumulate 142; FP32 35.6; 936 GB/s
    "rtx3090": GPUSpec("rtx3090", 71.0, 35.6, 936, 24 * GiB, 4, half_fp16acc_tflops=142.0),
    # not in the GA102 whitepaper: its per-SM rate (the 3090's 71 TFLOPS over 82 SMs at 1.695 GHz, 512
    # FLOP per clock per SM with FP32 accumulate) at the 3090 Ti's 84 SMs and 1.86 GHz boost; FP32 40.0,
    # 1008 GB/s from NVIDIA's RTX 3090 Ti specifications
    "rtx3090ti": GPUSpec("rtx3090ti", 80.0, 40.0, 1008, 24 * GiB, 4, half_fp16acc_tflops=160.0),
    # NVIDIA Ada GPU architecture whitepaper (v2.01), Table 2, GeForce RTX 4090: peak FP16 / BF16
    # tensor TFLOPS with FP32 accumulate 165.2 dense (330.4 sparse), with FP16 accumulate 330.3; FP32
    # 82.6; 1008 GB/s
    "rtx4090": GPUSpec("rtx4090", 165.2, 82.6, 1008, 24 * GiB, 4, half_fp16acc_tflops=330.3),
    # NVIDIA Tesla V100 whitepaper (SXM2): 125 tensor TFLOPS (fp16 with fp32 accumulate; no bf16), 15.7 FP32
    "v100-16gb": GPUSpec("v100-16gb", 125.0, 15.7, 900, 16 * GiB, 3),
    # NVIDIA A100 Tensor Core GPU architecture whitepaper: 312 dense FP16 / BF16 tensor TFLOPS (FP32
    # accumulate at full rate), 19.5 FP32; 1555 GB/s (40 GB), 2039 GB/s (80 GB SXM)
    "a100-40gb": GPUSpec("a100-40gb", 312.0, 19.5, 1555, 40 * GiB, 4),
    "a100-80gb": GPUSpec("a100-80gb", 312.0, 19.5, 2039, 80 * GiB, 4),
    # NVIDIA H100 Tensor Core GPU datasheet: SXM5 989.4 dense FP16 / BF16 tensor TFLOPS, 67 FP32,
    # 3.35 TB/s; PCIe 756 dense, 51 FP32, 2.0 TB/s (FP32 accumulate at full rate)
    "h100": GPUSpec("h100", 989.4, 67.0, 3350, 80 * GiB, 5),
    "h100-pcie": GPUSpec("h100-pcie", 756.0, 51.0, 2000, 80 * GiB, 5),
}

_ALIASES = [  # (regex on a normalised device name, catalogue key); first match wins
    (r"3090ti", "rtx3090ti"), (r"3090", "rtx3090"), (r"4090", "rtx4090"),
    (r"v100", "v100-16gb"), (r"a100.*80", "a100-80gb"), (r"a100", "a100-40gb"),
    (r"h100.*pcie", "h100-pcie"), (r"h100", "h100"), (r"h200", "h100"),
]


def lookup_gpu(name: str) -> GPUSpec | None:
    """The catalogue entry for a key (``rtx3090``) or a device name (``NVIDIA GeForce RTX 3090 Ti``)."""
    if name in GPU_CATALOGUE:
        return GPU_CATALOGUE[name]
    norm = re.sub(r"[^a-z0-9]", "", name.lower())
    for pattern, key in _ALIASES:
        if re.search(pattern, norm):
            return GPU_CATALOGUE[key]
    return None


def gpu_spec(value: str | dict | GPUSpec) -> GPUSpec:
    """A :class:`GPUSpec` from a catalogue name, a device name, or user-supplied figures.

    A dict may name a ``base`` catalogue entry and override any field, or give every field.
    """
    if isinstance(value, GPUSpec):
        return value
    if isinstance(value, str):
        spec = lookup_gpu(value)
        if spec is None:
            raise ConfigError(f"unknown GPU {value!r} for an estimated profile; known: {', '.join(GPU_CATALOGUE)} "
                              f"(or give figures: half_tflops, fp32_tflops, mem_GBps, memory_bytes, pcie_gen)")
        return spec
    fields = dict(value)
    base = fields.pop("base", None)
    try:
        if base is not None:
            return replace(gpu_spec(base), **fields)
        return GPUSpec(**fields)
    except TypeError as e:
        raise ConfigError(f"bad GPU figures {value!r}: {e}") from None
