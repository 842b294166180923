"""GPT-2 (``GPT2LMHeadModel``) as an ordered list of units: embed, blocks, head.

Field names of :class:`GPT2Config` follow Hugging Face's ``config.json`` so that checkpoint
configs map one to one. Differences from transformers' implementation, all numerically
equivalent: ``nn.Linear`` instead of ``Conv1D`` (weights are transposed on load, see
``mobius.models.hf``), attention through ``F.scaled_dot_product_attention`` (within each document of a
packed row: :mod:`mobius.models.packing`).
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


@dataclass
class GPT2Config(ArchConfig):
    """Architecture of a GPT-2 model (names as in Hugging Face's GPT2Config)."""

    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_inner: int | None = None  # MLP width; None means 4 * n_embd
    activation_function: str = "gelu_new"
    layer_norm_epsilon: float = 1e-5
    resid_pdrop: float = 0.1
    embd_pdrop: float = 0.1
    attn_pdrop: float = 0.1
    scale_attn_by_inverse_layer_idx: bool = False
    tie_word_embeddings: bool = True
    bos_token_id: int = 50256
    eos_token_id: int = 50256

    family = "gpt2"
    LORA_TARGETS = {"c_attn": ("attn.qkv",), "c_proj": ("attn.proj", "mlp.proj"), "c_fc": ("mlp.fc",)}  # HF names
    FIELDS = {"layers": "n_layer", "width": "n_embd", "embedding": "n_embd", "positions": "n_positions"}
    ARCH_FIELDS = ("n_embd", "n_layer", "n_head", "n_inner")  # what a checkpoint must share with a preset of its name
    POSITIVE_FIELDS = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head")
    DROPOUT_FIELDS = ("resid_pdrop", "embd_pdrop", "attn_pdrop")
    TIED = ("embed.wte.weight", "head.lm_head.weight")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_embd % self.n_head:
            raise ConfigError(f"gpt2 config: n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.activation_function not in ACTIVATIONS:
            raise ConfigError(
                f"gpt2 config: activation_function {self.activation_function!r} is not one of {sorted(ACTIVATIONS)}"
            )

    @property
    def ffn_dim(self) -> int:
        return self.n_inner or 4 * self.n_embd


class GPT2Embedding(nn.Module):
    """Token + learned position embeddings. input_ids [B, T] -> hidden [B, T, H]."""

    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.n_positions, cfg.n_embd)
        self.drop = nn.Dropout(cfg.embd_pdrop)

    def forward(self, input_ids: torch.Tensor, docs: Documents | None = None) -> torch.Tensor:
        T = input_ids.shape[1]
        if T > self.wpe.num_embeddings:
            raise ValueError(f"sequence length {T} exceeds the model's {self.wpe.num_embeddings} positions")
        pos = positions(docs, T, input_ids.device)  # [T], or [B, T] restarting at each document
        return self.drop(self.wte(input_ids) + self.wpe(pos))  # [B, T, H]


class GPT2Attention(nn.Module):
    def __init__(self, cfg: GPT2Config, layer_idx: int):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.attn_pdrop = cfg.attn_pdrop
        self.resid_drop = nn.Dropout(cfg.resid_pdrop)
        head_dim = cfg.n_embd // cfg.n_head
        self.scale = head_dim**-0.5 / (layer_idx + 1 if cfg.scale_attn_by_inverse_layer_idx else 1)

    def forward(self, x: torch.Tensor, docs: Documents | None = None) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)  # 3 x [B, nh, T, hd]
        p = self.attn_pdrop if self.training else 0.0
        y = causal_attention(q, k, v, docs, p, scale=self.scale)  # [B, nh, T, hd]
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(B, T, C)))


class GPT2MLP(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, cfg.ffn_dim)
        self.proj = nn.Linear(cfg.ffn_dim, cfg.n_embd)
        self.act = ACTIVATIONS[cfg.activation_function]
        self.drop = nn.Dropout(cfg.resid_pdrop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(self.act(self.fc(x))))


class GPT2Block(nn.Module):
    """Pre-LayerNorm transformer block. hidden [B, T, H] -> hidden [B, T, H]."""

    def __init__(self, cfg: GPT2Config, layer_idx: int = 0):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.attn = GPT2Attention(cfg, layer_idx)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.mlp = GPT2MLP(cfg)

    def forward(self, x: torch.Tensor, docs: Documents | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), docs)
        return x + self.mlp(self.ln_2(x))


class GPT2Head(nn.Module):
    """Final LayerNorm and vocabulary projection. hidden [B, T, H] -> logits [B, T, V]."""

    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor, docs: Documents | None = None) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


class GPT2(CausalLM):
    """GPT-2 language model. With ``tie_word_embeddings`` the head's projection *is* ``embed.wte``'s
    weight (one Parameter); a pipeline that separates them keeps a copy per end and sums gradients."""

    RESIDUAL_SUFFIXES = ("attn.proj.weight", "mlp.proj.weight")  # GPT-2's N(0, 0.02 / sqrt(2 * n_layer))


def unit_specs(cfg: GPT2Config) -> list[UnitSpec]:
    """Describe every unit of a GPT-2 model without building it."""
    H, V, F_ = cfg.n_embd, cfg.vocab_size, cfg.ffn_dim
    block_params = 4 * H * H + 4 * H + 2 * H * F_ + F_ + H + 4 * H
    common = dict(hidden_size=H, vocab_size=V, out_numel=lambda b, s: b * s * H)
    shape = f"gpt2:h{H}:f{F_}:nh{cfg.n_head}:v{V}:p{cfg.n_positions}:{cfg.activation_function}"
    specs = [UnitSpec(name="embed", kind="embed", signature=f"{shape}:embed", param_count=V * H + cfg.n_positions * H,
                      build=lambda: GPT2Embedding(cfg), fwd_flops=lambda b, s, doc=None: 2.0 * b * s * H,
                      memory=partial(embed_memory, H), **common)]
    for i in range(cfg.n_layer):
        specs.append(UnitSpec(
            name=f"block.{i}", kind="block", signature=f"{shape}:block", param_count=block_params,
            build=partial(GPT2Block, cfg, i), fwd_flops=lambda b, s, doc=None: transformer_block_flops(b, s, H, F_, doc),
            memory=partial(transformer_block_memory, H, F_), **common))
    specs.append(UnitSpec(
        name="head", kind="head", signature=f"{shape}:head", param_count=V * H + 2 * H, build=lambda: GPT2Head(cfg),
        fwd_flops=lambda b, s, doc=None: 2.0 * b * s * H * V, memory=partial(head_memory, H, V), hidden_size=H, vocab_size=V,
        out_numel=lambda b, s: b * s * V))
    return specs


PRESETS: dict[str, GPT2Config] = {
    "gpt2": GPT2Config(),
    "gpt2-medium": GPT2Config(n_embd=1024, n_layer=24, n_head=16),
    "gpt2-large": GPT2Config(n_embd=1280, n_layer=36, n_head=20),
    "gpt2-xl": GPT2Config(n_embd=1600, n_layer=48, n_head=25),
    # the GPU benchmark's model (bench/pipeline_bench.py): hidden 2048, 24 layers, 16 heads, untied head -> 1.42B
    "gpt-1.4b": GPT2Config(vocab_size=50304, n_embd=2048, n_layer=24, n_head=16, activation_function="gelu",
                           tie_word_embeddings=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    # the zero benchmark's larger model (Elixir's GPT2-4b): hidden 3072, 32 layers, 24 heads, untied head -> 3.94B
    "gpt-3.9b": GPT2Config(vocab_size=50304, n_embd=3072, n_layer=32, n_head=24, activation_function="gelu",
                           tie_word_embeddings=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    # a tiny model for the CPU demo and tests
    "gpt2-tiny": GPT2Config(n_positions=256, n_embd=128, n_layer=4, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
                            attn_pdrop=0.0),
}
