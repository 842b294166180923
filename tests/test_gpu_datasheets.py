"""The GPU catalogue's rates and the estimated profile, against published per-layer times."""

from __future__ import annotations

import dataclasses

import pytest

from mobius.models import get_preset, unit_specs
from partition.estimate import estimate_units
from partition.gpus import GPU_CATALOGUE, gpu_spec

# RoundPipe's artifact (ITcarrot/RoundPipe-artifact, pp-simulate/run.sh), measured by its
# roundpipe-timing/train.py on an RTX 4090: Llama-3.1-8B, micro-batches of 4 x 2048 tokens, fp16 with
# torch.backends.cuda.matmul.allow_fp16_accumulation (FP16 accumulation), flash attention, the head's
# loss computed chunk by chunk without keeping the logits; ms per micro-batch, backward without the
# recompute (its simulator adds that as a forward)
ROUNDPIPE_4090 = {"block": (18.5037, 41.2066), "head": (37.2255, 74.501)}


def test_every_gpu_has_tensor_rates_at_least_its_shader_rate() -> None:
    for spec in GPU_CATALOGUE.values():
        assert spec.half_tflops >= 2 * spec.fp32_tflops * 0.99 or spec.name.startswith(("v100", "a100", "h100"))
        assert spec.tflops("fp16", "fp16") >= spec.tflops("bf16", "fp16") == spec.half_tflops
    assert gpu_spec("rtx3090").half_tflops == 71.0 and gpu_spec("rtx4090").half_tflops == 165.2


def test_the_4090_estimate_is_within_25_percent_of_roundpipes_layer_times() -> None:
    """The estimate in RoundPipe's setting (FP16 accumulation, its fused chunked loss: a head whose
    logits are never kept) against its published times: a block (218M parameters, 3.7 TFLOP forward)
    and the head (525M parameters)."""
    specs = unit_specs(get_preset("llama-3.1-8b"))
    head = specs[-1]
    fused = dataclasses.replace(head, out_numel=lambda b, s: b * s * head.hidden_size,
                                memory=lambda b, s, e: (b * s * (4 + e) * head.hidden_size, 0))
    prof = estimate_units([specs[1], fused], 4, 2048, "fp16", "rtx4090", accumulate="fp16", loss_bytes_per_logit=0)
    block, estimated_head = prof.units
    assert block.param_count == pytest.approx(218e6, rel=0.001)
    for unit, (fwd_ms, bwd_ms) in ((block, ROUNDPIPE_4090["block"]), (estimated_head, ROUNDPIPE_4090["head"])):
        assert unit.fwd_s * 1e3 == pytest.approx(fwd_ms, rel=0.25)
        assert (unit.bwd_s - unit.fwd_s) * 1e3 == pytest.approx(bwd_ms, rel=0.25)  # ours includes the recompute


def test_mobius_runs_fp32_accumulation_at_half_a_geforce_cards_fp16_accumulate_rate() -> None:
    """What mobius runs on a 4090 (FP32 accumulation; the fp32 loss over kept logits) is about twice
    RoundPipe's block forward."""
    specs = unit_specs(get_preset("llama-3.1-8b"))
    ours = estimate_units([specs[1]], 4, 2048, "fp16", "rtx4090").units[0]
    theirs = estimate_units([specs[1]], 4, 2048, "fp16", "rtx4090", accumulate="fp16").units[0]
    assert 1.7 < ours.fwd_s / theirs.fwd_s < 2.0
