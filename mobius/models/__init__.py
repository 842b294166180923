"""Model families (GPT-2, OPT, the Llama architecture: Llama, Mistral, Qwen2, Qwen3, and its mixtures of experts:
Qwen3-MoE, Mixtral; GPT-OSS): configs, presets, builders and unit descriptions."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Collection, Iterator, Mapping

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from mobius.errors import CheckpointError, ConfigError
from mobius.models import gpt2, gpt_oss, llama, lora, moe, opt
from mobius.models.base import CausalLM, UnitSpec, lm_loss
from mobius.parallel import usable_cores

log = logging.getLogger(__name__)

ModelConfig = gpt2.GPT2Config | opt.OPTConfig | llama.LlamaConfig | moe.MoeConfig | gpt_oss.GptOssConfig


@dataclass(frozen=True)
class Family:
    name: str
    config_cls: type
    model_cls: type
    unit_specs: Callable[..., list[UnitSpec]]
    presets: dict


FAMILIES: dict[str, Family] = {  # by Hugging Face model_type; the Llama file serves four of them, moe.py two
    "gpt2": Family("gpt2", gpt2.GPT2Config, gpt2.GPT2, gpt2.unit_specs, gpt2.PRESETS),
    "opt": Family("opt", opt.OPTConfig, opt.OPT, opt.unit_specs, opt.PRESETS),
    **{t: Family(t, llama.LlamaConfig, llama.Llama, llama.unit_specs,
                 {k: v for k, v in llama.PRESETS.items() if v.model_type == t}) for t in llama.MODEL_TYPES},
    **{t: Family(t, moe.MoeConfig, moe.MoeLM, moe.unit_specs,
                 {k: v for k, v in moe.PRESETS.items() if v.model_type == t}) for t in moe.MOE_TYPES},
    "gpt_oss": Family("gpt_oss", gpt_oss.GptOssConfig, gpt_oss.GptOss, gpt_oss.unit_specs, gpt_oss.PRESETS),
}


def family_of(cfg: ModelConfig) -> Family:
    return FAMILIES[cfg.family]


class _NoMetaInit(TorchFunctionMode):
    """Random initialisation of meta tensors returns them untouched: there are no values to draw, and
    torch's meta ``normal_`` imports ``torch._dynamo`` (1.2-1.4 s of CPU in every worker process)."""

    INITS = (torch.Tensor.normal_, nn.init.normal_)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.INITS:
            tensor = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


@contextlib.contextmanager
def on_meta() -> Iterator[None]:
    """Build modules on the meta device (shapes only, no memory, no initialisation)."""
    with torch.device("meta"), _NoMetaInit():
        yield


def materialise(module: nn.Module, device: torch.device | str) -> nn.Module:
    """``module.to_empty(device=device)``: memory for a module built :func:`on_meta`, without values. Each
    tensor is a ``torch.empty`` of its shape: ``to_empty``'s ``empty_like`` of a meta tensor runs a Python
    meta function whose first call costs 0.3-0.4 s of CPU in every process that builds a model."""
    return module._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))


def preset_names() -> list[str]:
    return [name for fam in FAMILIES.values() for name in fam.presets]


def get_preset(name: str) -> ModelConfig:
    """A fresh copy of a preset architecture, e.g. ``"gpt2-xl"`` or ``"opt-13b"``."""
    for fam in FAMILIES.values():
        if name in fam.presets:
            return copy.deepcopy(fam.presets[name])
    raise ConfigError(f"unknown model preset {name!r}; known presets: {', '.join(preset_names())}")


def build_model(cfg: ModelConfig, seed: int = 0, given: Mapping[str, torch.Tensor] | None = None,
                source: str = "checkpoint", *, read: Callable[[set[str]], Mapping[str, torch.Tensor]] | None = None,
                device: torch.device | str = "cpu", frozen_dtype: torch.dtype | None = None) -> CausalLM:
    """Build a model for a config, each weight set once: built on the meta device (no torch default
    initialisation), given memory where it will live (``device``; a frozen parameter, LoRA's base, in
    ``frozen_dtype``, fp32 by default), then every unit given values (:func:`fill_unit`, the units in
    parallel threads): a weight the checkpoint holds is copied from there, any other one is drawn from
    its unit's seeded generators, as in every mode (:func:`initial_weights`). The checkpoint's tensors
    are ``given`` (by mobius name; checked against the model's names and shapes, ``source`` naming it
    in errors), or ``read`` one unit at a time (from the names of a unit's parameters, those it holds):
    then no more than a few units' tensors exist beside the model."""
    with on_meta():
        family = family_of(cfg)
        model = family.model_cls(cfg, family.unit_specs(cfg))
    assert not list(model.buffers()), "units hold no buffers (materialise would leave them without values)"
    reading = read is not None
    if given is not None or read is None:
        given = _given_by_name(model, given or {}, source)
        read = lambda names: {n: given[n] for n in names if n in given}  # noqa: E731
    if frozen_dtype is not None:
        for p in model.parameters():
            if not p.requires_grad:
                p.data = p.data.to(frozen_dtype)  # (on the meta device: no values to convert)
    materialise(model, device)  # memory, no values
    model.tie_weights()  # (materialise gave each end of a tied weight its own tensor)
    units = model.units()
    jobs = [(unit, k, _unit_reader(model, unit, k, read, source), None) for k, unit in enumerate(units)]
    fill_units(jobs, cfg, seed, threads=1 if reading else None)  # one unit's checkpoint tensors at a time
    return model


def _unit_reader(model: CausalLM, unit: nn.Module, k: int, read: Callable[[set[str]], Mapping[str, torch.Tensor]],
                 source: str) -> Callable[[], dict[str, torch.Tensor]]:
    """What the checkpoint holds of unit ``k``, by the unit's own names, read when called (in the thread
    that fills the unit), every shape checked against the model's. A tied head weight is not asked for:
    it is the embedding's, read with the embedding's unit."""
    prefix = unit_prefix(k, len(model.units()))
    tied = {head for _, head in model.tied_weights()}

    def given() -> dict[str, torch.Tensor]:
        own = dict(unit.named_parameters())
        out = {n[len(prefix):]: t for n, t in read({prefix + n for n in own} - tied).items()}
        for name, t in out.items():
            if tuple(t.shape) != tuple(own[name].shape):
                raise CheckpointError(f"{source}: weight {prefix + name!r} has shape {tuple(t.shape)}, the model "
                                      f"expects {tuple(own[name].shape)}")
        return out
    return given


def _given_by_name(model: CausalLM, given: Mapping[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
    """``given`` checked against the model's parameters (every name known, every shape equal); a tied
    weight given under the head's name only is the embedding's value too."""
    own = dict(model.named_parameters(remove_duplicate=False))
    extra = sorted(set(given) - set(own))
    if extra:
        raise CheckpointError(f"{source}: unexpected weights {extra[:5]}")
    for key, t in given.items():
        if tuple(t.shape) != tuple(own[key].shape):
            raise CheckpointError(f"{source}: weight {key!r} has shape {tuple(t.shape)}, the model expects "
                                  f"{tuple(own[key].shape)}")
    out = dict(given)
    for embed, head in model.tied_weights():
        if head in out and embed not in out:
            out[embed] = out[head]
    return out


def fill_unit(cfg: ModelConfig, unit: nn.Module, index: int, seed: int, given: Mapping[str, torch.Tensor],
              wanted: Collection[str] | None = None) -> None:
    """Set the values of unit ``index``, whose parameters have memory but no values: each one ``given``
    names (by its name in the unit) is copied from there; the rest of ``wanted`` (None: every parameter)
    is drawn as every mode draws it (:meth:`CausalLM.init_unit`): the unit's base weights when one of
    them is to be drawn (all of them then, as the draws follow one another; a given one replaces its
    draw), its adapters when one of them is. A tied head weight is the embedding's: left alone."""
    params = dict(unit.named_parameters())
    tied = {head.split(".", 1)[1] for _, head in cfg.tied_weights()} if index == cfg.num_layers + 1 else set()
    draw = {n for n in (params if wanted is None else wanted) if n not in given and n not in tied}
    adapters = {n for n in draw if lora.ADAPTER in f".{n}"}
    if draw:
        init = family_of(cfg).model_cls.init_unit
        base = bool(draw - adapters)  # init draws all the unit's base weights, or all its adapters, or both
        touched = [p for n, p in params.items() if (lora.ADAPTER in f".{n}" and adapters) or
                   (lora.ADAPTER not in f".{n}" and base)]
        in_place = all(p.device.type == "cpu" and p.dtype == torch.float32 for p in touched)
        target = unit if in_place else _cpu_twin(cfg, index)  # the draws are fp32 on the CPU in every mode
        init(cfg, target, index, seed, base=base, adapters=bool(adapters))
        if target is not unit:
            drawn = dict(target.named_parameters())
            with torch.no_grad():
                for name in draw:
                    params[name].copy_(drawn[name])
    with torch.no_grad():
        for name, value in given.items():
            if name not in tied:
                params[name].copy_(value)


def _cpu_twin(cfg: ModelConfig, index: int) -> nn.Module:
    """Unit ``index`` alone, fp32 on the CPU, its parameters in memory without values: where the draws of
    a unit whose own parameters are elsewhere (a GPU, a half dtype) are made, as every mode makes them."""
    with on_meta():
        unit = unit_specs(cfg)[index].build()
    return materialise(unit, "cpu")


Given = Mapping[str, torch.Tensor] | Callable[[], Mapping[str, torch.Tensor]]


def fill_units(jobs: list[tuple[nn.Module, int, Given, Collection[str] | None]], cfg: ModelConfig, seed: int,
               threads: int | None = None) -> None:
    """:func:`fill_unit` for each (unit, index, given, wanted), in parallel threads (torch releases the
    GIL; each unit draws from its own generators, so the order changes no value; ``threads``, by default
    :func:`init_threads`), the largest first; a ``given`` that is a function is called in the unit's
    thread (a unit's checkpoint tensors, read then)."""
    def fill(job: tuple) -> None:
        unit, index, given, wanted = job
        fill_unit(cfg, unit, index, seed, given() if callable(given) else given, wanted)

    jobs = sorted(jobs, key=lambda job: -sum(p.numel() for p in job[0].parameters()))
    threads = min(len(jobs), threads or init_threads())
    log.debug("initial weights of %d units in %d threads", len(jobs), threads)
    if threads <= 1:
        for job in jobs:
            fill(job)
        return
    with ThreadPoolExecutor(threads, thread_name_prefix="mobius-init") as pool:
        list(pool.map(fill, jobs))  # (re-raises the first error)


def init_threads() -> int:
    """Threads for the initial weights: this process's CPU threads (``torch.get_num_threads``, a worker's
    share of the cores), at most the cores it may run on."""
    return max(1, min(usable_cores(), torch.get_num_threads()))


def unit_prefix(index: int, num_units: int) -> str:
    """State-dict prefix of unit ``index``: ``embed.``, ``blocks.{i}.`` or ``head.``."""
    if index == 0:
        return "embed."
    if index == num_units - 1:
        return "head."
    return f"blocks.{index - 1}."


def initial_weights(cfg: ModelConfig, units: set[int], seed: int,
                    names: Collection[str] | None = None) -> dict[str, torch.Tensor]:
    """Freshly initialised weights of ``units`` by name (those in ``names`` only, when given), each unit
    built alone on the meta device and drawn as the whole model draws it (a pipeline stage or a zero rank
    never builds the model): a unit's base weights are drawn only when one of them is asked for, its
    adapters only when one of them is (:func:`fill_unit`; a LoRA run's adapters alone, say); a tied head
    weight is the embedding's, so the embedding is drawn for it."""
    specs = unit_specs(cfg)
    embed_of = {head: embed for embed, head in tied_weights(cfg)}
    with on_meta():
        built = {k: specs[k].build() for k in sorted(set(units) | ({0} if embed_of else set()))}
    full = {k: {unit_prefix(k, len(specs)) + n: n for n, _ in u.named_parameters()} for k, u in built.items()}
    asked = set(names) if names is not None else {n for k in units for n in full[k]}
    need = asked | {embed_of[n] for n in asked if n in embed_of}
    wanted = {k: {local for n, local in full[k].items() if n in need} for k in built}
    fill_units([(materialise(built[k], "cpu"), k, {}, wanted[k]) for k in built if wanted[k]], cfg, seed)
    drawn = {n: built[k].get_parameter(local).detach() for k in built for n, local in full[k].items() if n in need}
    return {n: drawn[embed_of.get(n, n)] for n in asked}


def tied_weights(cfg: ModelConfig) -> list[tuple[str, str]]:
    """Tied parameter pairs (embedding name, head name) of a config, without building the model."""
    return cfg.tied_weights()


def dropout_active(cfg: ModelConfig) -> bool:
    """True when any dropout probability of the config is non-zero, the adapters' included (the one
    place that says so)."""
    return cfg.dropout_active() or (cfg.lora is not None and cfg.lora.dropout > 0)


def hidden_size(cfg: ModelConfig) -> int:
    """Width of the activations that cross stage boundaries."""
    return cfg.width


def unit_specs(cfg: ModelConfig) -> list[UnitSpec]:
    """Describe the model's units (embed, blocks, head) without building them (adapted, with their
    frozen parameters counted, under ``cfg.lora``)."""
    specs = family_of(cfg).unit_specs(cfg)
    if cfg.lora is None:
        return specs
    counted: dict[str, tuple[int, int]] = {}
    out = []
    for k, s in enumerate(specs):
        build = _adapted_build(s, cfg, unit_prefix(k, len(specs)))
        if s.signature not in counted:  # every block alike: build one (on the meta device) to count
            with on_meta():
                params = list(build().parameters())
            frozen = sum(p.numel() for p in params if not p.requires_grad)  # (the build froze them)
            counted[s.signature] = (sum(p.numel() for p in params), frozen)
        total, frozen = counted[s.signature]
        out.append(dataclasses.replace(s, build=build, param_count=total, frozen_count=frozen,
                                       signature=f"{s.signature}:{_lora_tag(cfg.lora)}"))
    return out


def _adapted_build(spec: UnitSpec, cfg: ModelConfig, prefix: str) -> Callable[[], nn.Module]:
    """The unit with its adapters, its frozen parameters not requiring gradients (so a profile times
    the backward the run does: input gradients only through frozen weights)."""
    def build() -> nn.Module:
        unit = lora.adapt(spec.build(), spec.kind, cfg)
        for name, p in unit.named_parameters():
            p.requires_grad_(lora.trains(cfg, prefix + name))
        return unit
    return build


def _lora_tag(spec: "lora.LoraSpec") -> str:
    return f"lora{spec.rank}:{'+'.join(spec.targets)}:{'+'.join(spec.train)}"


def tied_param_count(cfg: ModelConfig) -> int:
    """Parameters of the weight the embedding and the head share (0 when untied)."""
    if not cfg.tie_word_embeddings:
        return 0
    return cfg.vocab_size * cfg.embedding_dim


def param_count(cfg: ModelConfig) -> int:
    """Parameters of the model, counting a tied embedding once."""
    return sum(s.param_count for s in unit_specs(cfg)) - tied_param_count(cfg)


__all__ = ["CausalLM", "UnitSpec", "lm_loss", "ModelConfig", "FAMILIES", "family_of", "get_preset",
           "preset_names", "build_model", "fill_unit", "initial_weights", "unit_prefix",
           "tied_weights", "hidden_size", "dropout_active", "unit_specs", "param_count", "tied_param_count"]
