"""Mixture-of-experts layers shared by the MoE families (Qwen3-MoE, Mixtral, GPT-OSS): the router's choice,
the experts' compute, and the statistics of the router's load-balancing loss.

**Routing** (:func:`route`), as transformers implements it per family: ``softmax_topk`` (Qwen3-MoE, Mixtral) takes
the top-k of the softmax over every expert, renormalised over the k when ``norm_topk_prob`` (Mixtral always);
``topk_softmax`` (GPT-OSS) takes the top-k logits and their softmax. Routing is dropless: every token reaches
its k experts, whatever their load.

**Experts** (:class:`Experts`): one SwiGLU MLP per expert, stored fused as transformers stores them in memory
(``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I]; GPT-OSS transposed, [E, H, 2I] and [E, I, H], with biases
and its gate and up columns interleaved). A layer's tokens are sorted by expert, then each projection is one
grouped matmul over the experts' slices (``torch._grouped_mm``) where the device and dtype have one (CUDA,
bf16, sizes aligned to 16 bytes), else one matmul per expert that has tokens (the CPU: exact, no padding, no token
dropped). LoRA on the experts (:class:`ExpertAdapters`) adds per expert ``B_e A_e x alpha / rank`` as two more
grouped matmuls, PEFT's ``target_parameters`` adapters.

**Balance** (:class:`RouterLog`, :func:`balance_loss`): transformers' load-balancing loss of one forward is
``E * sum_e f_e P_e`` with f_e the share of top-k choices that went to expert e and P_e the mean router
probability of e, both over every MoE layer's tokens together (``load_balancing_loss_func``: the layers' router
logits concatenated, not a sum of per-layer losses). Each MoE layer adds its counts and probability sums to the
open :class:`RouterLog` of the forward that runs it (:func:`recording`); a stage of a pipeline holds some layers, so
the counts of all of them are what its backward needs (:func:`balance_grad`), the probability sums its own.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from dataclasses import dataclass, field
from typing import Iterator, Literal

import torch
import torch.nn.functional as F
from torch import nn

RouterKind = Literal["softmax_topk", "topk_softmax"]
Activation = Literal["silu", "clamped_swiglu"]
Kernel = Literal["auto", "grouped", "loop"]
KERNEL: Kernel = "auto"  # the experts' compute everywhere in this process (bench/gpu_suite.py's moe part sets it)
PROJECTIONS = ("gate_up_proj", "down_proj")


# ---------------------------------------------------------------------------------------------
# Routing
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Routing:
    """Each token's k experts and their weights, weights [N, k] and experts [N, k] int64; and ``probs`` [N, E], the
    fp32 softmax over every expert that the load-balancing loss reads (computed in every forward alike, so that a
    recomputation saves what the forward saved)."""

    weights: torch.Tensor
    experts: torch.Tensor
    probs: torch.Tensor


def route(logits: torch.Tensor, top_k: int, kind: RouterKind, norm_topk: bool, float_weights: bool) -> Routing:
    """The experts of each token from the router's logits [N, E] (``float_weights``: the weights stay fp32, as
    Mixtral's; else they take the logits' dtype)."""
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)  # [N, E]
    if kind == "topk_softmax":  # GPT-OSS: softmax over the top-k logits
        top, experts = torch.topk(logits, top_k, dim=-1)  # [N, k]
        return Routing(F.softmax(top, dim=1, dtype=top.dtype), experts, probs)
    top, experts = torch.topk(probs, top_k, dim=-1)  # [N, k]
    if norm_topk:
        top = top / top.sum(dim=-1, keepdim=True)
    return Routing(top if float_weights else top.to(logits.dtype), experts, probs)


# ---------------------------------------------------------------------------------------------
# The experts' compute
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ExpertShape:
    """E experts of hidden width H and intermediate width I; ``transposed``: weights stored [E, in, out]
    (GPT-OSS) instead of [E, out, in]; ``bias``: a bias per expert and projection; ``activation``: how the
    gate_up output [.., 2I] becomes [.., I] (``silu``: gate then up halves; ``clamped_swiglu``: GPT-OSS's,
    gate and up interleaved, clamped at ``limit``, sigmoid gain ``alpha``)."""

    experts: int
    hidden: int
    inter: int
    transposed: bool = False
    bias: bool = False
    activation: Activation = "silu"
    alpha: float = 1.702
    limit: float = 7.0

    def dims(self, proj: str) -> tuple[int, int]:
        """(in, out) features of one expert's projection."""
        return (self.hidden, 2 * self.inter) if proj == "gate_up_proj" else (self.inter, self.hidden)

    def weight_shape(self, proj: str) -> tuple[int, int, int]:
        i, o = self.dims(proj)
        return (self.experts, i, o) if self.transposed else (self.experts, o, i)


class Experts(nn.Module):
    """E SwiGLU experts, fused: ``gate_up_proj`` and ``down_proj`` (and their biases). x [N, H] -> [N, H]."""

    def __init__(self, shape: ExpertShape):
        super().__init__()
        self.shape = shape
        self.gate_up_proj = nn.Parameter(torch.empty(shape.weight_shape("gate_up_proj")))
        if shape.bias:
            self.gate_up_proj_bias = nn.Parameter(torch.empty(shape.experts, 2 * shape.inter))
        self.down_proj = nn.Parameter(torch.empty(shape.weight_shape("down_proj")))
        if shape.bias:
            self.down_proj_bias = nn.Parameter(torch.empty(shape.experts, shape.hidden))
        self.adapters: ExpertAdapters | None = None  # LoRA (mobius.models.lora)

    def forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        N, k = routing.experts.shape
        flat = routing.experts.reshape(-1)  # [N*k]
        order = torch.argsort(flat, stable=True)  # rows sorted by expert
        token = order // k  # [N*k] the token of each sorted row
        counts = torch.bincount(flat, minlength=self.shape.experts)  # [E]
        groups = _Groups(counts, flat[order], _kernel(x))
        h = self._project(x[token], "gate_up_proj", groups)  # [N*k, 2I]
        h = self._act(h)  # [N*k, I]
        y = self._project(h, "down_proj", groups)  # [N*k, H]
        y = y * routing.weights.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add_(0, token, y.to(x.dtype))  # [N, H], each token's k rows summed

    def _project(self, x: torch.Tensor, proj: str, g: "_Groups") -> torch.Tensor:
        """One projection of the sorted rows x [R, in] -> [R, out], each by its expert's weight (+ bias, + adapter)."""
        w = getattr(self, proj)
        y = g.matmul(x, w if self.shape.transposed else w.transpose(1, 2))  # [E, in, out]
        if self.shape.bias:
            y = y + getattr(self, f"{proj}_bias")[g.expert].to(y.dtype)  # [R, out]
        if self.adapters is not None and proj in self.adapters.projections:
            y = y + self.adapters.delta(x, proj, g).to(y.dtype)
        return y

    def _act(self, h: torch.Tensor) -> torch.Tensor:
        s = self.shape
        if s.activation == "silu":
            gate, up = h.chunk(2, dim=-1)
            return F.silu(gate) * up
        gate, up = h[..., ::2], h[..., 1::2]
        gate = gate.clamp(min=None, max=s.limit)
        up = up.clamp(min=-s.limit, max=s.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * s.alpha))


class ExpertAdapters(nn.Module):
    """LoRA on some of the experts' projections, rank ``rank[proj]`` per expert (PEFT's ``ParamWrapper``):
    ``lora_A.<proj>`` [E, r, in] (uniform in +-1/sqrt(in)), ``lora_B.<proj>`` [E, out, r] (zero); the projection
    adds ``B_e (A_e x) * scaling[proj]`` for the rows of expert e."""

    def __init__(self, shape: ExpertShape, rank: dict[str, int], scaling: dict[str, float]):
        super().__init__()
        self.projections = tuple(p for p in PROJECTIONS if p in rank)
        self.scaling = dict(scaling)
        self.lora_A = nn.ParameterDict({p: nn.Parameter(torch.empty(shape.experts, rank[p], shape.dims(p)[0]))
                                        for p in self.projections})
        self.lora_B = nn.ParameterDict({p: nn.Parameter(torch.empty(shape.experts, shape.dims(p)[1], rank[p]))
                                        for p in self.projections})

    def delta(self, x: torch.Tensor, proj: str, g: "_Groups") -> torch.Tensor:
        """x [R, in] -> the adapter's [R, out]."""
        a = g.matmul(x, self.lora_A[proj].transpose(1, 2))  # [R, r]
        return g.matmul(a, self.lora_B[proj].transpose(1, 2)) * self.scaling[proj]  # [R, out]


class _Groups:
    """The sorted rows' split by expert: ``counts`` [E] rows each, ``expert`` [R] of each row; ``kernel``: one
    grouped matmul, or a matmul per expert with rows."""

    def __init__(self, counts: torch.Tensor, expert: torch.Tensor, kernel: Literal["grouped", "loop"]):
        self.counts, self.expert, self.kernel = counts, expert, kernel

    @functools.cached_property
    def offsets(self) -> torch.Tensor:
        """[E] int32: the end of each expert's rows (what ``torch._grouped_mm`` takes; no host sync)."""
        return torch.cumsum(self.counts, dim=0, dtype=torch.int32)

    @functools.cached_property
    def sizes(self) -> list[int]:
        """Rows of each expert on the host (one device sync, once per layer)."""
        return self.counts.tolist()

    def matmul(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x [R, in] (sorted by expert) times each row's expert's w [E, in, out] -> [R, out]."""
        dtype = _compute_dtype(x)
        x, w = x.to(dtype), w.to(dtype)
        if self.kernel == "grouped" and x.shape[-1] % 8 == 0 and w.shape[-1] % 8 == 0:  # 16-byte strides in bf16
            return torch._grouped_mm(x, w, offs=self.offsets)
        parts, start = [], 0
        for e, n in enumerate(self.sizes):
            if n:
                parts.append(x[start:start + n] @ w[e])
                start += n
        return torch.cat(parts) if parts else x.new_zeros(0, w.shape[-1])


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the matmuls run in: autocast's (no autocast rule covers ``torch._grouped_mm``), else x's."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


def _kernel(x: torch.Tensor) -> Literal["grouped", "loop"]:
    """``grouped`` where torch has a grouped matmul for this device and dtype (CUDA, bf16; the CPU's has no
    backward; a matmul whose widths are not multiples of 8 elements, its 16-byte strides, still loops), else
    ``loop``; :data:`KERNEL` forces one."""
    if KERNEL != "auto":
        return KERNEL
    if x.is_cuda and _compute_dtype(x) == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
        return "grouped"
    return "loop"


# ---------------------------------------------------------------------------------------------
# The router's load balance
# ---------------------------------------------------------------------------------------------
@dataclass
class RouterLog:
    """What the MoE layers of one forward (one micro-batch through some units) routed: per layer index, the top-k
    choices per expert (``counts`` [E], fp32, no gradient) and the router probabilities summed over the tokens
    (``probs`` [E], fp32, with the gradient to the router), and the tokens routed per layer."""

    counts: dict[int, torch.Tensor] = field(default_factory=dict)
    probs: dict[int, torch.Tensor] = field(default_factory=dict)
    tokens: int = 0
    open: bool = True

    def add(self, layer: int, counts: torch.Tensor, probs: torch.Tensor, tokens: int) -> None:
        assert layer not in self.counts, f"MoE layer {layer} routed twice in one forward"
        self.counts[layer], self.probs[layer], self.tokens = counts, probs, tokens

    @property
    def empty(self) -> bool:
        return not self.counts

    def count_sum(self) -> torch.Tensor:
        """[E] the choices of every layer here, summed (what the other stages need of this one)."""
        return torch.stack(list(self.counts.values())).sum(0)

    def prob_sum(self) -> torch.Tensor:
        """[E] the router probabilities of every layer here, summed (differentiable)."""
        return torch.stack(list(self.probs.values())).sum(0)


_LOG: contextvars.ContextVar[RouterLog | None] = contextvars.ContextVar("mobius_router_log", default=None)


@contextlib.contextmanager
def recording() -> Iterator[RouterLog]:
    """Collect what the MoE layers of the forward run inside route (on this thread); the log closes on exit, so
    a recomputation in the backward (activation checkpointing) adds nothing."""
    log = RouterLog()
    token = _LOG.set(log)
    try:
        yield log
    finally:
        _LOG.reset(token)
        log.open = False


def note(layer: int, routing: Routing) -> None:
    """Add one MoE layer's routing to the open log, if any: its choices per expert, and the sum over tokens of the
    softmax over every expert (fp32; the sum saves no tensor for its backward, so a recomputation outside any log
    saves what the forward saved)."""
    log = _LOG.get()
    if log is None or not log.open:
        return
    N, E = routing.probs.shape
    counts = torch.bincount(routing.experts.reshape(-1), minlength=E).float()  # [E]
    log.add(layer, counts, routing.probs.sum(0), N)


@dataclass(frozen=True)
class Balance:
    """The load-balancing loss of a model: ``experts`` E, ``layers`` L (MoE layers), ``coef``
    (``router_aux_loss_coef``). For one micro-batch of N tokens, with C the top-k choices per expert summed over the
    L layers and Q the router probabilities likewise: aux = E * sum_e (C_e / (L N)) (Q_e / (L N))."""

    experts: int
    layers: int
    coef: float

    def norm(self, tokens: int) -> float:
        """E / (L N)^2: aux = norm * C . Q, and d aux / d Q = norm * C."""
        return self.experts / float(self.layers * tokens) ** 2

    def value(self, counts: torch.Tensor, probs: torch.Tensor, tokens: int) -> torch.Tensor:
        """aux of one micro-batch from all its layers' counts C [E] and probability sums Q [E]."""
        return self.norm(tokens) * torch.dot(counts.to(probs.dtype), probs)


def balance_of(cfg: object) -> Balance | None:
    """The model's load-balancing loss, or None for a dense model (or one without MoE layers)."""
    layers = len(getattr(cfg, "moe_layers", ()))
    if not layers:
        return None
    return Balance(cfg.num_experts, layers, cfg.router_aux_loss_coef)


def shares(counts: torch.Tensor) -> tuple[float, float]:
    """(the busiest expert's share of a layer's top-k choices, the least used one's) from counts [E]."""
    total = float(counts.sum())
    if total == 0:
        return 0.0, 0.0
    return float(counts.max()) / total, float(counts.min()) / total
