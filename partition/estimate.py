"""Unit costs without a GPU: FLOPs and bytes per unit against a :class:`~partition.gpus.GPUSpec`.

Matrix multiplies run at ``compute_efficiency`` of the datasheet rate (or weight reads at
``memory_efficiency`` of its bandwidth, whichever is slower), plus the element-wise passes over
activations at that bandwidth, plus kernel launches; backward = recompute + twice the matrix
multiplies (one, for the input gradients, where the weights are frozen) + the element-wise passes
once more. Activation memory is the family's own count
(``UnitSpec.memory``). The head's loss makes ``loss_bytes_per_logit`` of memory traffic per logit
(mobius's loss: fp32 logits, log-softmax and their gradient). Checked against measurements on an
H100 (OPT-13B and a 1.4B GPT, bf16, sequence 512-1024: blocks and heads within 25%) and against
RoundPipe's published per-layer times of Llama-3.1-8B on an RTX 4090 (fp16 with FP16 accumulation,
its fused chunked loss; ``tests/test_partition_profile.py``).
"""

from __future__ import annotations

from typing import Any, Sequence

from mobius.errors import ConfigError
from partition.costs import PRECISION_BYTES, ModelProfile, UnitCost
from partition.gpus import GPUSpec, gpu_spec

COMPUTE_EFFICIENCY = 0.6  # achievable share of datasheet tensor throughput for transformer blocks: at 0.55 the
# H100's datasheet profile predicted steps about 7% slower than its measured unit profile (docs/perf-gpu.md);
# RoundPipe's RTX 4090 layer times (3.7 TFLOP in 18.5 ms at a 330 TFLOP/s datasheet rate) imply ~0.6-0.7
MEMORY_EFFICIENCY = 0.8  # achievable share of datasheet memory bandwidth
LAUNCH_S = 8e-6  # per kernel launch
KERNELS = {"embed": 3, "block": 14, "head": 5}  # forward kernels per unit (backward: twice as many)
LOSS_BYTES_PER_LOGIT = 16  # mobius's loss (mobius.models.base.lm_loss): fp32 logits, log-softmax, their gradient


ACC_BYTES_PER_PARAM = 10  # fp32 sums += each micro-batch's half gradients (scheduler.stages.add_gradients): read 4 + 2, write 4


def precision_bytes(precision: str) -> int:
    if precision not in PRECISION_BYTES:
        raise ConfigError(f"precision must be one of {', '.join(PRECISION_BYTES)}, got {precision!r}")
    return PRECISION_BYTES[precision]


def estimate_units(specs: Sequence[Any], micro_batch_size: int, seq_len: int, precision: str,
                   gpu: str | dict | GPUSpec, compute_efficiency: float = COMPUTE_EFFICIENCY,
                   memory_efficiency: float = MEMORY_EFFICIENCY, accumulate: str = "fp32",
                   loss_bytes_per_logit: float = LOSS_BYTES_PER_LOGIT, doc_tokens: int | None = None) -> ModelProfile:
    """Analytic unit costs for ``gpu`` (a catalogue name, device name, figures, or a GPUSpec).
    ``accumulate``: the matrix multiplies' accumulation ("fp32", what mobius runs; "fp16" to compare
    with runs that allowed FP16 accumulation); ``loss_bytes_per_logit``: the loss's memory traffic;
    ``doc_tokens``: rows packed with documents of that many tokens (attention's FLOPs within each)."""
    spec = gpu_spec(gpu)
    rate = spec.tflops(precision, accumulate)
    units = [_estimate_unit(s, micro_batch_size, seq_len, precision, spec, rate * compute_efficiency,
                            memory_efficiency, loss_bytes_per_logit, doc_tokens) for s in specs]
    notes = {"gpu": spec.name, "compute_efficiency": compute_efficiency, "memory_efficiency": memory_efficiency,
             "tflops": rate, "mem_GBps": spec.mem_GBps}
    return ModelProfile(units, micro_batch_size, seq_len, precision, spec.name, "datasheet", 0.0, notes,
                        doc_tokens=doc_tokens)


def _estimate_unit(s: Any, mbs: int, seq: int, precision: str, gpu: GPUSpec, tflops: float, me: float,
                   loss_bytes: float, doc_tokens: int | None = None) -> UnitCost:
    elem = precision_bytes(precision)
    tokens = mbs * seq
    flops = float(s.fwd_flops(mbs, seq) if doc_tokens is None else s.fwd_flops(mbs, seq, doc_tokens))
    param_bytes = s.param_count * elem
    in_bytes = tokens * 8 if s.kind == "embed" else tokens * s.hidden_size * elem
    act_bytes = int(s.out_numel(mbs, seq)) * elem
    saved, work = s.memory(mbs, seq, elem)  # the family's count of saved and transient activations
    # matrix multiplies (compute- or weight-bound) run apart from the element-wise passes over
    # activations (norms, activations, softmax); the loss makes ``loss_bytes`` of traffic per logit
    elementwise = in_bytes + act_bytes + saved + (s.kind == "head") * tokens * s.vocab_size * loss_bytes
    bandwidth = gpu.mem_GBps * 1e9 * me
    matmul_s = max(flops / (tflops * 1e12), param_bytes / bandwidth)
    launches = KERNELS.get(s.kind, 10) * LAUNCH_S
    fwd = matmul_s + elementwise / bandwidth + launches
    trainable = s.param_count - s.frozen_count
    weight_grads = trainable / max(s.param_count, 1)  # frozen weights (LoRA) need input gradients only
    bwd = fwd + (1 + weight_grads) * matmul_s + elementwise / bandwidth + 2 * launches  # recompute, then backward
    acc = trainable * ACC_BYTES_PER_PARAM / bandwidth + 2 * LAUNCH_S if elem < 4 else 0.0
    return UnitCost(name=s.name, kind=s.kind, signature=s.signature, param_count=s.param_count, fwd_s=fwd,
                    bwd_s=bwd, param_bytes=param_bytes, grad_bytes=trainable * elem, in_bytes=in_bytes,
                    frozen_count=s.frozen_count,
                    act_bytes=act_bytes, saved_bytes=saved, work_bytes=work, acc_s=acc)
