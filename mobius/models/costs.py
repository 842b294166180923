"""Analytic costs of the units that more than one family shares: FLOPs and activation bytes of one
forward call, as the unit descriptions (:class:`~mobius.models.base.UnitSpec`) report them."""

from __future__ import annotations

from mobius.models.packing import attended_pairs


def embed_memory(hidden: int, batch: int, seq: int, elem: int) -> tuple[int, int]:
    """(saved, working) bytes of an embedding's forward: the int64 token ids; the output twice over."""
    tokens = batch * seq
    return tokens * 8, 2 * tokens * hidden * elem


def head_memory(hidden: int, vocab: int, batch: int, seq: int, elem: int) -> tuple[int, int]:
    """(saved, working) bytes of a head's forward and loss: the final norm's output and the loss's fp32
    log-softmax [B, T, V] saved; the fp32 logits and their gradient at once."""
    tokens = batch * seq
    return tokens * (hidden * elem + vocab * 4), 2 * tokens * vocab * 4


def transformer_block_flops(batch: int, seq: int, hidden: int, ffn: int, doc: int | None = None) -> float:
    """Forward FLOPs of one GPT-2/OPT block: QKV/out projections, MLP, causal attention (half of T x T, or of
    each document's square in rows packed with documents of ``doc`` tokens)."""
    tokens = batch * seq
    matmuls = 2.0 * tokens * (4 * hidden * hidden + 2 * hidden * ffn)
    attention = 2.0 * batch * attended_pairs(seq, doc) * hidden  # QK^T and AV, each 2*B*T*T*H, halved by causality
    return matmuls + attention


def transformer_block_memory(hidden: int, ffn: int, batch: int, seq: int, elem: int) -> tuple[int, int]:
    """(saved, working) bytes of one GPT-2/OPT block's forward: norm inputs and outputs, q, k, v, the
    attention output, the MLP's hidden layer before and after its activation; the widest pair of transients."""
    tokens = batch * seq
    return tokens * (8 * hidden + 2 * ffn) * elem, tokens * (2 * max(ffn, 3 * hidden) + 2 * hidden) * elem
