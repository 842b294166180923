"""OPT (``OPTForCausalLM``) as an ordered list of units: embed, blocks, head.

Field names of :class:`OPTConfig` follow Hugging Face's ``config.json``. Layout variants handled:
pre-LayerNorm (125m, 1.3b and up) and post-LayerNorm (350m, ``do_layer_norm_before: false``, which
also has no final LayerNorm), and the 350m's narrower word embeddings (``word_embed_proj_dim``)
with ``project_in`` in the embedding unit and ``project_out`` in the head unit.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from mobius.errors import ConfigError
from mobius.models.base import ACTIVATIONS, ArchConfig, CausalLM, UnitSpec
from mobius.models.costs import embed_memory, head_memory, transformer_block_flops, transformer_block_memory
from mobius.models.packing import Documents, causal_attention, positions

POSITION_OFFSET = 2  # OPT's learned positions start at index 2 (a fairseq legacy)


@dataclass
class OPTConfig(ArchConfig):
    """Architecture of an OPT model (names as in Hugging Face's OPTConfig)."""

    vocab_size: int = 50272
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    ffn_dim: int = 3072
    max_position_embeddings: int = 2048
    do_layer_norm_before: bool = True
    word_embed_proj_dim: int | None = None  # None means hidden_size
    activation_function: str = "relu"
    dropout: float = 0.1
    attention_dropout: float = 0.0
    enable_bias: bool = True
    layer_norm_elementwise_affine: bool = True
    tie_word_embeddings: bool = True
    pad_token_id: int = 1
    bos_token_id: int = 2
    eos_token_id: int = 2

    family = "opt"
    LORA_TARGETS = {"q_proj": ("attn.q_proj",), "k_proj": ("attn.k_proj",), "v_proj": ("attn.v_proj",),
                    "out_proj": ("attn.out_proj",), "fc1": ("fc1",), "fc2": ("fc2",)}  # HF names -> our modules
    FIELDS = {"layers": "num_hidden_layers", "width": "hidden_size", "embedding": "word_embed_proj_dim",
              "positions": "max_position_embeddings"}
    ARCH_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "ffn_dim", "word_embed_proj_dim",
                   "do_layer_norm_before")  # what a checkpoint must share with a preset of its name
    POSITIVE_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "ffn_dim",
                       "max_position_embeddings", "word_embed_proj_dim")
    DROPOUT_FIELDS = ("dropout", "attention_dropout")
    TIED = ("embed.embed_tokens.weight", "head.lm_head.weight")

    def __post_init__(self) -> None:
        if self.word_embed_proj_dim is None:
            self.word_embed_proj_dim = self.hidden_size
        super().__post_init__()
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"opt config: hidden_size ({self.hidden_size}) must be divisible by "
                              f"num_attention_heads ({self.num_attention_heads})")
        if self.activation_function not in ACTIVATIONS:
            raise ConfigError(f"opt config: activation_function {self.activation_function!r} is not one of "
                              f"{sorted(ACTIVATIONS)}")
        if not self.layer_norm_elementwise_affine:
            raise ConfigError("opt config: layer_norm_elementwise_affine=false is not supported")

    @property
    def projects(self) -> bool:
        """True for the 350m layout, whose word embeddings are narrower than the hidden size."""
        return self.word_embed_proj_dim != self.hidden_size

    @property
    def has_final_layer_norm(self) -> bool:
        return self.do_layer_norm_before


class OPTEmbedding(nn.Module):
    """Token embeddings (+ project_in) + learned positions. input_ids [B, T] -> hidden [B, T, H]."""

    def __init__(self, cfg: OPTConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.word_embed_proj_dim)
        self.embed_positions = nn.Embedding(cfg.max_position_embeddings + POSITION_OFFSET, cfg.hidden_size)
        self.project_in = nn.Linear(cfg.word_embed_proj_dim, cfg.hidden_size, bias=False) if cfg.projects else None
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, input_ids: torch.Tensor, docs: Documents | None = None) -> torch.Tensor:
        T = input_ids.shape[1]
        if T + POSITION_OFFSET > self.embed_positions.num_embeddings:
            raise ValueError(f"sequence length {T} exceeds the model's "
                             f"{self.embed_positions.num_embeddings - POSITION_OFFSET} positions")
        x = self.embed_tokens(input_ids)  # [B, T, E]
        if self.project_in is not None:
            x = self.project_in(x)  # [B, T, H]
        pos = positions(docs, T, input_ids.device) + POSITION_OFFSET  # [T], or [B, T] restarting at each document
        return self.drop(x + self.embed_positions(pos))


class OPTAttention(nn.Module):
    def __init__(self, cfg: OPTConfig):
        super().__init__()
        H, bias = cfg.hidden_size, cfg.enable_bias
        self.n_head = cfg.num_attention_heads
        self.q_proj = nn.Linear(H, H, bias=bias)
        self.k_proj = nn.Linear(H, H, bias=bias)
        self.v_proj = nn.Linear(H, H, bias=bias)
        self.out_proj = nn.Linear(H, H, bias=bias)
        self.attn_pdrop = cfg.attention_dropout

    def forward(self, x: torch.Tensor, docs: Documents | None = None) -> torch.Tensor:
        B, T, C = x.shape
        shape = (B, T, self.n_head, C // self.n_head)
        q = self.q_proj(x).view(shape).transpose(1, 2)  # [B, nh, T, hd]
        k = self.k_proj(x).view(shape).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        p = self.attn_pdrop if self.training else 0.0
        y = causal_attention(q, k, v, docs, p)  # [B, nh, T, hd]
        return self.out_proj(y.transpose(1, 2).reshape(B, T, C))


class OPTBlock(nn.Module):
    """OPT decoder layer, pre- or post-LayerNorm. hidden [B, T, H] -> hidden [B, T, H]."""

    def __init__(self, cfg: OPTConfig):
        super().__init__()
        self.pre_norm = cfg.do_layer_norm_before
        self.ln_1 = nn.LayerNorm(cfg.hidden_size)
        self.attn = OPTAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.hidden_size)
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.ffn_dim, bias=cfg.enable_bias)
        self.fc2 = nn.Linear(cfg.ffn_dim, cfg.hidden_size, bias=cfg.enable_bias)
        self.act = ACTIVATIONS[cfg.activation_function]
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, docs: Documents | None = None) -> torch.Tensor:
        if self.pre_norm:
            x = x + self.drop(self.attn(self.ln_1(x), docs))
            return x + self.drop(self.fc2(self.act(self.fc1(self.ln_2(x)))))
        x = self.ln_1(x + self.drop(self.attn(x, docs)))
        return self.ln_2(x + self.drop(self.fc2(self.act(self.fc1(x)))))


class OPTHead(nn.Module):
    """Final LayerNorm (pre-LN layouts), project_out (350m), vocabulary projection.
    hidden [B, T, H] -> logits [B, T, V]."""

    def __init__(self, cfg: OPTConfig):
        super().__init__()
        self.final_layer_norm = nn.LayerNorm(cfg.hidden_size) if cfg.has_final_layer_norm else None
        self.project_out = nn.Linear(cfg.hidden_size, cfg.word_embed_proj_dim, bias=False) if cfg.projects else None
        self.lm_head = nn.Linear(cfg.word_embed_proj_dim, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor, docs: Documents | None = None) -> torch.Tensor:
        if self.final_layer_norm is not None:
            x = self.final_layer_norm(x)
        if self.project_out is not None:
            x = self.project_out(x)  # [B, T, E]
        return self.lm_head(x)  # [B, T, V]


class OPT(CausalLM):
    """OPT language model; the head's projection is tied to ``embed.embed_tokens`` by default."""

    INIT_STD = 0.02  # N(0, 0.02) weights (metaseq's init_std), zero biases, unit norms


def unit_specs(cfg: OPTConfig) -> list[UnitSpec]:
    """Describe every unit of an OPT model without building it."""
    H, V, E, F_ = cfg.hidden_size, cfg.vocab_size, cfg.word_embed_proj_dim, cfg.ffn_dim
    bias = 1 if cfg.enable_bias else 0
    block_params = 4 * H * H + 2 * H * F_ + bias * (4 * H + F_ + H) + 4 * H
    proj = E * H if cfg.projects else 0
    shape = f"opt:h{H}:f{F_}:nh{cfg.num_attention_heads}:v{V}:e{E}:p{cfg.max_position_embeddings}:" \
            f"{'pre' if cfg.do_layer_norm_before else 'post'}:{cfg.activation_function}"
    common = dict(hidden_size=H, vocab_size=V, out_numel=lambda b, s: b * s * H)
    specs = [UnitSpec(name="embed", kind="embed", signature=f"{shape}:embed",
                      param_count=V * E + (cfg.max_position_embeddings + POSITION_OFFSET) * H + proj,
                      build=lambda: OPTEmbedding(cfg), fwd_flops=lambda b, s, doc=None: 2.0 * b * s * (H + proj),
                      memory=partial(embed_memory, H), **common)]
    for i in range(cfg.num_hidden_layers):
        specs.append(UnitSpec(name=f"block.{i}", kind="block", signature=f"{shape}:block", param_count=block_params,
                              build=partial(OPTBlock, cfg),
                              fwd_flops=lambda b, s, doc=None: transformer_block_flops(b, s, H, F_, doc),
                              memory=partial(transformer_block_memory, H, F_), **common))
    specs.append(UnitSpec(
        name="head", kind="head", signature=f"{shape}:head",
        param_count=V * E + proj + (2 * H if cfg.has_final_layer_norm else 0), build=lambda: OPTHead(cfg),
        fwd_flops=lambda b, s, doc=None: 2.0 * b * s * (E * V + proj), memory=partial(head_memory, H, V), hidden_size=H,
        vocab_size=V,
        out_numel=lambda b, s: b * s * V))
    return specs


def _opt(h: int, layers: int, heads: int, **kw) -> OPTConfig:
    return OPTConfig(hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads, ffn_dim=4 * h, **kw)


PRESETS: dict[str, OPTConfig] = {
    "opt-125m": _opt(768, 12, 12),
    "opt-350m": _opt(1024, 24, 16, word_embed_proj_dim=512, do_layer_norm_before=False),
    "opt-1.3b": _opt(2048, 24, 32),
    "opt-2.7b": _opt(2560, 32, 32),
    "opt-6.7b": _opt(4096, 32, 32),
    "opt-13b": _opt(5120, 40, 40),
    "opt-30b": _opt(7168, 48, 56),
    "opt-66b": _opt(9216, 64, 72),
}
