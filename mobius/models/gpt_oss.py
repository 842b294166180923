"""GPT-OSS (``GptOssForCausalLM``) as an ordered list of units.

Each decoder layer: RMSNorm (its gain applied in fp32, then cast), grouped-query attention with biases, YaRN
rotary positions (the tables scaled by YaRN's attention factor) and a learned *sink* per query head (a logit
that every query's softmax includes and whose value is dropped, so a head can attend to nothing), over all
earlier tokens (``full_attention``) or the last ``sliding_window`` (``sliding_attention``; the layers alternate);
then a router (a linear layer with bias: the top-k logits, their softmax) and fused experts with biases and the
clamped SwiGLU (``(up + 1) * gate * sigmoid(alpha * gate)``, gate clamped above and up on both sides at
``swiglu_limit``; gate and up interleaved in ``gate_up_proj`` [E, H, 2I], stored as transformers does, [in, out]).

Attention runs through :func:`sink_attention`: SDPA with the sink as one more key that every query sees (its
logit carried in a head dimension of its own, its value zero) under a boolean mask of causality, the window and,
in packed rows, each query's own document. Checkpoints in MXFP4 (the Hub's ``openai/gpt-oss-20b``: packed FP4
experts with per-block scales) are refused with one line that says how to get bf16 weights: mobius trains
floating-point experts, and the planner counts 2 bytes per weight.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from mobius.errors import ConfigError
from mobius.models import experts as moe
from mobius.models.base import ArchConfig, CausalLM, UnitSpec, check_positions
from mobius.models.costs import embed_memory
from mobius.models.llama import apply_rotary, rms_head_memory
from mobius.models.packing import Documents, even_documents, sdpa

LAYER_TYPES = ("sliding_attention", "full_attention")
YARN_KEYS = ("factor", "beta_fast", "beta_slow", "original_max_position_embeddings")


@dataclass
class GptOssConfig(ArchConfig):
    """Architecture of a GPT-OSS model (names as in Hugging Face's config.json)."""

    vocab_size: int = 201088
    hidden_size: int = 2880
    intermediate_size: int = 2880  # each expert's width
    num_hidden_layers: int = 24
    num_attention_heads: int = 64
    num_key_value_heads: int = 8
    head_dim: int = 64
    num_local_experts: int = 32
    num_experts_per_tok: int = 4
    sliding_window: int = 128
    layer_types: list[str] = field(default_factory=list)  # [] : sliding, full, sliding, ... (transformers' default)
    rope_theta: float = 150000.0
    rope_scaling: dict = field(default_factory=lambda: {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                                        "beta_slow": 1.0, "truncate": False,
                                                        "original_max_position_embeddings": 4096})
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-5
    attention_dropout: float = 0.0
    attention_bias: bool = True
    hidden_act: str = "silu"  # (the experts' activation is the clamped SwiGLU below)
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    router_aux_loss_coef: float = 0.001
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    family = "gpt_oss"
    FIELDS = {"layers": "num_hidden_layers", "width": "hidden_size", "embedding": "hidden_size",
              "positions": "max_position_embeddings"}
    ARCH_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                   "num_key_value_heads", "head_dim", "num_local_experts", "num_experts_per_tok")
    POSITIVE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                       "num_key_value_heads", "head_dim", "num_local_experts", "num_experts_per_tok",
                       "sliding_window", "max_position_embeddings")
    DROPOUT_FIELDS = ("attention_dropout",)
    TIED = ("embed.embed_tokens.weight", "head.lm_head.weight")
    LORA_TARGETS = {**{p: (f"self_attn.{p}",) for p in ("q_proj", "k_proj", "v_proj", "o_proj")},
                    "gate_up_proj": ("mlp.experts.gate_up_proj",), "down_proj": ("mlp.experts.down_proj",)}
    LORA_ALL_LINEAR_SKIPS = ("gate_up_proj", "down_proj")  # PEFT's all-linear: nn.Linear modules (not the experts)
    ROUTERS = ("mlp.router",)

    def __post_init__(self) -> None:
        where = "gpt_oss config"
        if not self.layer_types:
            self.layer_types = [LAYER_TYPES[i % 2] for i in range(self.num_hidden_layers)]
        super().__post_init__()
        if len(self.layer_types) != self.num_hidden_layers or set(self.layer_types) - set(LAYER_TYPES):
            raise ConfigError(f"{where}: layer_types must name one of {', '.join(LAYER_TYPES)} for each of the "
                              f"{self.num_hidden_layers} layers, got {self.layer_types}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"{where}: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                              f"num_key_value_heads ({self.num_key_value_heads})")
        if self.num_experts_per_tok > self.num_local_experts:
            raise ConfigError(f"{where}: num_experts_per_tok ({self.num_experts_per_tok}) exceeds "
                              f"num_local_experts ({self.num_local_experts})")
        if not self.attention_bias:
            raise ConfigError(f"{where}: attention_bias=False is not supported (GPT-OSS's projections have biases)")
        self.rope_scaling = _check_yarn(self.rope_scaling, where)

    num_experts = property(lambda self: self.num_local_experts)  # (the MoE families' common word)
    moe_layers = property(lambda self: tuple(range(self.num_hidden_layers)))

    @property
    def expert_shape(self) -> moe.ExpertShape:
        return moe.ExpertShape(self.num_local_experts, self.hidden_size, self.intermediate_size, transposed=True,
                               bias=True, activation="clamped_swiglu", alpha=self.swiglu_alpha,
                               limit=self.swiglu_limit)

    def window(self, layer: int) -> int | None:
        """The tokens layer ``layer`` attends back over (None: all earlier ones)."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    def check_sequence(self, seq_len: int) -> None:
        check_positions(self, seq_len)


def _check_yarn(rs: dict | None, where: str) -> dict:
    """The rotary scaling as one dict: YaRN with positive factor, betas and original positions."""
    if not isinstance(rs, dict) or rs.get("rope_type", rs.get("type")) != "yarn":
        raise ConfigError(f"{where}: rope_scaling must be YaRN's (rope_type 'yarn'), got {rs!r}")
    rs = {k: v for k, v in rs.items() if k not in ("type", "rope_theta")}
    rs["rope_type"] = "yarn"
    for key in YARN_KEYS:
        value = rs.get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{where}: rope_scaling yarn needs a positive {key}, got {value!r}")
    rs.setdefault("truncate", True)
    unknown = sorted(set(rs) - {"rope_type", "truncate", *YARN_KEYS})
    if unknown:
        raise ConfigError(f"{where}: rope_scaling field {unknown[0]}={rs[unknown[0]]!r} is not supported")
    return rs


# ---------------------------------------------------------------------------------------------
# YaRN rotary positions
# ---------------------------------------------------------------------------------------------
def yarn_frequencies(head_dim: int, theta: float, scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN's inverse frequencies [head_dim / 2] (fp32) and attention factor: each frequency blended between its
    interpolated (divided by ``factor``) and original value by a ramp over the dimensions whose rotations within
    ``original_max_position_embeddings`` fall between ``beta_fast`` and ``beta_slow`` (transformers' yarn)."""
    factor, old = scaling["factor"], scaling["original_max_position_embeddings"]
    attention = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    pos = theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)  # [hd/2]
    extrapolated, interpolated = 1.0 / pos, 1.0 / (factor * pos)

    def dim_of(rotations: float) -> float:
        return head_dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(scaling["beta_fast"]), dim_of(scaling["beta_slow"])
    if scaling["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # the share of each dimension's original frequency
    return interpolated * (1 - keep) + extrapolated * keep, attention


@functools.lru_cache(maxsize=16)
def _tables(head_dim: int, theta: float, scaling: tuple, seq: int, device: torch.device,
            dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, head_dim] of positions 0..seq-1, times YaRN's attention factor (fp32, then ``dtype``)."""
    with torch.inference_mode(False), torch.no_grad():
        inv, attention = yarn_frequencies(head_dim, theta, dict(scaling))
        freqs = torch.arange(seq, device=device, dtype=torch.float32)[:, None] * inv.to(device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, hd]
        return (emb.cos() * attention).to(dtype), (emb.sin() * attention).to(dtype)


def rotary_tables(cfg: GptOssConfig, seq: int, device: torch.device, dtype: torch.dtype,
                  docs: Documents | None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, hd], or [B, 1, T, hd] for positions that start again at each document."""
    cos, sin = _tables(cfg.head_dim, cfg.rope_theta, tuple(sorted(cfg.rope_scaling.items())), seq, device, dtype)
    if docs is None:
        return cos, sin
    return cos[docs.positions][:, None], sin[docs.positions][:, None]


# ---------------------------------------------------------------------------------------------
# Attention with sinks, sliding windows and packed documents
# ---------------------------------------------------------------------------------------------
def attention_mask(seq: int, window: int | None, docs: Documents | None, device: torch.device) -> torch.Tensor:
    """[B or 1, 1, T, T + 1] bool: column 0 is the sink (every query sees it), then key j for query i when
    j <= i, i - j < window and (packed rows) both are in one document."""
    i = torch.arange(seq, device=device)
    ok = i[None, :] <= i[:, None]  # [T, T] causal
    if window is not None:
        ok = ok & (i[:, None] - i[None, :] < window)
    ok = ok[None]  # [1, T, T]
    if docs is not None:
        seg = docs.segment  # [B, T]
        ok = ok & (seg[:, :, None] == seg[:, None, :])
    sink = torch.ones(ok.shape[0], seq, 1, dtype=torch.bool, device=device)
    return torch.cat((sink, ok), dim=-1)[:, None]  # [B|1, 1, T, T+1]


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, mask: torch.Tensor,
                   dropout: float, scale: float, groups: int) -> torch.Tensor:
    """Softmax attention of q [B, nh, T, hd] over k, v [B, nkv, T, hd] and a sink logit per query head ``sinks``
    [nh] that joins every softmax and adds nothing (GPT-OSS's). The sink is a key of its own at position 0: q
    carries sinks / scale in one more dimension, which only the sink key has (1); its value is zero. ``mask``
    from :func:`attention_mask`. -> [B, nh, T, hd]"""
    B, nh, T, hd = q.shape
    nkv = k.shape[1]
    width = hd + 1 + (-(hd + 1)) % 8  # a head dimension of a multiple of 8 (the fused kernels' alignment)
    extra = (sinks.to(q.dtype) / scale).view(1, nh, 1, 1).expand(B, nh, T, 1)
    qs = torch.cat((q, extra, q.new_zeros(B, nh, T, width - hd - 1)), dim=-1)  # [B, nh, T, width]
    sink_key = torch.zeros(B, nkv, 1, width, dtype=k.dtype, device=k.device)
    sink_key[..., hd] = 1
    ks = torch.cat((sink_key, F.pad(k, (0, width - hd))), dim=2)  # [B, nkv, T+1, width]
    vs = F.pad(torch.cat((v.new_zeros(B, nkv, 1, hd), v), dim=2), (0, width - hd))  # [B, nkv, T+1, width]
    return sdpa(qs, ks, vs, dropout, scale, groups, mask)[..., :hd]


# ---------------------------------------------------------------------------------------------
# Units
# ---------------------------------------------------------------------------------------------
class GptOssRMSNorm(nn.Module):
    """RMSNorm whose gain multiplies the fp32 normalised input before the cast back (GPT-OSS's order)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps))).to(x.dtype)


class GptOssEmbedding(nn.Module):
    """Token embeddings. input_ids [B, T] -> hidden [B, T, H]."""

    def __init__(self, cfg: GptOssConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.max_positions = cfg.max_position_embeddings

    def forward(self, input_ids: torch.Tensor, docs: Documents | None = None) -> torch.Tensor:
        if input_ids.shape[1] > self.max_positions:
            raise ValueError(f"sequence length {input_ids.shape[1]} exceeds the model's {self.max_positions} positions")
        return self.embed_tokens(input_ids)


class GptOssAttention(nn.Module):
    """Grouped-query attention with biases, YaRN rotations, a sink per head, over all earlier tokens or a window."""

    def __init__(self, cfg: GptOssConfig, layer: int):
        super().__init__()
        H, hd = cfg.hidden_size, cfg.head_dim
        self.cfg, self.n_head, self.n_kv, self.window = cfg, cfg.num_attention_heads, cfg.num_key_value_heads, \
            cfg.window(layer)
        self.q_proj = nn.Linear(H, self.n_head * hd)
        self.k_proj = nn.Linear(H, self.n_kv * hd)
        self.v_proj = nn.Linear(H, self.n_kv * hd)
        self.o_proj = nn.Linear(self.n_head * hd, H)
        self.sinks = nn.Parameter(torch.empty(self.n_head))

    def forward(self, x: torch.Tensor, docs: Documents | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        hd = self.cfg.head_dim
        q = self.q_proj(x).view(B, T, self.n_head, hd).transpose(1, 2)  # [B, nh, T, hd]
        k = self.k_proj(x).view(B, T, self.n_kv, hd).transpose(1, 2)  # [B, nkv, T, hd]
        v = self.v_proj(x).view(B, T, self.n_kv, hd).transpose(1, 2)
        cos, sin = rotary_tables(self.cfg, T, x.device, q.dtype, docs)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        mask = attention_mask(T, self.window, docs, x.device)
        p = self.cfg.attention_dropout if self.training else 0.0
        y = sink_attention(q, k, v, self.sinks, mask, p, hd ** -0.5, self.n_head // self.n_kv)  # [B, nh, T, hd]
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_head * hd))


class GptOssMoe(nn.Module):
    """Router (top-k logits, their softmax) and experts. [B, T, H] -> [B, T, H]."""

    def __init__(self, cfg: GptOssConfig, layer: int):
        super().__init__()
        self.router = nn.Linear(cfg.hidden_size, cfg.num_local_experts)
        self.experts = moe.Experts(cfg.expert_shape)
        self.layer, self.top_k = layer, cfg.num_experts_per_tok

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, H = x.shape
        flat = x.reshape(B * T, H)
        routing = moe.route(self.router(flat), self.top_k, "topk_softmax", False, False)
        moe.note(self.layer, routing)
        return self.experts(flat, routing).view(B, T, H)


class GptOssBlock(nn.Module):
    """Pre-norm decoder layer. hidden [B, T, H] -> hidden [B, T, H]."""

    def __init__(self, cfg: GptOssConfig, layer: int):
        super().__init__()
        self.input_layernorm = GptOssRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = GptOssAttention(cfg, layer)
        self.post_attention_layernorm = GptOssRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GptOssMoe(cfg, layer)

    def forward(self, x: torch.Tensor, docs: Documents | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), docs)
        return x + self.mlp(self.post_attention_layernorm(x))


class GptOssHead(nn.Module):
    """Final norm and vocabulary projection. hidden [B, T, H] -> logits [B, T, V]."""

    def __init__(self, cfg: GptOssConfig):
        super().__init__()
        self.norm = GptOssRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor, docs: Documents | None = None) -> torch.Tensor:
        return self.lm_head(self.norm(x))


class GptOss(CausalLM):
    INIT_STD = 0.02


# ---------------------------------------------------------------------------------------------
# Unit descriptions
# ---------------------------------------------------------------------------------------------
def block_param_count(cfg: GptOssConfig, active: bool = False) -> int:
    """A layer's parameters (``active``: with k of the E experts, as one token computes)."""
    H, I_, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    attention = H * q + q + 2 * (H * kv + kv) + q * H + H + cfg.num_attention_heads
    experts = cfg.num_experts_per_tok if active else cfg.num_local_experts
    return attention + experts * (3 * H * I_ + 2 * I_ + H) + cfg.num_local_experts * (H + 1) + 2 * H


def active_params(cfg: GptOssConfig) -> int:
    """Parameters one token computes with, as OpenAI's model card counts them: the unembedding in, the embedding
    (a lookup) out."""
    return cfg.vocab_size * cfg.hidden_size + cfg.hidden_size + cfg.num_hidden_layers * block_param_count(cfg, True)


def window_pairs(seq: int, doc: int | None, window: int | None) -> int:
    """Query-key pairs of attention over a row (both triangles' halves counted whole, as
    :func:`~mobius.models.packing.attended_pairs`), each query seeing at most ``window`` keys."""
    total = 0
    for n in even_documents(seq, doc):
        w = n if window is None else min(window, n)
        total += 2 * (n * w - w * (w - 1) // 2)  # sum over queries of min(i + 1, w), twice
    return total


def block_flops(cfg: GptOssConfig, layer: int, batch: int, seq: int, doc: int | None = None) -> float:
    """Forward FLOPs of one layer: projections, attention (within the window), the router and k experts."""
    H, I_ = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    tokens = batch * seq
    matmuls = 2.0 * tokens * (H * (q + 2 * kv) + q * H + H * cfg.num_local_experts
                              + cfg.num_experts_per_tok * 3 * H * I_)
    return matmuls + 2.0 * batch * window_pairs(seq, doc, cfg.window(layer)) * q


def block_memory(cfg: GptOssConfig, batch: int, seq: int, elem: int) -> tuple[int, int]:
    """(saved, working) bytes of one layer's forward: the norms' fp32 inputs, fp32 products (the gain applies before
    the cast) and outputs; attention's q, k, v and
    output in the sink's widened head dimension (a multiple of 8 above head_dim + 1), the output projection's
    input, the softmax's fp32 log-sum-exp, the mask [T, T + 1] (one per row of packed documents); the router's fp32
    softmax and top-k; per chosen expert the gathered input, gate_up, the clamped SwiGLU's four pieces, the down
    projection's input and output and one more [H], and the gathered weight. (Checked against autograd's saved
    tensors on the CPU.)"""
    H, I_, k, E = cfg.hidden_size, cfg.intermediate_size, cfg.num_experts_per_tok, cfg.num_local_experts
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    wide = hd + 1 + (-(hd + 1)) % 8
    tokens = batch * seq
    per_token = 2 * (8 * H + elem * H) + elem * (2 * nh * wide + 2 * nkv * wide + nh * hd) + 4 * nh \
        + k * elem * (3 * H + 7 * I_ + 1) + 4 * E + 24 * k
    work = tokens * max(k * elem * (2 * H + 4 * I_), 2 * elem * (nh + 2 * nkv) * wide)
    return tokens * per_token + batch * seq * (seq + 1) * elem, work


def unit_specs(cfg: GptOssConfig) -> list[UnitSpec]:
    """Describe every unit of a GPT-OSS model without building it."""
    H, V = cfg.hidden_size, cfg.vocab_size
    shape = (f"gpt_oss:h{H}:e{cfg.num_local_experts}x{cfg.intermediate_size}k{cfg.num_experts_per_tok}"
             f":nh{cfg.num_attention_heads}:kv{cfg.num_key_value_heads}:hd{cfg.head_dim}:v{V}")
    common = dict(hidden_size=H, vocab_size=V, out_numel=lambda b, s: b * s * H)
    specs = [UnitSpec(name="embed", kind="embed", signature=f"{shape}:embed", param_count=V * H,
                      build=lambda: GptOssEmbedding(cfg), fwd_flops=lambda b, s, doc=None: 2.0 * b * s * H,
                      memory=partial(embed_memory, H), **common)]
    for i in range(cfg.num_hidden_layers):
        window = cfg.window(i)
        specs.append(UnitSpec(name=f"block.{i}", kind="block", signature=f"{shape}:w{window}:block",
                              param_count=block_param_count(cfg), build=partial(GptOssBlock, cfg, i),
                              fwd_flops=partial(block_flops, cfg, i), memory=partial(block_memory, cfg), **common))
    specs.append(UnitSpec(name="head", kind="head", signature=f"{shape}:head", param_count=V * H + H,
                          build=lambda: GptOssHead(cfg), fwd_flops=lambda b, s, doc=None: 2.0 * b * s * H * V,
                          memory=partial(rms_head_memory, H, V), hidden_size=H, vocab_size=V,
                          out_numel=lambda b, s: b * s * V))
    return specs


# ---------------------------------------------------------------------------------------------
# Presets (bf16 weights; the Hub's MXFP4 checkpoints are refused, see the module docstring)
# ---------------------------------------------------------------------------------------------
def _gpt_oss(layers: int, experts: int) -> GptOssConfig:
    """OpenAI's config.json (router_aux_loss_coef 0.9 there; transformers' default is 0.001)."""
    return GptOssConfig(num_hidden_layers=layers, num_local_experts=experts, router_aux_loss_coef=0.9,
                        bos_token_id=199998, eos_token_id=200002, pad_token_id=199999)


PRESETS: dict[str, GptOssConfig] = {"gpt-oss-20b": _gpt_oss(24, 32), "gpt-oss-120b": _gpt_oss(36, 128)}
PUBLISHED = {"gpt-oss-20b": (20.91e9, 3.61e9), "gpt-oss-120b": (116.83e9, 5.13e9)}  # (total, active), model card
