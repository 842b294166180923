"""Qwen3-MoE (``Qwen3MoeForCausalLM``) and Mixtral (``MixtralForCausalLM``): the Llama architecture with a
mixture of experts in place of the MLP, as an ordered list of units.

============  ===========================================================================
``qwen3_moe`` Qwen3's attention (per-head q/k RMSNorm, ``head_dim`` apart from hidden / heads); experts of
              ``moe_intermediate_size``; top-k of the router's softmax, renormalised when ``norm_topk_prob``;
              ``decoder_sparse_step`` / ``mlp_only_layers`` leave some layers a dense MLP of
              ``intermediate_size``
``mixtral``   Mistral's attention; experts of ``intermediate_size``; top-k of the softmax, always renormalised
============  ===========================================================================

Neither has shared experts. Attention, norms, rotary positions, the embedding and the head are
:mod:`mobius.models.llama`'s; the experts and the router's load balance are :mod:`mobius.models.experts`'. A
block's ``mlp`` is ``gate`` (the router, a bias-free linear layer) and ``experts`` (fused, as transformers holds
them in memory); Hugging Face's per-expert checkpoint layout is the key map's business (:mod:`mobius.models.hf`).
``router_jitter_noise`` (Mixtral's training-time noise on the router's input) is refused unless 0, as the
published checkpoints have it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn

from mobius.errors import ConfigError
from mobius.models import experts as moe
from mobius.models.base import CausalLM, UnitSpec
from mobius.models.costs import embed_memory
from mobius.models.llama import (LlamaAttention, LlamaConfig, LlamaEmbedding, LlamaHead, LlamaMLP, RMSNorm,
                                 block_flops, block_memory, block_param_count, rms_head_memory)
from mobius.models.packing import Documents

MOE_TYPES = ("qwen3_moe", "mixtral")
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass
class MoeConfig(LlamaConfig):
    """A Qwen3-MoE or Mixtral architecture (names as in Hugging Face's config.json)."""

    model_type: str = "qwen3_moe"
    num_experts: int = 128  # (Mixtral's config.json: num_local_experts)
    num_experts_per_tok: int = 8
    moe_intermediate_size: int | None = None  # qwen3_moe: each expert's width; None: intermediate_size (Mixtral)
    norm_topk_prob: bool = True  # the top-k weights renormalised to sum to 1 (Mixtral always)
    decoder_sparse_step: int = 1  # qwen3_moe: layer i has experts when (i + 1) % step == 0 ...
    mlp_only_layers: list[int] = field(default_factory=list)  # ... and i is not listed here
    router_aux_loss_coef: float = 0.001  # the load-balancing loss's weight in the training loss
    router_jitter_noise: float = 0.0  # mixtral: only 0

    TYPES = MOE_TYPES
    POSITIVE_FIELDS = (*LlamaConfig.POSITIVE_FIELDS, "num_experts", "num_experts_per_tok", "decoder_sparse_step")
    ARCH_FIELDS = (*LlamaConfig.ARCH_FIELDS, "num_experts", "num_experts_per_tok", "moe_intermediate_size")

    def __post_init__(self) -> None:
        super().__post_init__()
        where = f"{self.model_type} config"
        if self.num_experts_per_tok > self.num_experts:
            raise ConfigError(f"{where}: num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_experts "
                              f"({self.num_experts})")
        if self.model_type == "mixtral":
            self.moe_intermediate_size, self.norm_topk_prob = None, True
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ConfigError(f"{where}: mlp_only_layers entry {bad[0]} is not a layer (0 to "
                              f"{self.num_hidden_layers - 1})")
        if self.router_jitter_noise:
            raise ConfigError(f"{where}: router_jitter_noise={self.router_jitter_noise!r} is not supported (only 0)")
        if self.router_aux_loss_coef < 0:
            raise ConfigError(f"{where}: router_aux_loss_coef must be >= 0, got {self.router_aux_loss_coef}")

    @property
    def qk_norm(self) -> bool:
        return self.model_type == "qwen3_moe"

    @property
    def attention_window(self) -> int | None:
        if self.model_type == "mixtral":
            return self.sliding_window
        return self.sliding_window if self.use_sliding_window else None

    @property
    def expert_size(self) -> int:
        """Each expert's intermediate width."""
        return self.moe_intermediate_size or self.intermediate_size

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The layers with experts (the rest have a dense MLP), as transformers decides."""
        return tuple(i for i in range(self.num_hidden_layers)
                     if i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0)

    @property
    def expert_shape(self) -> moe.ExpertShape:
        return moe.ExpertShape(self.num_experts, self.hidden_size, self.expert_size)

    # LoRA targets by Hugging Face name: the experts' projections (their fused parameters) and the router
    @property
    def LORA_TARGETS(self) -> dict[str, tuple[str, ...]]:  # noqa: N802 (the class attribute every family has)
        up, gate, down = ("w3", "w1", "w2") if self.model_type == "mixtral" else ("up_proj", "gate_proj", "down_proj")
        return {**{p: (f"self_attn.{p}",) for p in ATTENTION}, gate: ("mlp.experts.gate_up_proj",),
                up: ("mlp.experts.gate_up_proj",), down: ("mlp.experts.down_proj",),
                "gate_up_proj": ("mlp.experts.gate_up_proj",), "gate": ("mlp.gate",)}

    @property
    def LORA_FUSED(self) -> dict[str, tuple[str, ...]]:  # noqa: N802
        """Fused parameters and the Hugging Face names they fuse: targeted through those names (PEFT's conversion
        of transformers 4 targets), their adapters have the rank and alpha times the count."""
        return {"mlp.experts.gate_up_proj": ("w1", "w3") if self.model_type == "mixtral" else ("gate_proj", "up_proj")}

    LORA_ALL_LINEAR_SKIPS = ("gate_up_proj",)  # all-linear: PEFT's resolution (transformers 4 names, fused ones)
    ROUTERS = ("mlp.gate",)  # the router's module in a block (lora.train: router)


# ---------------------------------------------------------------------------------------------
# Units
# ---------------------------------------------------------------------------------------------
class SparseMoe(nn.Module):
    """Router and experts. hidden [B, T, H] -> [B, T, H]; the routing goes to the open router log."""

    def __init__(self, cfg: MoeConfig, layer: int):
        super().__init__()
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = moe.Experts(cfg.expert_shape)
        self.layer, self.top_k = layer, cfg.num_experts_per_tok
        self.norm_topk, self.float_weights = cfg.norm_topk_prob, cfg.model_type == "mixtral"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, H = x.shape
        flat = x.reshape(B * T, H)
        logits = self.gate(flat)  # [N, E]
        routing = moe.route(logits, self.top_k, "softmax_topk", self.norm_topk, self.float_weights)
        moe.note(self.layer, routing)
        return self.experts(flat, routing).view(B, T, H)


class MoeBlock(nn.Module):
    """Pre-RMSNorm decoder layer with experts (or, in ``mlp_only_layers``, a dense SwiGLU). [B, T, H] -> same."""

    def __init__(self, cfg: MoeConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SparseMoe(cfg, layer) if layer in cfg.moe_layers else LlamaMLP(cfg)

    def forward(self, x: torch.Tensor, docs: Documents | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), docs)
        return x + self.mlp(self.post_attention_layernorm(x))


class MoeLM(CausalLM):
    """A Qwen3-MoE or Mixtral language model."""

    INIT_STD = 0.02


# ---------------------------------------------------------------------------------------------
# Unit descriptions: an MoE block's bytes are all its experts, its FLOPs the k it routes each token to
# ---------------------------------------------------------------------------------------------
def moe_param_count(cfg: MoeConfig, layer: int) -> int:
    """Parameters of block ``layer``: attention and norms as Llama's, then all experts and the router (or the
    dense MLP)."""
    dense = block_param_count(cfg)
    if layer not in cfg.moe_layers:
        return dense
    H, I_ = cfg.hidden_size, cfg.expert_size
    return dense - 3 * H * cfg.intermediate_size + cfg.num_experts * (3 * H * I_ + H)


def active_param_count(cfg: MoeConfig, layer: int) -> int:
    """Parameters one token computes with in block ``layer``: k experts of the E, the router whole."""
    total = moe_param_count(cfg, layer)
    if layer not in cfg.moe_layers:
        return total
    return total - (cfg.num_experts - cfg.num_experts_per_tok) * 3 * cfg.hidden_size * cfg.expert_size


def active_params(cfg: MoeConfig) -> int:
    """Parameters one token computes with in the whole model (embedding and head included, as Qwen's and Mistral's
    model cards count them; a tied embedding once)."""
    embed_head = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2) + cfg.hidden_size
    return embed_head + sum(active_param_count(cfg, i) for i in range(cfg.num_hidden_layers))


def moe_flops(cfg: MoeConfig, layer: int, batch: int, seq: int, doc: int | None = None) -> float:
    """Forward FLOPs of block ``layer``: Llama's attention; the router and the k experts each token reaches
    (routing evenly spread or not, the total is the same: every token computes k experts)."""
    flops = block_flops(cfg, batch, seq, doc)
    if layer not in cfg.moe_layers:
        return flops
    H, tokens = cfg.hidden_size, batch * seq
    dense_mlp = 2.0 * tokens * 3 * H * cfg.intermediate_size
    experts = 2.0 * tokens * cfg.num_experts_per_tok * 3 * H * cfg.expert_size
    return flops - dense_mlp + experts + 2.0 * tokens * H * cfg.num_experts


def moe_memory(cfg: MoeConfig, layer: int, batch: int, seq: int, elem: int) -> tuple[int, int]:
    """(saved, working) bytes of block ``layer``'s forward: Llama's attention and norms; per token the router's fp32
    softmax [E], its top-k (indices, fp32 values, their sum) and the sort's indices; per chosen expert the gathered
    input, the gate_up output, the SiLU's output, the down projection's input and output and one more [H] (the
    weighted output's factors), and the gathered weight. (Checked against autograd's saved tensors on the CPU.)"""
    saved, work = block_memory(cfg, batch, seq, elem)
    if layer not in cfg.moe_layers:
        return saved, work
    H, I_, k, E, tokens = cfg.hidden_size, cfg.expert_size, cfg.num_experts_per_tok, cfg.num_experts, batch * seq
    saved -= tokens * elem * 4 * cfg.intermediate_size  # Llama's dense SwiGLU
    saved += tokens * (k * elem * (3 * H + 4 * I_ + 1) + 4 * E + 28 * k + 4)
    work = max(work, tokens * k * elem * (2 * H + 4 * I_))
    return saved, work


def unit_specs(cfg: MoeConfig) -> list[UnitSpec]:
    """Describe every unit of a Qwen3-MoE or Mixtral model without building it."""
    H, V = cfg.hidden_size, cfg.vocab_size
    shape = (f"{cfg.model_type}:h{H}:f{cfg.intermediate_size}:e{cfg.num_experts}x{cfg.expert_size}"
             f"k{cfg.num_experts_per_tok}:nh{cfg.num_attention_heads}:kv{cfg.num_key_value_heads}:hd{cfg.head_dim}"
             f":v{V}:b{int(cfg.attention_bias)}:t{int(cfg.norm_topk_prob)}")
    common = dict(hidden_size=H, vocab_size=V, out_numel=lambda b, s: b * s * H)
    specs = [UnitSpec(name="embed", kind="embed", signature=f"{shape}:embed", param_count=V * H,
                      build=lambda: LlamaEmbedding(cfg), fwd_flops=lambda b, s, doc=None: 2.0 * b * s * H,
                      memory=partial(embed_memory, H), **common)]
    for i in range(cfg.num_hidden_layers):
        kind = "moe" if i in cfg.moe_layers else "dense"
        specs.append(UnitSpec(name=f"block.{i}", kind="block", signature=f"{shape}:{kind}-block",
                              param_count=moe_param_count(cfg, i), build=partial(MoeBlock, cfg, i),
                              fwd_flops=partial(moe_flops, cfg, i), memory=partial(moe_memory, cfg, i), **common))
    specs.append(UnitSpec(name="head", kind="head", signature=f"{shape}:head", param_count=V * H + H,
                          build=lambda: LlamaHead(cfg), fwd_flops=lambda b, s, doc=None: 2.0 * b * s * H * V,
                          memory=partial(rms_head_memory, H, V), hidden_size=H, vocab_size=V,
                          out_numel=lambda b, s: b * s * V))
    return specs


# ---------------------------------------------------------------------------------------------
# Presets: the published architectures (total and active parameter counts checked in the tests)
# ---------------------------------------------------------------------------------------------
def _qwen3_moe(h: int, f: int, moe_f: int, layers: int, heads: int) -> MoeConfig:
    return MoeConfig(model_type="qwen3_moe", vocab_size=151936, hidden_size=h, intermediate_size=f,
                     moe_intermediate_size=moe_f, num_hidden_layers=layers, num_attention_heads=heads,
                     num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                     max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                     bos_token_id=151643, eos_token_id=151645)


def _mixtral(h: int, f: int, layers: int, heads: int, vocab: int, positions: int) -> MoeConfig:
    return MoeConfig(model_type="mixtral", vocab_size=vocab, hidden_size=h, intermediate_size=f,
                     num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=8, num_experts=8,
                     num_experts_per_tok=2, max_position_embeddings=positions, rms_norm_eps=1e-5,
                     rope_theta=1000000.0, bos_token_id=1, eos_token_id=2)


PRESETS: dict[str, MoeConfig] = {
    "qwen3-30b-a3b": _qwen3_moe(2048, 6144, 768, 48, 32),  # 30.5B total, 3.3B active
    "qwen3-235b-a22b": _qwen3_moe(4096, 12288, 1536, 94, 64),  # 235B total, 22B active
    "mixtral-8x7b": _mixtral(4096, 14336, 32, 32, 32000, 32768),  # 46.7B total, 12.9B active
    "mixtral-8x22b": _mixtral(6144, 16384, 56, 48, 32768, 65536),  # 141B total, 39B active
}
PUBLISHED = {  # (total, active) parameters as their model cards give them
    "qwen3-30b-a3b": (30.5e9, 3.3e9), "qwen3-235b-a22b": (235e9, 22e9),
    "mixtral-8x7b": (46.7e9, 12.9e9), "mixtral-8x22b": (141e9, 39e9),
}
