"""The contract every model family follows: an ordered list of cuttable units.

A model is ``embed -> block_0 .. block_{L-1} -> head``. Each unit is a plain ``nn.Module``:

* the embedding takes ``input_ids`` ``[B, T]`` (int64) and returns hidden states ``[B, T, H]``;
* a block takes and returns hidden states ``[B, T, H]``;
* the head takes hidden states ``[B, T, H]`` and returns logits ``[B, T, V]``.

Each also takes ``docs``, the rows' documents (:class:`~mobius.models.packing.Documents`; None for
rows that are one causal sequence): positions start again and attention stays within each one.

A partitioner may cut between any two units. :class:`UnitSpec` describes a unit without building
it, so a profiler can build one unit of each kind at a time (a 13B model never has to fit whole)
and an analytic estimate can count FLOPs and bytes.

Tied weights (GPT-2, OPT and the small Llama 3.2 / Qwen models tie the input embedding to the output
projection) are declared by
:meth:`CausalLM.tied_weights`; inside one process they are the same ``Parameter``, while a pipeline
that puts the two ends on different stages keeps one copy per stage and sums their gradients.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import nn

from mobius.batch import IGNORE
from mobius.errors import ConfigError
from mobius.models.lora import LoraSpec
from mobius.models.packing import Documents, even_documents

ACTIVATIONS = {  # by Hugging Face's name, for the families that name their MLP's activation (GPT-2, OPT)
    "gelu_new": partial(F.gelu, approximate="tanh"),
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    "gelu": F.gelu,
    "relu": F.relu,
}

UnitKind = Literal["embed", "block", "head"]


@dataclass(frozen=True)
class UnitSpec:
    """A description of one unit, enough to build, profile or estimate it.

    ``signature`` is equal for units that are identical in shape and cost (all blocks of a
    model), so a profiler measures each signature once.
    """

    name: str  # "embed", "block.3", "head"
    kind: UnitKind
    signature: str
    param_count: int  # parameters owned by this unit (a tied weight counts in both ends)
    hidden_size: int
    vocab_size: int
    build: Callable[[], nn.Module]
    fwd_flops: Callable[..., float]  # (batch, seq, doc=None) -> forward FLOPs of one call (doc: tokens per packed
    # document, None: one sequence per row)
    out_numel: Callable[[int, int], int]  # (batch, seq) -> elements of the unit's output
    memory: Callable[[int, int, int], tuple[int, int]]  # (batch, seq, bytes per element) -> (saved, working) bytes
    frozen_count: int = 0  # of param_count, what does not train (LoRA's base weights)

    def make_docs(self, batch: int, seq: int, doc_tokens: int | None) -> torch.Tensor | None:
        """Document lengths [B, D] of rows packed with documents of ``doc_tokens`` (None: one sequence per row)."""
        if doc_tokens is None:
            return None
        return torch.tensor([even_documents(seq, doc_tokens)] * batch, dtype=torch.int32)

    def make_input(self, batch: int, seq: int, device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
        """A random input of the right shape for this unit (token ids for the embedding)."""
        if self.kind == "embed":
            return torch.randint(0, self.vocab_size, (batch, seq), device=device)  # [B, T]
        return torch.randn(batch, seq, self.hidden_size, device=device, dtype=dtype)  # [B, T, H]


@dataclass
class ArchConfig:
    """What every family's config has, said in the family's own field names: ``FIELDS`` maps the common
    words (``layers``, ``width`` between units, ``embedding`` width, ``positions``) to them,
    ``POSITIVE_FIELDS`` names the sizes, ``DROPOUT_FIELDS`` the dropout probabilities and ``TIED`` the
    (embedding, head) parameters that ``tie_word_embeddings`` makes one."""

    lora: LoraSpec | None = field(default=None, kw_only=True)  # adapters (lora.*): the base weights freeze

    FIELDS: ClassVar[dict[str, str]] = {}
    POSITIVE_FIELDS: ClassVar[tuple[str, ...]] = ()
    DROPOUT_FIELDS: ClassVar[tuple[str, ...]] = ()
    TIED: ClassVar[tuple[str, str]]

    num_layers = property(lambda self: getattr(self, self.FIELDS["layers"]))
    width = property(lambda self: getattr(self, self.FIELDS["width"]))  # hidden states between units
    embedding_dim = property(lambda self: getattr(self, self.FIELDS["embedding"]))
    max_positions = property(lambda self: getattr(self, self.FIELDS["positions"]))

    def __post_init__(self) -> None:
        """The checks every family makes (a family's own follow): sizes positive, dropouts in [0, 1)."""
        for name in self.POSITIVE_FIELDS:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{self.family} config: {name} must be positive, got {getattr(self, name)}")
        for name in self.DROPOUT_FIELDS:
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"{self.family} config: {name} must be in [0, 1), got {getattr(self, name)}")

    def check_sequence(self, seq_len: int) -> None:
        check_positions(self, seq_len)

    def set_dropout(self, p: float) -> None:
        """Use one dropout probability everywhere (fine-tuning runs often set 0)."""
        for name in self.DROPOUT_FIELDS:
            setattr(self, name, p)

    def dropout_active(self) -> bool:
        """True when any of the architecture's dropout probabilities is non-zero (the adapters' aside)."""
        return any(getattr(self, name) > 0 for name in self.DROPOUT_FIELDS)

    def tied_weights(self) -> list[tuple[str, str]]:
        """(embedding name, head name) when the head's projection is the token embedding."""
        return [self.TIED] if self.tie_word_embeddings else []


def check_positions(cfg: ArchConfig, seq_len: int) -> None:
    """Refuse a training length above the model's position limit (before any work starts)."""
    if seq_len > cfg.max_positions:
        raise ConfigError(f"data.seq_len ({seq_len}) exceeds the model's {cfg.max_positions} positions; set "
                          f"data.seq_len to at most {cfg.max_positions}")


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over the targets. logits [B, T, V], targets [B, T] (already shifted;
    IGNORE: no loss)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE)


def lm_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross entropy over the targets (fp32): what an engine divides by the step's
    target count (:func:`mobius.batch.step_targets`). logits [B, T, V], targets [B, T]."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="sum")


class CausalLM(nn.Module):
    """Base class of the model families: ``embed``, ``blocks`` and ``head`` run in order."""

    config: ArchConfig
    embed: nn.Module
    blocks: nn.ModuleList
    head: nn.Module

    def __init__(self, cfg: ArchConfig, specs: list[UnitSpec]):
        """The units as their specs (the family's ``unit_specs``) build them, so that a unit built alone,
        as a pipeline stage builds it, is the model's; in order, then :meth:`finish`."""
        super().__init__()
        self.config = cfg
        embed, *blocks, head = (spec.build() for spec in specs)
        self.embed, self.blocks, self.head = embed, nn.ModuleList(blocks), head
        self.finish()

    def units(self) -> list[nn.Module]:
        """The units in execution order: embedding, every block, head."""
        return [self.embed, *self.blocks, self.head]

    def unit_names(self) -> list[str]:
        return ["embed", *[f"block.{i}" for i in range(len(self.blocks))], "head"]

    def tied_weights(self) -> list[tuple[str, str]]:
        """Pairs of parameter names (``unit_name.param_name``) that share one tensor."""
        return self.config.tied_weights()

    def finish(self) -> None:
        """After the units are built: adapters into them (``config.lora``), the tie, and everything that
        does not train frozen. The values come later: :func:`mobius.models.build_model` builds the model on
        the meta device and then sets each weight once (a checkpoint's, or drawn by :meth:`init_unit`)."""
        from mobius.models import lora

        if self.config.lora is not None:
            for k, unit in enumerate(self.units()):
                lora.adapt(unit, "embed" if k == 0 else "head" if k == len(self.blocks) + 1 else "block", self.config)
        self.tie_weights()
        for name, p in self.named_parameters():
            p.requires_grad_(lora.trains(self.config, name))

    def tie_weights(self) -> None:
        """Make the second name of every tied pair the first one's Parameter."""
        for a, b in self.tied_weights():
            owner, leaf = b.rsplit(".", 1)
            setattr(self.get_submodule(owner), leaf, self.get_parameter(a))

    INIT_STD = 0.02
    RESIDUAL_SUFFIXES: tuple[str, ...] = ()  # output projections scaled by 1/sqrt(2 * layers)

    @classmethod
    def init_unit(cls, cfg: object, unit: nn.Module, index: int, seed: int, base: bool = True,
                  adapters: bool = True) -> None:
        """Initialise unit ``index`` (built alone or inside the model, its parameters in memory) as every
        mode does: its base weights from the generator of (``seed``, ``index``) (:func:`init_unit_`), its
        adapters from their own (:func:`~mobius.models.lora.init_adapters`); ``base`` or ``adapters``
        False leaves those alone. Each unit's draws depend on nothing else, so pipeline stages and zero
        ranks initialise any single unit as the whole model does, and units may be drawn in any order."""
        if base:
            is_head = index == cfg.num_layers + 1
            skip = {head.split(".", 1)[1] for _, head in cfg.tied_weights()} if is_head else set()
            init_unit_(unit, index, seed, cls.INIT_STD, cfg.num_layers, skip, cls.RESIDUAL_SUFFIXES)
        if adapters and cfg.lora is not None:
            from mobius.models.lora import init_adapters

            init_adapters(unit, unit_seed(seed, -2, -2, index))

    def forward(self, input_ids: torch.Tensor, docs: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [B, T] -> logits [B, T, V]; ``docs`` [B, D]: each row's document lengths (host memory)."""
        return run_units(self.units(), input_ids, docs=docs)


def init_unit_(unit: nn.Module, index: int, seed: int, std: float, n_layer: int, skip: set[str],
               residual_suffixes: tuple[str, ...] = ()) -> None:
    """GPT-style initialisation of one unit from a generator seeded by (seed, unit index):
    weights N(0, std), residual output projections N(0, std / sqrt(2 n_layer)), zero biases,
    unit norm gains (LayerNorm and RMSNorm). Parameters in ``skip`` (a tied head weight: the embedding's, initialised
    with it) are left alone."""
    gen = torch.Generator().manual_seed(unit_seed(seed, -1, -1, index))
    with torch.no_grad():
        for name, p in unit.named_parameters():
            if name in skip or ".lora_" in f".{name}":  # adapters: their own draws (mobius.models.lora)
                continue
            if p.dim() == 1:
                p.fill_(1.0) if ("ln" in name or "norm" in name) and name.endswith("weight") else p.zero_()
                continue
            s = std / math.sqrt(2 * n_layer) if name.endswith(residual_suffixes) else std
            p.normal_(0.0, 1.0, generator=gen).mul_(s)  # torch.randn(p.shape, generator=gen) * s, in place


def bind_parameters(unit: nn.Module, prefix: str, tensor_of: Callable[[str], torch.Tensor],
                    requires_grad: bool | Callable[[str], bool],
                    grad_of: Callable[[str], torch.Tensor | None] | None = None) -> list[tuple[str, nn.Parameter]]:
    """Point a unit's parameters at memory the runtime owns (``tensor_of(full name)``: a view of a
    flat buffer) through ``register_parameter``; ``requires_grad`` is one flag or one per name; with
    ``grad_of`` each one's ``.grad`` starts as that view (None: no buffer), so autograd accumulates
    into it in place. Returns the new parameters by full name."""
    wants = requires_grad if callable(requires_grad) else (lambda _: requires_grad)
    bound = []
    for mod_name, mod in unit.named_modules():
        for leaf, _ in list(mod.named_parameters(recurse=False)):
            full = prefix + (f"{mod_name}." if mod_name else "") + leaf
            param = nn.Parameter(tensor_of(full), requires_grad=wants(full))
            if grad_of is not None:
                param.grad = grad_of(full)
            mod.register_parameter(leaf, param)
            bound.append((full, param))
    return bound


def unit_seed(seed: int, step: int, micro_batch: int, unit_index: int) -> int:
    """The dropout seed of one unit on one micro-batch: the same in every execution order,
    process and recomputation, so pipelined and single-device runs draw identical masks."""
    h = seed & 0xFFFFFFFF
    for v in (step, micro_batch, unit_index):
        h = (h * 0x9E3779B97F4A7C15 + v + 1) % (1 << 61)
    return h


def run_units(units: list[nn.Module], x: torch.Tensor, first_index: int = 0,
              dropout_seed: tuple[int, int, int] | None = None, checkpoint_blocks: bool = False,
              docs: torch.Tensor | None = None) -> torch.Tensor:
    """Run consecutive units. ``dropout_seed`` = (seed, step, micro_batch) reseeds the RNG before each
    unit (needed only when dropout is active); ``checkpoint_blocks`` recomputes blocks in backward;
    ``docs`` (a micro-batch's document lengths [B, D], host memory; None: one sequence per row) keeps
    attention and positions within each document."""
    from torch.utils.checkpoint import checkpoint

    packed = None if docs is None else Documents(docs, x.device)  # its masks, made once, serve every unit
    for k, unit in enumerate(units):
        if dropout_seed is not None:
            torch.manual_seed(unit_seed(*dropout_seed, first_index + k))
        if checkpoint_blocks and x.is_floating_point() and torch.is_grad_enabled():
            x = checkpoint(unit, x, packed, use_reentrant=False)
        else:
            x = unit(x, packed)
    return x
