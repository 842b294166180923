"""Hugging Face checkpoints in and out: one explicit key map per family, one conversion loop.

A checkpoint directory holds ``config.json`` and weights as ``model.safetensors``,
``pytorch_model.bin`` or either sharded with a ``*.index.json``. :func:`load_checkpoint` reads one
into a mobius model; :func:`mobius.checkpoint.save_model` (the one checkpoint writer) writes a
directory that ``transformers.AutoModelForCausalLM.from_pretrained`` loads. Missing, unexpected or misshapen keys
and unreadable files are :class:`~mobius.errors.CheckpointError` naming the key or file.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import warnings
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Callable, Iterator, Mapping

import torch

from mobius.errors import CheckpointError, ConfigError
from mobius.models import FAMILIES, ModelConfig, build_model, gpt2, gpt_oss, llama, moe, opt
from mobius.models.base import CausalLM

log = logging.getLogger(__name__)
PICKLE_PROTOCOL_WARNING = "Detected pickle protocol"  # torch's weights-only unpickler, on a plain pickle


# ---------------------------------------------------------------------------------------------
# Named weight transforms: (hf -> mobius, mobius -> hf)
# ---------------------------------------------------------------------------------------------
def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def _transpose(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous()


def _stack(ts: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(ts)  # E x [out, in] -> [E, out, in]


def _unstack(t: torch.Tensor) -> list[torch.Tensor]:
    return list(t.unbind(0))  # views


def _stack_gate_up(ts: list[torch.Tensor]) -> torch.Tensor:
    """Each expert's gate, then each expert's up projection [I, H] -> gate_up [E, 2I, H] (gate rows first)."""
    half = len(ts) // 2
    return torch.cat((torch.stack(ts[:half]), torch.stack(ts[half:])), dim=1)


def _unstack_gate_up(t: torch.Tensor) -> list[torch.Tensor]:
    gate, up = t.chunk(2, dim=1)  # [E, I, H] each (views)
    return [*gate.unbind(0), *up.unbind(0)]


Transform = Callable[..., "torch.Tensor | list[torch.Tensor]"]
TRANSFORMS: dict[str, tuple[Transform, Transform]] = {  # (hf -> mobius, mobius -> hf)
    "identity": (_identity, _identity),
    # GPT-2's Conv1D stores [in, out]; nn.Linear stores [out, in]
    "conv1d_to_linear": (_transpose, _transpose),
    # the Hub's one tensor per expert <-> one fused tensor (a rule whose ``hf`` names several keys)
    "stack_experts": (_stack, _unstack),
    "stack_gate_up": (_stack_gate_up, _unstack_gate_up),
}


@dataclass(frozen=True)
class KeyRule:
    """One mobius tensor and the Hugging Face key it comes from (or keys, in order: a fused tensor of several)."""

    hf: str | tuple[str, ...]
    ours: str
    transform: str = "identity"

    @property
    def keys(self) -> tuple[str, ...]:
        return (self.hf,) if isinstance(self.hf, str) else self.hf


@dataclass(frozen=True)
class KeyMap:
    rules: list[KeyRule]
    prefix: str  # the base-model prefix a checkpoint of the bare model lacks ("transformer.", "model.")
    tied: tuple[str, str] | None  # (hf key of the head's weight, our key of the embedding) when tied
    ignored_suffixes: tuple[str, ...] = ()  # legacy buffers found in old checkpoints
    modules: dict[str, str] | None = None  # our module -> its name in transformers' model in memory, where no one
    # checkpoint key gives it (fused experts) or the checkpoint's differs (Mixtral's block_sparse_moe): PEFT's names


def gpt2_key_map(cfg: gpt2.GPT2Config) -> KeyMap:
    """GPT2LMHeadModel <-> mobius GPT2."""
    rules = [KeyRule("transformer.wte.weight", "embed.wte.weight"), KeyRule("transformer.wpe.weight", "embed.wpe.weight")]
    for i in range(cfg.n_layer):
        h, b = f"transformer.h.{i}.", f"blocks.{i}."
        for hf_name, our_name, tr in [("ln_1", "ln_1", None), ("attn.c_attn", "attn.qkv", "conv1d_to_linear"),
                                      ("attn.c_proj", "attn.proj", "conv1d_to_linear"), ("ln_2", "ln_2", None),
                                      ("mlp.c_fc", "mlp.fc", "conv1d_to_linear"),
                                      ("mlp.c_proj", "mlp.proj", "conv1d_to_linear")]:
            rules.append(KeyRule(f"{h}{hf_name}.weight", f"{b}{our_name}.weight", tr or "identity"))
            rules.append(KeyRule(f"{h}{hf_name}.bias", f"{b}{our_name}.bias"))
    rules += [KeyRule("transformer.ln_f.weight", "head.ln_f.weight"), KeyRule("transformer.ln_f.bias", "head.ln_f.bias")]
    tied = ("lm_head.weight", "embed.wte.weight") if cfg.tie_word_embeddings else None
    if not cfg.tie_word_embeddings:
        rules.append(KeyRule("lm_head.weight", "head.lm_head.weight"))
    return KeyMap(rules, "transformer.", tied, ignored_suffixes=(".attn.bias", ".attn.masked_bias"))


def opt_key_map(cfg: opt.OPTConfig) -> KeyMap:
    """OPTForCausalLM <-> mobius OPT (pre/post-LayerNorm, optional project_in/out)."""
    d = "model.decoder."
    rules = [KeyRule(f"{d}embed_tokens.weight", "embed.embed_tokens.weight"),
             KeyRule(f"{d}embed_positions.weight", "embed.embed_positions.weight")]
    if cfg.projects:
        rules += [KeyRule(f"{d}project_in.weight", "embed.project_in.weight"),
                  KeyRule(f"{d}project_out.weight", "head.project_out.weight")]
    params = ["weight", "bias"] if cfg.enable_bias else ["weight"]
    for i in range(cfg.num_hidden_layers):
        h, b = f"{d}layers.{i}.", f"blocks.{i}."
        for hf_name, our_name in [("self_attn.q_proj", "attn.q_proj"), ("self_attn.k_proj", "attn.k_proj"),
                                  ("self_attn.v_proj", "attn.v_proj"), ("self_attn.out_proj", "attn.out_proj"),
                                  ("fc1", "fc1"), ("fc2", "fc2")]:
            rules += [KeyRule(f"{h}{hf_name}.{p}", f"{b}{our_name}.{p}") for p in params]
        for hf_name, our_name in [("self_attn_layer_norm", "ln_1"), ("final_layer_norm", "ln_2")]:
            rules += [KeyRule(f"{h}{hf_name}.{p}", f"{b}{our_name}.{p}") for p in ("weight", "bias")]
    if cfg.has_final_layer_norm:
        rules += [KeyRule(f"{d}final_layer_norm.{p}", f"head.final_layer_norm.{p}") for p in ("weight", "bias")]
    tied = ("lm_head.weight", "embed.embed_tokens.weight") if cfg.tie_word_embeddings else None
    if not cfg.tie_word_embeddings:
        rules.append(KeyRule("lm_head.weight", "head.lm_head.weight"))
    return KeyMap(rules, "model.", tied)


def llama_key_map(cfg: llama.LlamaConfig) -> KeyMap:
    """LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM <-> mobius Llama
    (the same names below ``model.layers.{i}``; which biases and norms exist follows the config)."""
    rules = [KeyRule("model.embed_tokens.weight", "embed.embed_tokens.weight")]
    attention = [("q_proj", cfg.qkv_bias), ("k_proj", cfg.qkv_bias), ("v_proj", cfg.qkv_bias),
                 ("o_proj", cfg.attention_bias)]
    for i in range(cfg.num_hidden_layers):
        h, b = f"model.layers.{i}.", f"blocks.{i}."
        names = ["input_layernorm.weight", "post_attention_layernorm.weight"]
        for proj, bias in attention:
            names += [f"self_attn.{proj}.weight"] + ([f"self_attn.{proj}.bias"] if bias else [])
        if cfg.qk_norm:
            names += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
        for proj in ("gate_proj", "up_proj", "down_proj"):
            names += [f"mlp.{proj}.weight"] + ([f"mlp.{proj}.bias"] if cfg.mlp_bias else [])
        rules += [KeyRule(h + n, b + n) for n in names]
    rules.append(KeyRule("model.norm.weight", "head.norm.weight"))
    tied = ("lm_head.weight", "embed.embed_tokens.weight") if cfg.tie_word_embeddings else None
    if not cfg.tie_word_embeddings:
        rules.append(KeyRule("lm_head.weight", "head.lm_head.weight"))
    return KeyMap(rules, "model.", tied, ignored_suffixes=(".rotary_emb.inv_freq",))


def moe_key_map(cfg: moe.MoeConfig) -> KeyMap:
    """Qwen3MoeForCausalLM, MixtralForCausalLM <-> mobius MoeLM: attention and norms as Llama's; the router and
    each expert's projections in the Hub's per-expert layout (what transformers' ``save_pretrained`` writes):
    ``mlp.experts.{e}.{gate,up,down}_proj.weight`` (Qwen3-MoE), ``block_sparse_moe.experts.{e}.w{1,3,2}.weight``
    (Mixtral), fused into ``mlp.experts.gate_up_proj`` [E, 2I, H] (gate rows, then up) and ``down_proj``."""
    dense = llama_key_map(cfg)
    rules = [r for r in dense.rules if ".mlp." not in r.ours]
    modules: dict[str, str] = {}
    mixtral = cfg.model_type == "mixtral"
    gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    for i in range(cfg.num_hidden_layers):
        h, b = f"model.layers.{i}.{'block_sparse_moe' if mixtral else 'mlp'}.", f"blocks.{i}.mlp."
        if i not in cfg.moe_layers:
            rules += [KeyRule(f"{h}{p}.weight", f"{b}{p}.weight") for p in ("gate_proj", "up_proj", "down_proj")]
            continue
        each = lambda proj: tuple(f"{h}experts.{e}.{proj}.weight" for e in range(cfg.num_experts))  # noqa: E731
        rules += [KeyRule(f"{h}gate.weight", f"{b}gate.weight"),
                  KeyRule(each(gate) + each(up), f"{b}experts.gate_up_proj", "stack_gate_up"),
                  KeyRule(each(down), f"{b}experts.down_proj", "stack_experts")]
        modules.update({f"{b}gate": f"model.layers.{i}.mlp.gate", f"{b}experts": f"model.layers.{i}.mlp.experts"})
    return KeyMap(rules, dense.prefix, dense.tied, dense.ignored_suffixes, modules)


def gpt_oss_key_map(cfg: gpt_oss.GptOssConfig) -> KeyMap:
    """GptOssForCausalLM <-> mobius GptOss: the same names below ``model.layers.{i}`` (bf16 weights: the Hub's
    fused experts, [E, H, 2I] and [E, I, H], as transformers holds them)."""
    rules = [KeyRule("model.embed_tokens.weight", "embed.embed_tokens.weight")]
    modules = {}
    for i in range(cfg.num_hidden_layers):
        h, b = f"model.layers.{i}.", f"blocks.{i}."
        names = ["input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.sinks",
                 *[f"self_attn.{p}.{w}" for p in ("q_proj", "k_proj", "v_proj", "o_proj") for w in ("weight", "bias")],
                 "mlp.router.weight", "mlp.router.bias", "mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj_bias",
                 "mlp.experts.down_proj", "mlp.experts.down_proj_bias"]
        rules += [KeyRule(h + n, b + n) for n in names]
        modules[f"{b}mlp.experts"] = f"{h}mlp.experts"
    rules.append(KeyRule("model.norm.weight", "head.norm.weight"))
    tied = ("lm_head.weight", "embed.embed_tokens.weight") if cfg.tie_word_embeddings else None
    if not cfg.tie_word_embeddings:
        rules.append(KeyRule("lm_head.weight", "head.lm_head.weight"))
    return KeyMap(rules, "model.", tied, modules=modules)


KEY_MAPS: dict[str, Callable[..., KeyMap]] = {"gpt2": gpt2_key_map, "opt": opt_key_map,
                                              **{t: llama_key_map for t in llama.MODEL_TYPES},
                                              **{t: moe_key_map for t in moe.MOE_TYPES}, "gpt_oss": gpt_oss_key_map}
HF_ARCHITECTURES = {"gpt2": "GPT2LMHeadModel", "opt": "OPTForCausalLM", "llama": "LlamaForCausalLM",
                    "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                    "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM", "gpt_oss": "GptOssForCausalLM"}


# ---------------------------------------------------------------------------------------------
# The one conversion loop
# ---------------------------------------------------------------------------------------------
def _normalise_key(key: str, km: KeyMap) -> str:
    """Checkpoints of the bare model (GPT2Model, OPTModel) lack the base prefix."""
    if key.startswith(km.prefix) or key.startswith("lm_head."):
        return key
    return km.prefix + key


def from_hf(hf_state: Mapping[str, torch.Tensor], cfg: ModelConfig,
            only: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor]:
    """Convert a Hugging Face state dict to mobius names (the tied head included under its own name).

    ``hf_state`` may be lazy (:class:`LazyCheckpoint`): keys are all checked, but only tensors whose
    mobius name passes ``only`` are read (a pipeline worker loads just its stages).
    """
    km = KEY_MAPS[cfg.family](cfg)
    names = {_normalise_key(k, km): k for k in hf_state.keys()}
    out: dict[str, torch.Tensor] = {}
    for rule in km.rules:
        for key in rule.keys:
            if key not in names:
                raise CheckpointError(f"checkpoint is missing key {key!r} (needed for {rule.ours})")
        if only is None or only(rule.ours) or (km.tied and rule.ours == km.tied[1] and only("head.lm_head.weight")):
            tensors = [hf_state[names[key]] for key in rule.keys]
            out[rule.ours] = TRANSFORMS[rule.transform][0](tensors[0] if isinstance(rule.hf, str) else tensors)
    used = {key for r in km.rules for key in r.keys}
    if km.tied is not None:
        head_key, embed_key = km.tied
        if embed_key in out:
            out["head.lm_head.weight"] = out[embed_key]
        if head_key in names and embed_key in out and not torch.equal(hf_state[names[head_key]], out[embed_key]):
            log.warning("checkpoint's %s differs from the tied embedding; using the embedding (as transformers does)",
                        head_key)
        used.add(head_key)
    unexpected = sorted(k for k in names if k not in used and not k.endswith(km.ignored_suffixes))
    if unexpected:
        more = f" (and {len(unexpected) - 5} more)" if len(unexpected) > 5 else ""
        raise CheckpointError(f"checkpoint has unexpected keys {unexpected[:5]}{more} for a {cfg.family} model "
                              f"of this configuration")
    if only is not None:
        out = {k: v for k, v in out.items() if only(k)}
    return out


def to_hf(state: dict[str, torch.Tensor], cfg: ModelConfig, partial: bool = False) -> dict[str, torch.Tensor]:
    """Convert a mobius state dict to Hugging Face names (the inverse of :func:`from_hf`).
    ``partial``: convert what is there (one pipeline worker's stages) instead of requiring all."""
    km = KEY_MAPS[cfg.family](cfg)
    out: dict[str, torch.Tensor] = {}
    for rule in km.rules:
        if rule.ours not in state:
            if partial:
                continue
            raise CheckpointError(f"model state is missing {rule.ours!r}")
        converted = TRANSFORMS[rule.transform][1](state[rule.ours])
        out.update({rule.hf: converted} if isinstance(rule.hf, str) else zip(rule.hf, converted, strict=True))
    if km.tied is not None:
        embed_hf = next(r.hf for r in km.rules if r.ours == km.tied[1])
        if embed_hf in out:
            out[km.tied[0]] = out[embed_hf]
        elif "head.lm_head.weight" in state:
            out[km.tied[0]] = state["head.lm_head.weight"]
    return out


# ---------------------------------------------------------------------------------------------
# Configs
# ---------------------------------------------------------------------------------------------
UNSUPPORTED = {  # HF config fields whose non-default values this implementation does not model
    "gpt2": {"add_cross_attention": False, "scale_attn_weights": True},
    "opt": {"_remove_final_layer_norm": False, "layerdrop": 0.0},
    **{t: {"pretraining_tp": 1, "partial_rotary_factor": 1.0, "quantization_config": None,
           "is_encoder_decoder": False, "add_cross_attention": False} for t in (*llama.MODEL_TYPES, *moe.MOE_TYPES)},
    "gpt_oss": {"pretraining_tp": 1, "partial_rotary_factor": 1.0, "is_encoder_decoder": False},
}
MXFP4_ADVICE = ("mobius trains floating-point experts: load it in transformers with "
                "quantization_config=Mxfp4Config(dequantize=True) and save_pretrained it in bf16, or use a bf16 copy")
NOT_IN_FAMILY = {  # fields a family's own config has no such thing as: present and set, they are errors
    "mistral": ("attention_bias", "mlp_bias", "use_sliding_window", "max_window_layers"),
    "qwen2": ("attention_bias", "mlp_bias"),
    "qwen3": ("mlp_bias",),
    "llama": ("use_sliding_window", "sliding_window", "max_window_layers"),
    "qwen3_moe": ("mlp_bias",),
    "mixtral": ("attention_bias", "mlp_bias", "use_sliding_window", "max_window_layers", "moe_intermediate_size",
                "decoder_sparse_step", "mlp_only_layers", "norm_topk_prob"),
}
MOE_MARKS = ("expert", "moe", "router", "decoder_sparse_step", "mlp_only_layers")  # mixture-of-experts fields
MOE_RUNTIME_FIELDS = ("output_router_logits",)  # transformers' switch to return router logits: not architecture


def config_from_hf(hf: dict, source: str = "config.json") -> ModelConfig:
    """Build a mobius model config from a Hugging Face ``config.json`` dict. A field this
    implementation does not model (set to something other than its neutral value) is an error."""
    model_type = hf.get("model_type")
    if model_type not in FAMILIES:
        raise CheckpointError(f"{source}: model_type {model_type!r} is not supported (supported: {', '.join(FAMILIES)})")
    for key, default in UNSUPPORTED[model_type].items():
        if hf.get(key) is not None and hf[key] != default:
            raise CheckpointError(f"{source}: {key}={hf[key]!r} is not supported (only {default!r})")
    if model_type in (*llama.MODEL_TYPES, *moe.MOE_TYPES):
        return _llama_config_from_hf(hf, model_type, source)
    if model_type == "gpt_oss":
        return _gpt_oss_config_from_hf(hf, source)
    cls = FAMILIES[model_type].config_cls
    aliases = {"n_ctx": "n_positions"} if model_type == "gpt2" else {}
    kwargs = {}
    for f in fields(cls):
        for key in (f.name, *[a for a, t in aliases.items() if t == f.name]):
            if key in hf and hf[key] is not None:
                kwargs[f.name] = hf[key]
                break
    return cls(**kwargs)


def _llama_config_from_hf(hf: dict, model_type: str, source: str) -> llama.LlamaConfig:
    """Llama-architecture config.json, dense or with experts (transformers 4's rope_theta / rope_scaling or 5's
    rope_parameters; an MoE's expert count as ``num_experts`` or ``num_local_experts``)."""
    cls = FAMILIES[model_type].config_cls
    if cls is llama.LlamaConfig:
        for key, value in hf.items():
            if any(mark in key for mark in MOE_MARKS) and value not in (None, 0, False, [], {}):
                raise CheckpointError(f"{source}: {key}={value!r} is not supported for model_type {model_type!r} "
                                      f"(its mixture-of-experts families are {', '.join(moe.MOE_TYPES)})")
    for key in NOT_IN_FAMILY[model_type]:
        if hf.get(key) not in (None, False):
            raise CheckpointError(f"{source}: {key}={hf[key]!r} is not supported for model_type {model_type!r}")
    kwargs = {f.name: hf[f.name] for f in fields(cls) if hf.get(f.name) is not None}
    kwargs["model_type"] = model_type
    if cls is moe.MoeConfig and hf.get("num_local_experts") is not None:
        kwargs["num_experts"] = hf["num_local_experts"]
    rope = hf.get("rope_parameters") or hf.get("rope_scaling")
    if rope is not None:
        if not isinstance(rope, dict) or any(isinstance(v, dict) for v in rope.values()):
            raise CheckpointError(f"{source}: rope_parameters={rope!r} is not supported (one rotation for all layers)")
        rope = dict(rope)
        if "rope_theta" in rope:
            kwargs["rope_theta"] = rope.pop("rope_theta")
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise CheckpointError(f"{source}: partial_rotary_factor={rope['partial_rotary_factor']!r} is not "
                                  f"supported (only 1.0)")
        rope.pop("partial_rotary_factor", None)
        kwargs["rope_scaling"] = rope
    layer_types = hf.get("layer_types") or []
    odd = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if odd:
        raise CheckpointError(f"{source}: layer_types entry {odd[0]!r} is not supported")
    if "sliding_attention" in layer_types and hf.get("sliding_window") is not None and model_type != "mistral":
        kwargs.update(use_sliding_window=True, max_window_layers=layer_types.index("sliding_attention"))
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise CheckpointError(f"{source}: {e}") from None


def _gpt_oss_config_from_hf(hf: dict, source: str) -> gpt_oss.GptOssConfig:
    """GPT-OSS's config.json (rope_theta and YaRN's rope_scaling, or transformers 5's rope_parameters); an MXFP4
    checkpoint is refused (:data:`MXFP4_ADVICE`)."""
    quant = hf.get("quantization_config")
    if quant is not None:
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise CheckpointError(f"{source}: quantization_config quant_method={method!r} is not supported; "
                              f"{MXFP4_ADVICE}")
    kwargs = {f.name: hf[f.name] for f in fields(gpt_oss.GptOssConfig) if hf.get(f.name) is not None}
    rope = hf.get("rope_parameters") or hf.get("rope_scaling")
    if rope is not None:
        rope = dict(rope)
        if "rope_theta" in rope:
            kwargs["rope_theta"] = rope.pop("rope_theta")
        kwargs["rope_scaling"] = rope
    try:
        return gpt_oss.GptOssConfig(**kwargs)
    except ConfigError as e:
        raise CheckpointError(f"{source}: {e}") from None


def config_to_hf(cfg: ModelConfig, dtype: torch.dtype) -> dict:
    """A ``config.json`` dict that transformers reads back into the same architecture."""
    d = asdict(cfg)
    d.update(model_type=cfg.family, architectures=[HF_ARCHITECTURES[cfg.family]],
             torch_dtype=str(dtype).removeprefix("torch."))
    d.pop("lora")  # adapters are not part of the architecture (they are saved in PEFT's format)
    if cfg.family == "gpt2":
        d.update(n_ctx=cfg.n_positions, n_inner=cfg.n_inner)
    if cfg.family in (*llama.MODEL_TYPES, *moe.MOE_TYPES):
        for key in NOT_IN_FAMILY[cfg.family]:
            d.pop(key, None)
    if cfg.family == "mixtral":
        d["num_local_experts"] = d.pop("num_experts")
    if cfg.family in moe.MOE_TYPES:
        d["output_router_logits"] = False
    return d


# ---------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------
WEIGHT_FILES = ("model.safetensors.index.json", "model.safetensors", "pytorch_model.bin.index.json", "pytorch_model.bin")


def read_config(path: str | os.PathLike) -> ModelConfig:
    """Read ``<path>/config.json`` into a mobius model config."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise CheckpointError(f"{path}: not a Hugging Face checkpoint directory (no config.json)")
    try:
        hf = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file}: cannot be read as JSON ({e})") from e
    return config_from_hf(hf, str(file))


def _weight_files(path: Path) -> list[Path]:
    for name in WEIGHT_FILES:
        f = path / name
        if not f.is_file():
            continue
        if not name.endswith(".index.json"):
            return [f]
        try:
            weight_map = json.loads(f.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{f}: not a valid shard index ({e})") from e
        shards = [path / s for s in dict.fromkeys(weight_map.values())]
        for s in shards:
            if not s.is_file():
                raise CheckpointError(f"{f} names shard {s.name}, which is missing")
        return shards
    raise CheckpointError(f"{path}: no weights found (looked for {', '.join(WEIGHT_FILES)})")


class LazyCheckpoint(Mapping[str, torch.Tensor]):
    """The tensors of a checkpoint directory by Hugging Face name, read from disk on access."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._where: dict[str, Path] = {}
        for file in _weight_files(self.path):
            for key in _keys_of(file):
                self._where[key] = file
        self._bins: dict[Path, dict] = {}

    def __getitem__(self, key: str) -> torch.Tensor:
        file = self._where[key]
        try:
            if file.suffix == ".safetensors":
                from safetensors import safe_open

                with safe_open(str(file), framework="pt") as f:
                    return f.get_tensor(key)
            if file not in self._bins:
                self._bins[file] = _load_bin(file)
            return self._bins[file][key]
        except Exception as e:
            raise CheckpointError(f"{file}: cannot read {key} ({type(e).__name__}: {e})") from e

    def shape(self, key: str) -> tuple[int, ...]:
        """A tensor's shape, from its file's header (a ``.bin`` file is memory-mapped)."""
        file = self._where[key]
        if file.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(file), framework="pt") as f:
                return tuple(f.get_slice(key).get_shape())
        return tuple(self[key].shape)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def _load_bin(file: Path) -> dict[str, torch.Tensor]:
    """A ``.bin`` state dict through torch's weights-only unpickler (tensors only, never code),
    memory-mapped when the file is in the zip format (legacy files are read whole). Torch's warning that a
    plain pickle's protocol is not its own is silenced: the unpickler reads the file or mobius refuses it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=PICKLE_PROTOCOL_WARNING)
        try:
            return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            return torch.load(file, map_location="cpu", weights_only=True)


def _keys_of(file: Path) -> list[str]:
    try:
        if file.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(file), framework="pt") as f:
                return list(f.keys())
        return list(_load_bin(file).keys())
    except pickle.UnpicklingError:
        raise CheckpointError(f"{file}: cannot be read: it holds objects other than tensors, and pickled code is "
                              f"never loaded") from None
    except Exception as e:
        raise CheckpointError(f"{file}: cannot be read, the file is truncated or corrupt ({type(e).__name__}: {e})") from e


def read_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory, by their Hugging Face names."""
    lazy = LazyCheckpoint(path)
    return {key: lazy[key] for key in lazy}


def load_checkpoint(path: str | os.PathLike, cfg: ModelConfig | None = None,
                    dtype: torch.dtype = torch.float32) -> CausalLM:
    """Load a Hugging Face checkpoint directory into a new mobius model on the CPU (in eval mode); under
    ``cfg.lora`` the checkpoint is the base model and the adapters are drawn from seed 0."""
    cfg = cfg or read_config(path)
    model = build_model(cfg, 0, from_hf(LazyCheckpoint(path), cfg), source=str(path))
    return model.to(dtype).eval()
