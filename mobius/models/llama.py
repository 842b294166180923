"""The Llama architecture (``LlamaForCausalLM``) and its relatives as an ordered list of units.

One file serves four Hugging Face ``model_type`` values, which share the decoder layout (RMSNorm,
rotary positions, SwiGLU MLP, grouped-query attention) and differ in a few switches:

============  ===========================================================================
``llama``     Llama 2/3.x: ``attention_bias`` on q/k/v/o, ``mlp_bias``, ``rope_scaling``
              ``llama3`` (3.1/3.2) or ``linear``; 3.2's small models tie the embedding
``mistral``   Mistral: no biases; ``sliding_window`` (trains as full attention when the
              window covers the sequence)
``qwen2``     Qwen2 / 2.5: q/k/v always biased, o not; small models tie the embedding
``qwen3``     Qwen3: per-head RMSNorm of q and k (before the rotation), ``head_dim`` apart
              from hidden / heads, ``attention_bias`` on q/k/v/o
============  ===========================================================================

Field names of :class:`LlamaConfig` follow Hugging Face's ``config.json`` (``rope_theta`` and
``rope_scaling`` as transformers 4 writes them; :mod:`mobius.models.hf` also reads transformers
5's ``rope_parameters``). Units hold no buffers: the rotary tables are computed from the config
on the device of the activations (cached per device, dtype and length), so a unit built on the
meta device and bound to flat buffers (the pipeline, zero mode) needs nothing moved.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from functools import partial
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from mobius.errors import ConfigError
from mobius.models.base import ArchConfig, CausalLM, UnitSpec, check_positions
from mobius.models.costs import embed_memory, head_memory
from mobius.models.packing import Documents, attended_pairs, causal_attention

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
ROPE_TYPES = ("default", "linear", "llama3")
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass
class LlamaConfig(ArchConfig):
    """Architecture of a Llama-family model (names as in Hugging Face's config.json)."""

    model_type: str = "llama"
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None  # None: as many as query heads (no grouping)
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "linear" | "llama3", ...}; None: plain rotation
    attention_bias: bool = False  # llama, qwen3: biases on q, k, v and o
    mlp_bias: bool = False  # llama: biases on gate, up and down
    attention_dropout: float = 0.0
    sliding_window: int | None = None  # mistral; qwen2/3 only with use_sliding_window
    use_sliding_window: bool = False  # qwen2/3
    max_window_layers: int | None = None  # qwen2/3: layers from this index on use the window
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        where = f"{self.model_type} config"
        if self.model_type not in self.TYPES:
            raise ConfigError(f"{type(self).__name__}: model_type {self.model_type!r} is not one of "
                              f"{', '.join(self.TYPES)}")
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None and self.num_attention_heads > 0:
            self.head_dim = self.hidden_size // self.num_attention_heads
        super().__post_init__()
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"{where}: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                              f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"{where}: head_dim must be even for rotary positions, got {self.head_dim}")
        if self.hidden_act != "silu":
            raise ConfigError(f"{where}: hidden_act={self.hidden_act!r} is not supported (only 'silu')")
        if not (self.rms_norm_eps > 0 and self.rope_theta > 0):
            raise ConfigError(f"{where}: rms_norm_eps and rope_theta must be positive")
        self.rope_scaling = _check_rope_scaling(self.rope_scaling, where)
        if self.attention_bias and self.model_type in ("mistral", "qwen2"):
            raise ConfigError(f"{where}: attention_bias=True is not supported (a {self.model_type} model has no "
                              f"output-projection bias)")
        if self.mlp_bias and self.model_type != "llama":
            raise ConfigError(f"{where}: mlp_bias=True is not supported for {self.model_type}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ConfigError(f"{where}: sliding_window must be positive or null, got {self.sliding_window}")

    family = property(lambda self: self.model_type)
    TYPES: ClassVar[tuple[str, ...]] = MODEL_TYPES  # the model_type values this config class serves
    LORA_TARGETS = {**{p: (f"self_attn.{p}",) for p in ("q_proj", "k_proj", "v_proj", "o_proj")},
                    **{p: (f"mlp.{p}",) for p in ("gate_proj", "up_proj", "down_proj")}}  # HF names -> our modules
    FIELDS = {"layers": "num_hidden_layers", "width": "hidden_size", "embedding": "hidden_size",
              "positions": "max_position_embeddings"}
    ARCH_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                   "num_key_value_heads", "head_dim", "tie_word_embeddings")  # what a checkpoint shares with its preset
    POSITIVE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                       "num_key_value_heads", "head_dim", "max_position_embeddings")
    DROPOUT_FIELDS = ("attention_dropout",)
    TIED = ("embed.embed_tokens.weight", "head.lm_head.weight")

    @property
    def qkv_bias(self) -> bool:
        return self.attention_bias or self.model_type == "qwen2"

    @property
    def qk_norm(self) -> bool:
        return self.model_type == "qwen3"

    @property
    def attention_window(self) -> int | None:
        """The sliding window some layer applies, or None when every layer attends to all earlier tokens."""
        if self.model_type == "mistral":
            return self.sliding_window
        if self.model_type in ("qwen2", "qwen3") and self.use_sliding_window:
            first = self.max_window_layers if self.max_window_layers is not None else 0
            return self.sliding_window if first < self.num_hidden_layers else None
        return None

    def check_sequence(self, seq_len: int) -> None:
        """Refuse a training length above the position limit or the sliding window (mobius trains
        full causal attention, which equals the window's only when the window covers the sequence)."""
        check_positions(self, seq_len)
        window = self.attention_window
        if window is not None and window < seq_len:
            raise ConfigError(f"the checkpoint's sliding_window ({window}) is below data.seq_len ({seq_len}): "
                              f"mobius trains full attention only; set data.seq_len to at most {window}")


def _check_rope_scaling(rs: dict | None, where: str) -> dict | None:
    """The rotary scaling in one form ({"rope_type": ..., params}), None for the plain rotation."""
    if rs is None:
        return None
    if not isinstance(rs, dict):
        raise ConfigError(f"{where}: rope_scaling must be a mapping or null, got {rs!r}")
    rs = dict(rs)
    kind = rs.pop("type", None)
    kind = rs.setdefault("rope_type", kind or "default")
    if kind not in ROPE_TYPES:
        raise ConfigError(f"{where}: rope_scaling rope_type={kind!r} is not supported (supported: "
                          f"{', '.join(ROPE_TYPES)})")
    if kind == "default":
        return None
    keys = ("factor",) if kind == "linear" else LLAMA3_ROPE_KEYS
    for key in keys:
        value = rs.get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{where}: rope_scaling {kind} needs a positive {key}, got {value!r}")
    if kind == "llama3" and rs["high_freq_factor"] <= rs["low_freq_factor"]:
        raise ConfigError(f"{where}: rope_scaling llama3 needs high_freq_factor > low_freq_factor, got "
                          f"{rs['high_freq_factor']} and {rs['low_freq_factor']}")
    unknown = sorted(set(rs) - {"rope_type", *keys, "rope_theta"})
    if unknown:
        raise ConfigError(f"{where}: rope_scaling field {unknown[0]}={rs[unknown[0]]!r} is not supported")
    return rs


# ---------------------------------------------------------------------------------------------
# Rotary positions
# ---------------------------------------------------------------------------------------------
def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """The rotation's inverse frequencies [head_dim / 2] in fp32, with a checked ``rope_scaling``."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))  # [hd/2]
    if scaling is None:
        return inv
    if scaling["rope_type"] == "linear":
        return inv / scaling["factor"]
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / low, inv / factor, inv)  # long wavelengths slowed by the factor
    smooth = (old / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return torch.where(medium, blended, scaled)


def rotary_tables(cfg: LlamaConfig, seq: int, device: torch.device, dtype: torch.dtype,
                  docs: Documents | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, head_dim] for positions 0..seq-1 (computed in fp32, then cast to ``dtype``); with
    ``docs``, [B, 1, T, head_dim] for positions that start again at each document."""
    scaling = tuple(sorted(cfg.rope_scaling.items())) if cfg.rope_scaling else None
    cos, sin = _rotary_tables(cfg.head_dim, cfg.rope_theta, scaling, seq, device, dtype)
    if docs is None:
        return cos, sin
    pos = docs.positions  # [B, T]
    return cos[pos][:, None], sin[pos][:, None]


@functools.lru_cache(maxsize=16)
def _rotary_tables(head_dim: int, theta: float, scaling: tuple | None, seq: int, device: torch.device,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One table per rotation, length, device and dtype, shared by every layer (plain tensors, no grad)."""
    with torch.inference_mode(False), torch.no_grad():
        inv = inverse_frequencies(head_dim, theta, dict(scaling) if scaling else None).to(device)  # [hd/2]
        freqs = torch.arange(seq, device=device, dtype=torch.float32)[:, None] * inv[None, :]  # [T, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, hd]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, heads, T, hd] by the tables cos, sin [T, hd] (or [B, 1, T, hd])."""
    return x * cos + _rotate_half(x) * sin


# ---------------------------------------------------------------------------------------------
# Units
# ---------------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32, then scaled by a learned gain (as transformers does)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


class LlamaEmbedding(nn.Module):
    """Token embeddings (positions are rotations inside attention). input_ids [B, T] -> hidden [B, T, H]."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.max_positions = cfg.max_position_embeddings

    def forward(self, input_ids: torch.Tensor, docs: Documents | None = None) -> torch.Tensor:
        T = input_ids.shape[1]
        if T > self.max_positions:
            raise ValueError(f"sequence length {T} exceeds the model's {self.max_positions} positions")
        return self.embed_tokens(input_ids)  # [B, T, H]


class LlamaAttention(nn.Module):
    """Grouped-query causal attention with rotary positions (and Qwen3's per-head q/k norms)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        H, hd = cfg.hidden_size, cfg.head_dim
        self.cfg, self.n_head, self.n_kv = cfg, cfg.num_attention_heads, cfg.num_key_value_heads
        self.q_proj = nn.Linear(H, self.n_head * hd, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(H, self.n_kv * hd, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(H, self.n_kv * hd, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.n_head * hd, H, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, docs: Documents | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        hd = self.cfg.head_dim
        q = self.q_proj(x).view(B, T, self.n_head, hd)  # [B, T, nh, hd]
        k = self.k_proj(x).view(B, T, self.n_kv, hd)  # [B, T, nkv, hd]
        v = self.v_proj(x).view(B, T, self.n_kv, hd).transpose(1, 2)  # [B, nkv, T, hd]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rotary_tables(self.cfg, T, x.device, q.dtype, docs)
        q = apply_rotary(q.transpose(1, 2), cos, sin)  # [B, nh, T, hd]
        k = apply_rotary(k.transpose(1, 2), cos, sin)  # [B, nkv, T, hd]
        p = self.cfg.attention_dropout if self.training else 0.0
        y = causal_attention(q, k, v, docs, p, groups=self.n_head // self.n_kv)  # [B, nh, T, hd]
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_head * hd))


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        H, F_, bias = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = nn.Linear(H, F_, bias=bias)
        self.up_proj = nn.Linear(H, F_, bias=bias)
        self.down_proj = nn.Linear(F_, H, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # [B, T, F] inside


class LlamaBlock(nn.Module):
    """Pre-RMSNorm decoder layer. hidden [B, T, H] -> hidden [B, T, H]."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, x: torch.Tensor, docs: Documents | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), docs)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaHead(nn.Module):
    """Final RMSNorm and vocabulary projection. hidden [B, T, H] -> logits [B, T, V]."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor, docs: Documents | None = None) -> torch.Tensor:
        return self.lm_head(self.norm(x))


class Llama(CausalLM):
    """A Llama-family language model; the head's projection is the embedding when the config ties them."""

    INIT_STD = 0.02  # N(0, 0.02) matrices (transformers' initializer_range), zero biases, unit norms


# ---------------------------------------------------------------------------------------------
# Unit descriptions: parameters, FLOPs and activation memory without building anything
# ---------------------------------------------------------------------------------------------
def block_param_count(cfg: LlamaConfig) -> int:
    H, F_, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    attention = H * q + 2 * H * kv + q * H + cfg.qkv_bias * (q + 2 * kv) + cfg.attention_bias * H \
        + cfg.qk_norm * 2 * hd
    mlp = 3 * H * F_ + cfg.mlp_bias * (2 * F_ + H)
    return attention + mlp + 2 * H


def block_flops(cfg: LlamaConfig, batch: int, seq: int, doc: int | None = None) -> float:
    """Forward FLOPs of one layer: projections (GQA: k and v are narrower), SwiGLU, causal attention (within
    documents of ``doc`` tokens in packed rows)."""
    H, F_ = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    tokens = batch * seq
    matmuls = 2.0 * tokens * (H * (q + 2 * kv) + q * H + 3 * H * F_)
    attention = 2.0 * batch * attended_pairs(seq, doc) * q  # QK^T and AV over every query head, halved by causality
    return matmuls + attention


def block_memory(cfg: LlamaConfig, batch: int, seq: int, elem: int) -> tuple[int, int]:
    """(saved activation bytes, working bytes) of one layer's forward on one micro-batch. Saved, per
    token: each RMSNorm's fp32 input, its output and the gain's product (the projections' input); q
    and k after rotation, v, the attention output; the SwiGLU's gate, up, activation and product;
    Qwen3's q/k norms add fp32 copies of q and k and their outputs. (Checked against autograd's
    saved tensors on the CPU: within 1% in fp32, 5% in bf16.)"""
    H, F_ = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    tokens = batch * seq
    per_token = 2 * (4 * H + 2 * elem * H) + elem * (2 * q + 2 * kv) + elem * 4 * F_ \
        + cfg.qk_norm * (4 + elem) * (q + kv)
    work = tokens * (2 * max(2 * F_, q + 2 * kv) + 2 * H) * elem
    return tokens * per_token, work


def rms_head_memory(hidden: int, vocab: int, batch: int, seq: int, elem: int) -> tuple[int, int]:
    """(saved, working) bytes of the head: as :func:`head_memory`, plus the final RMSNorm's fp32
    input and the gain's product."""
    saved, work = head_memory(hidden, vocab, batch, seq, elem)
    return saved + batch * seq * (4 + elem) * hidden, work


def unit_specs(cfg: LlamaConfig) -> list[UnitSpec]:
    """Describe every unit of a Llama-family model without building it."""
    H, V = cfg.hidden_size, cfg.vocab_size
    shape = (f"{cfg.model_type}:h{H}:f{cfg.intermediate_size}:nh{cfg.num_attention_heads}:kv{cfg.num_key_value_heads}"
             f":hd{cfg.head_dim}:v{V}:b{int(cfg.qkv_bias)}{int(cfg.attention_bias)}{int(cfg.mlp_bias)}"
             f":n{int(cfg.qk_norm)}")
    common = dict(hidden_size=H, vocab_size=V, out_numel=lambda b, s: b * s * H)
    specs = [UnitSpec(name="embed", kind="embed", signature=f"{shape}:embed", param_count=V * H,
                      build=lambda: LlamaEmbedding(cfg), fwd_flops=lambda b, s, doc=None: 2.0 * b * s * H,
                      memory=partial(embed_memory, H), **common)]
    for i in range(cfg.num_hidden_layers):
        specs.append(UnitSpec(name=f"block.{i}", kind="block", signature=f"{shape}:block",
                              param_count=block_param_count(cfg), build=partial(LlamaBlock, cfg),
                              fwd_flops=partial(block_flops, cfg), memory=partial(block_memory, cfg), **common))
    specs.append(UnitSpec(name="head", kind="head", signature=f"{shape}:head", param_count=V * H + H,
                          build=lambda: LlamaHead(cfg), fwd_flops=lambda b, s, doc=None: 2.0 * b * s * H * V,
                          memory=partial(rms_head_memory, H, V), hidden_size=H, vocab_size=V,
                          out_numel=lambda b, s: b * s * V))
    return specs


# ---------------------------------------------------------------------------------------------
# Presets: the published architectures (parameter counts checked in the tests)
# ---------------------------------------------------------------------------------------------
_LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}


def _llama3(h: int, f: int, layers: int, heads: int, factor: float, tied: bool) -> LlamaConfig:
    return LlamaConfig(model_type="llama", vocab_size=128256, hidden_size=h, intermediate_size=f,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=8,
                       max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                       rope_scaling={**_LLAMA3_ROPE, "factor": factor}, tie_word_embeddings=tied,
                       bos_token_id=128000, eos_token_id=128001)


def _qwen25(h: int, f: int, layers: int, heads: int, kv: int, tied: bool, vocab: int = 152064) -> LlamaConfig:
    return LlamaConfig(model_type="qwen2", vocab_size=vocab, hidden_size=h, intermediate_size=f,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                       max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
                       tie_word_embeddings=tied, bos_token_id=151643, eos_token_id=151643)


def _qwen3(h: int, f: int, layers: int, heads: int, tied: bool) -> LlamaConfig:
    return LlamaConfig(model_type="qwen3", vocab_size=151936, hidden_size=h, intermediate_size=f,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=8, head_dim=128,
                       max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                       tie_word_embeddings=tied, bos_token_id=151643, eos_token_id=151643)


PRESETS: dict[str, LlamaConfig] = {
    "llama-3.2-1b": _llama3(2048, 8192, 16, 32, 32.0, tied=True),
    "llama-3.2-3b": _llama3(3072, 8192, 28, 24, 32.0, tied=True),
    "llama-3.1-8b": _llama3(4096, 14336, 32, 32, 8.0, tied=False),
    "llama-3.1-70b": _llama3(8192, 28672, 80, 64, 8.0, tied=False),
    "qwen2.5-0.5b": _qwen25(896, 4864, 24, 14, 2, tied=True, vocab=151936),
    "qwen2.5-1.5b": _qwen25(1536, 8960, 28, 12, 2, tied=True, vocab=151936),
    "qwen2.5-3b": _qwen25(2048, 11008, 36, 16, 2, tied=True, vocab=151936),
    "qwen2.5-7b": _qwen25(3584, 18944, 28, 28, 4, tied=False),
    "qwen2.5-14b": _qwen25(5120, 13824, 48, 40, 8, tied=False),
    "qwen2.5-32b": _qwen25(5120, 27648, 64, 40, 8, tied=False),
    "qwen2.5-72b": _qwen25(8192, 29568, 80, 64, 8, tied=False),
    "qwen3-0.6b": _qwen3(1024, 3072, 28, 16, tied=True),
    "qwen3-1.7b": _qwen3(2048, 6144, 28, 16, tied=True),
    "qwen3-4b": _qwen3(2560, 9728, 36, 32, tied=True),
    "qwen3-8b": _qwen3(4096, 12288, 36, 32, tied=False),
    "qwen3-14b": _qwen3(5120, 17408, 40, 40, tied=False),
    "qwen3-32b": _qwen3(5120, 25600, 64, 64, tied=False),
    # Mistral-7B v0.3: 32768-token vocabulary, no sliding window
    "mistral-7b": LlamaConfig(model_type="mistral", vocab_size=32768, hidden_size=4096, intermediate_size=14336,
                              num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                              max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=1000000.0,
                              bos_token_id=1, eos_token_id=2),
    # a tiny model for tests and CPU experiments: 2 KV heads for 4 query heads, untied head
    "llama-tiny": LlamaConfig(model_type="llama", vocab_size=320, hidden_size=128, intermediate_size=344,
                              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                              max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0),
}
