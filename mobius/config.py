"""Run configuration: typed dataclasses, one YAML loader, ``--section.key=value`` overrides.

Every field carries its documentation in ``metadata["help"]``; ``mobius train --help`` prints them.
Unknown keys, wrong types and impossible values are :class:`~mobius.errors.ConfigError` naming the
file and the key path. Paths a user must fill in are written ``<FILL IN: what>`` in the shipped
configs; :meth:`Config.check_ready` rejects them with a message that says what to put there.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from mobius.errors import ConfigError

PLACEHOLDER = "<FILL IN"
ScheduleName = Literal["swapped", "round_robin", "auto"]  # parallel.schedule


def _f(default: Any, help: str, *, ge: float | None = None, gt: float | None = None, le: float | None = None,
       lt: float | None = None, **kw: Any) -> Any:
    """A config field: its default, its documentation and, for numbers, its domain (every float
    must also be finite); :class:`_Section` checks the domain wherever the section is built."""
    domain = {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt)) if v is not None}
    meta = {"help": help, "domain": domain, **kw}
    if isinstance(default, list):  # a fresh list for every section built
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


_BOUNDS = {"ge": (">=", lambda x, b: x >= b), "gt": (">", lambda x, b: x > b), "le": ("<=", lambda x, b: x <= b),
           "lt": ("<", lambda x, b: x < b)}


def domain_text(f: dataclasses.Field) -> str:
    """The field's domain in words, e.g. ``> 0`` or ``>= 0 and < 1`` (empty when unbounded)."""
    return " and ".join(f"{_BOUNDS[k][0]} {v:g}" for k, v in f.metadata.get("domain", {}).items())


class _Section:
    """Checks every number of a section against the domain its field declares."""

    _name = "section"

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            where = f"{self._name}.{f.name}"
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{where} must be a finite number, got {value}")
            for k, bound in f.metadata.get("domain", {}).items():
                if not _BOUNDS[k][1](value, bound):
                    raise ConfigError(f"{where} must be {domain_text(f)}, got {value:g}")


@dataclass
class ModelSection(_Section):
    _name = "model"
    checkpoint: str | None = _f(None, "Hugging Face checkpoint directory to fine-tune (config.json + weights).")
    preset: str | None = _f(None, "Architecture preset, e.g. gpt2-tiny, opt-13b, llama-3.1-8b, qwen2.5-14b, qwen3-32b, "
                            "mistral-7b (mobius plan --help lists them all): trained from scratch when "
                            "no checkpoint is given; with a checkpoint, the architecture it must have (and what "
                            "'mobius plan' uses before the checkpoint is at hand).")
    dropout: float | None = _f(None, "Set every dropout probability to this; null keeps the checkpoint's or preset's.",
                               ge=0, lt=1)
    activation_checkpointing: bool = _f(False, "Recompute each unit's activations in backward (single and zero "
                                        "modes; the pipeline decides per stage: parallel.kept_stages).")
    router_aux_loss_coef: float | None = _f(None, "Mixture-of-experts models: the weight of the router's "
                                            "load-balancing loss (transformers' aux_loss, over every MoE layer) in "
                                            "the training loss, beside the mean next-token loss; each step adds it "
                                            "times the mean of its micro-batches' aux losses. null: the "
                                            "checkpoint's router_aux_loss_coef (mobius adds it whatever the "
                                            "checkpoint's output_router_logits says); 0: none.", ge=0)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.checkpoint is None and self.preset is None:
            raise ConfigError("set model.checkpoint (a Hugging Face directory) or model.preset (an architecture)")


@dataclass
class DataSection(_Section):
    _name = "data"
    path: str = _f("builtin:stdlib-docs", "A .txt, .jsonl, .json (a list of records) or .parquet file, or a directory "
                   "of them. 'builtin:stdlib-docs' gathers the docstrings of Python's standard library (the CPU demo); "
                   "'builtin:stdlib-chat' makes conversations of them (the chat demo).")
    format: Literal["auto", "text", "chat"] = _f("auto", "text: documents (a .txt file, or data.text_field of each "
                                                  "record); chat: conversations (records with messages, ShareGPT "
                                                  "conversations, Alpaca instruction/input/output, or prompt/"
                                                  "completion); auto: per file, by its first record.")
    text_field: str = _f("text", "Field holding the text in records (data.format text).")
    chat_template: str | None = _f(None, "Conversations: a Jinja chat template file, or builtin:NAME for one shipped "
                                   "with mobius (builtin:demo-chat); null: the tokenizer's own (chat_template.jinja "
                                   "beside it, or chat_template in its tokenizer_config.json).")
    train_on: Literal["assistant", "all"] = _f("assistant", "Conversations: the tokens that take a loss: assistant "
                                               "(each answer and the end-of-turn text the template writes after it; "
                                               "not the prompts nor the headers) or all.")
    packing: bool = _f(True, "Conversations: pack several whole conversations into each sequence of data.seq_len "
                       "positions (attention and positions restart at each; none is split); false: one conversation "
                       "per sequence, padded. Text is always read as blocks running across documents.")
    truncation: Literal["drop", "truncate"] = _f("drop", "Conversations longer than data.seq_len + 1 tokens: drop "
                                                 "them, or truncate them to their first data.seq_len + 1 (left out "
                                                 "if no target is left); counted and reported either way.")
    seq_len: int = _f(512, "Positions per training sequence (text documents run across blocks of this length; "
                      "conversations are packed whole into them).", ge=2)
    tokenizer: str | None = _f(None, "A tokenizer.json file or a directory holding one; null uses the checkpoint's "
                               "own, or byte-level tokens when training from scratch.")
    val_fraction: float = _f(0.02, "Fraction of the blocks (text) or conversations held out for evaluation.", ge=0,
                             lt=0.5)
    cache_dir: str = _f(".mobius_cache", "Where tokenized data is cached as memory-mapped arrays.")
    accept_new_data: bool = _f(False, "--resume on data whose content differs from what the checkpoint trained on "
                               "(files edited, added or removed; a content fingerprint is stored with every "
                               "checkpoint): false stops, naming the change; true continues the checkpoint's weights, "
                               "optimizer and step on the new data, read from its start in a fresh order.")


@dataclass
class TrainSection(_Section):
    _name = "train"
    max_steps: int = _f(100, "Optimizer steps to run.", ge=1)
    micro_batch_size: int = _f(4, "Sequences per micro-batch.", ge=1)
    micro_batches: int = _f(4, "Micro-batches per optimizer step (gradient accumulation / pipeline depth).", ge=1)
    lr: float = _f(3e-4, "Peak learning rate (AdamW).", gt=0)
    min_lr_ratio: float = _f(0.1, "Cosine decay ends at lr * min_lr_ratio.", ge=0, le=1)
    warmup_steps: int = _f(10, "Linear warm-up steps.", ge=0)
    weight_decay: float = _f(0.0, "AdamW decoupled weight decay (applied to matrices, not biases or norms).", ge=0)
    beta1: float = _f(0.9, "AdamW beta1.", ge=0, lt=1)
    beta2: float = _f(0.95, "AdamW beta2.", ge=0, lt=1)
    eps: float = _f(1e-8, "AdamW epsilon.", gt=0)
    grad_clip: float = _f(1.0, "Clip the global gradient norm to this; 0 disables clipping.", ge=0)
    seed: int = _f(1234, "Seed for initialisation, data order and dropout.", ge=0)
    precision: Literal["fp32", "bf16", "fp16"] = _f("fp32", "fp32, bf16 (autocast) or fp16 (autocast with dynamic "
                                                     "loss scaling).")
    eval_every: int = _f(50, "Evaluate on the held-out blocks every N steps (0: only at the end).", ge=0)
    eval_batches: int = _f(8, "Micro-batches per evaluation.", ge=1)
    log_every: int = _f(1, "Write a metrics line every N steps.", ge=1)
    update: Literal["sync", "delayed"] = _f("sync", "sync: each step computes with the newest weights. delayed "
                                            "(RoundPipe's one-step-delayed update): each step computes with the "
                                            "weights one update older than the newest (step t with w_{t-2}; steps 1 "
                                            "and 2 with the initial ones), the schedule that lets an update run while "
                                            "the next step computes; each update is the sync one (AdamW on the newest "
                                            "weights, clipping and fp16 loss scaling from its step's gradients). "
                                            "Costs up to one more copy of what trains in memory and one more fp32 "
                                            "copy in resumable checkpoints. Runs in every parallel.mode.")
    optimizer_states: Literal["fp32", "bf16", "int8"] = _f(
        "fp32", "Precision of AdamW's two moments, in host memory and on GPUs alike (the master weights stay fp32): "
        "fp32 (8 bytes per trained parameter: torch's fused AdamW); bf16 (4 bytes: updated in fp32, stored with "
        "stochastic rounding); int8 (2.125 bytes: 8-bit codes with a scale per block of 64 elements, "
        "docs/optimizer-states.md). Fewer bytes also make the CPU update faster. A checkpoint keeps the moments in "
        "this precision; resuming one written with another converts them once.")

    @property
    def barrier(self) -> bool:
        """Whether a step's updates must wait for the global gradient norm: clipping scales every
        gradient by it, and fp16 loss scaling skips the step on overflow. The plans carry it."""
        return self.grad_clip > 0 or self.precision == "fp16"

    @property
    def delayed(self) -> bool:
        """Whether a step computes with the weights one update older (``update: delayed``). The plans carry it
        (``PlanRequest.delayed``, ``PipelineOptions.delayed``, ``ZeroPlan.delayed``), the engines read it there."""
        return self.update == "delayed"


@dataclass
class ParallelSection(_Section):
    _name = "parallel"
    mode: Literal["auto", "single", "pipeline", "zero"] = _f("auto", "single: one device; pipeline: the swapped "
                                                              "Mobius pipeline; zero: chunked ZeRO (NVLink boxes); "
                                                              "auto: plans all three and runs the fastest predicted "
                                                              "one that fits (zero when every GPU shares NVLink), "
                                                              "logging why.")
    devices: int = _f(1, "GPUs to use (CPU worker processes stand in when there is no GPU).", ge=1)
    device: Literal["auto", "cpu", "cuda"] = _f("auto", "Run on CUDA when available (auto), or force cpu/cuda.")
    mapping: Literal["cross", "sequential"] = _f("cross", "Stage-to-GPU mapping: cross (topology-aware) or sequential.")
    prefetch: bool = _f(True, "Upload the next stage (pipeline: into a second device slot or, where two do not "
                        "fit, its first bytes into a buffer in the memory that remains) or gather the next "
                        "unit's chunks (zero) while the current one computes.")
    p2p: Literal["auto", "on", "off"] = _f("auto", "GPU peer-to-peer for activations: auto-detect, force on, force off "
                                          "(through pinned host memory).")
    offload_inputs: Literal["auto", "on", "off"] = _f("auto", "Keep each stage's boundary inputs in host memory "
                                                      "between its forward and backward: auto (when GPU memory "
                                                      "is short), on, off.")
    trace_step: int = _f(0, "Write a Chrome trace (Perfetto) of this training step to output.dir (0: none); "
                         "same tracks as the simulator's trace from 'mobius plan --trace', and the dispatch thread's. "
                         "The traced step runs as any other (its CPU updates beside the next step); the next step "
                         "waits for them to write the trace: its metrics line says traced, and it is left out of the "
                         "run's measured medians (the run's last step, traced, waits for its own).", ge=0)
    schedule: ScheduleName = _f(
        "swapped", "The pipeline's schedule: swapped (Mobius: stages bound to GPUs, swapped in and out), round_robin "
        "(RoundPipe's class: every op goes to the next GPU in rotation, separate forward and backward cuts, the "
        "workers share the weights in host memory; one machine, at least 2 workers), or auto (plans both and runs the "
        "faster predicted one). round_robin and auto print both predictions in mobius plan.")
    stages: int = _f(0, "Pipeline stages; 0 lets the partitioner choose. A number splits the units evenly "
                     "(for experiments).", ge=0)
    resident_stages: list[int] | None = _f(None, "Pipeline stages kept on their GPU for good (weights, fp32 master "
                                           "and AdamW states; a device AdamW, no uploads or downloads). null: the "
                                           "planner chooses where GPU memory is free and the step gets faster; []: none.")
    kept_stages: list[int] | None = _f(None, "Pipeline stages that keep their forward's activations for the backward "
                                       "instead of recomputing them (any stage but the last). "
                                       "null: the planner chooses; []: none.")
    grad_download: Literal["auto", "fp32", "half"] = _f("auto", "Precision of the pipeline's gradient downloads: fp32 "
                                                        "(the exact sums), half (bf16 only: half the bytes and 4 fewer "
                                                        "host bytes per parameter, gradients rounded to bf16), auto "
                                                        "(half when host memory needs it or the simulated step is 5% "
                                                        "shorter).")
    cpu_threads: int | None = _f(None, "CPU threads of each worker (its CPU AdamW, and its compute on CPU workers). "
                                 "null: the worker's share of the cores, less 2 for a GPU worker's dispatch and "
                                 "copy threads.", ge=1)
    cpu_pinning: bool = _f(False, "GPU workers: keep each worker's CPU updates (its AdamW threads) on its share of the "
                           "cores less the first 2, which stay to the threads that launch its kernels and copies, so "
                           "an update cannot take the core a launch waits for. false: the OS places every thread. "
                           "Not yet measured on a GPU (bench/gpu_suite.py --parts threads).")


@dataclass
class PartitionSection(_Section):
    _name = "partition"
    solver: Literal["auto", "gurobi", "highs"] = _f("auto", "MIP solver: gurobi, highs, or auto (gurobi, then HiGHS "
                                                    "when the free licence cannot take the model).")
    time_limit_s: float = _f(3.0, "The pipeline planner's time for its searching as a whole, in seconds: the "
                             "partition search (the local search and every MIP; inputs kept on the GPU, then "
                             "in host memory) takes 80% of it, the residency "
                             "passes on its near-best and finest partitions the rest, and where the simulated step "
                             "shows root-complex contention the re-plan at the simulated rates gets what is left "
                             "(a delayed plan whose CPU work weighs shares each part between two searches). The "
                             "simulations that follow (gradient dtype, baselines, the other update rule) add to it: "
                             "a plan takes about the limit plus those. Longer may narrow the gap the plan states.",
                             gt=0)
    profile: Literal["auto", "measured", "estimated"] = _f("auto", "Unit costs measured on this machine (its GPU; "
                                                           "the CPU for CPU workers), estimated from the datasheet of "
                                                           "partition.gpu, or auto (measured when the run is planned "
                                                           "on this machine's GPUs or CPU workers, whatever "
                                                           "partition.gpu names; estimated for a machine planned from "
                                                           "elsewhere).")
    profile_file: str | None = _f(None, "A JSON of unit times measured elsewhere (mobius profile writes one): the "
                                  "forward and the backward alone of one micro-batch per unit kind (embed, block, "
                                  "head), at the run's micro-batch size, sequence and precision. Planning uses them "
                                  "instead of profiling or a datasheet; kinds it does not name keep their estimate.")
    gpu: str | None = _f(None, "GPU model for estimated profiles, e.g. rtx3090, rtx4090, a100-40gb, h100: the "
                               "datasheet of a server planned from elsewhere (a saved topology that does not name its "
                               "GPUs, --gpus N), or of any machine with partition.profile=estimated.")
    gpu_memory_gib: float | None = _f(None, "Usable GPU memory per device; null: the device's own.", gt=0)
    host_memory_gib: float | None = _f(None, "Host memory the pipeline's host stores may take (weights, AdamW "
                                       "states, transfer buffers), in GiB; a plan that needs more stops with the "
                                       "two figures. null: 85% of this machine's available memory when planning on "
                                       "it; planning from a saved topology, not known: nothing is checked and no "
                                       "choice spends host memory for speed (bf16 gradient downloads unless fp32 "
                                       "is at least 5% faster).", gt=0)
    cpu_update_rate: float | None = _f(None, "The host's CPU AdamW rate in G parameters per second with fp32 "
                                       "moments, all of a run's workers updating at once, in total, measured outside "
                                       "a training step (python bench/cpu_update_bench.py --workers N on the server "
                                       "prints it); the plan takes 0.68 of it inside a step, divides it among the "
                                       "workers updating at the same time and, for bf16 or int8 moments "
                                       "(train.optimizer_states), scales it by their fewer bytes per parameter "
                                       "(30/22, 30/18.25). null: measured on this machine, with the run's moments, "
                                       "when planning on it; planning from a saved topology, 4.0 (a two-socket "
                                       "server's).", gt=0)
    document_tokens: int | None = _f(None, "Tokens per document in packed rows of conversations, which the plan "
                                     "profiles attention with (within each document, not across the row). null: "
                                     "the data's mean when it is packed conversations and mobius can read it (its "
                                     "token cache, or tokenized now with the checkpoint's tokenizer); else one "
                                     "sequence per row.", ge=1)
    reuse_plan: bool = _f(True, "Run the pipeline plan made before for the same profile, machine, settings and "
                          "mobius code (mobius plan, then mobius train: the plan shown; a resumed run), kept under "
                          "partition.cache_dir; false: search again, and keep the new plan.")
    cache_dir: str = _f(".mobius_cache", "Where measured profiles, the host's measured rates and the plans made "
                        "are kept.")


@dataclass
class ZeroSection(_Section):
    _name = "zero"
    chunk_size: int = _f(0, "Zero mode: parameters per chunk (the unit of gathering, sharding and offloading); 0: "
                         "the search picks the size that replaces the fewest bytes in rCache per step.", ge=0)
    cache_blocks: int = _f(0, "Zero mode: rCache blocks, gathered chunks each GPU keeps (1 chunk each); 0: the search "
                           "decides. From the most chunks one unit uses (rCache-min, like ZeRO-3) to the chunk count "
                           "(rCache-max, like ZeRO-2).", ge=0)
    gpu_chunks: int = _f(-1, "Zero mode: chunks whose fp32 master, AdamW states and gradient shards stay on the GPU, "
                         "counted from the first in forward order; the others live in host memory with a CPU AdamW. "
                         "-1: the search decides; 0: offload every chunk; at least the chunk count: offload none.",
                         ge=-1)


LORA_TRAINABLE = ("embeddings", "norms", "head", "router")  # what lora.train may name besides the adapters


@dataclass
class LoraSection(_Section):
    _name = "lora"
    rank: int = _f(0, "LoRA rank: 0 trains every weight (full fine-tuning); r > 0 freezes the checkpoint's weights "
                   "and trains rank-r adapters beside the target layers (PEFT's LoRA: out += B(A(dropout(x))) x "
                   "alpha / rank, B starting at zero).", ge=0)
    alpha: float = _f(16.0, "LoRA alpha: the adapters' output is scaled by alpha / rank.", gt=0)
    dropout: float = _f(0.0, "Dropout on the adapters' input (training only).", ge=0, lt=1)
    targets: list[str] = _f(["all-linear"], "Layers that get adapters, by their Hugging Face names: q_proj k_proj "
                            "v_proj o_proj gate_proj up_proj down_proj (Llama, Mistral, Qwen), q_proj k_proj v_proj "
                            "out_proj fc1 fc2 (OPT), c_attn c_proj c_fc (GPT-2); or all-linear (every linear layer "
                            "of the blocks, as PEFT resolves it). Mixtures of experts: the experts' projections "
                            "(every expert gets its own adapter; PEFT's target_parameters) gate_proj up_proj "
                            "down_proj (Qwen3-MoE: gate and up together) or w1 w3 w2 (Mixtral: w1 and w3 together), "
                            "gate_up_proj down_proj (GPT-OSS; and the fused parameter by name, at rank r), the "
                            "router gate (Qwen3-MoE, Mixtral); a run whose targets reach no expert says so.")
    train: list[str] = _f([], "What trains fully besides the adapters: any of embeddings, norms, head, router (a "
                          "mixture of experts' routers; PEFT's modules_to_save).")

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in self.train:
            if name not in LORA_TRAINABLE:
                raise ConfigError(f"lora.train: {name!r} is not one of {', '.join(LORA_TRAINABLE)}")
        if not self.targets:
            raise ConfigError("lora.targets is empty: name the layers that get adapters, or all-linear")
        if "all-linear" in self.targets and len(self.targets) > 1:
            raise ConfigError(f"lora.targets: all-linear already names every linear layer; drop the others "
                              f"({', '.join(t for t in self.targets if t != 'all-linear')})")


@dataclass
class TopologySection(_Section):
    _name = "topology"
    file: str | None = _f(None, "Saved topology (mobius topo --json, or nvidia-smi topo -m text) instead of detecting.")
    bandwidth_file: str | None = _f(None, "Bandwidth JSON from 'mobius topo --bench' for the cost model.")


@dataclass
class OutputSection(_Section):
    _name = "output"
    dir: str = _f("runs/default", "Run directory: metrics.jsonl, checkpoints, plots.")
    save_every: int = _f(0, "Write a checkpoint every N steps (0: only the final one).", ge=0)
    keep_last: int = _f(2, "Keep this many step checkpoints (the final one is always kept).", ge=1)
    save_dtype: Literal["auto", "fp32", "bf16", "fp16"] = _f("auto", "Checkpoint dtype; auto: the dtype of the "
                                                             "checkpoint fine-tuned, fp32 from scratch.")
    plot: bool = _f(True, "Draw the loss curve into output.dir/loss.png at the end.")
    save_merged: bool = _f(False, "LoRA runs: also write the base model with the adapters merged into it, a plain "
                           "Hugging Face checkpoint in save_dtype, to output.dir/merged.")


@dataclass
class Config:
    model: ModelSection
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    partition: PartitionSection = field(default_factory=PartitionSection)
    zero: ZeroSection = field(default_factory=ZeroSection)
    lora: LoraSection = field(default_factory=LoraSection)
    topology: TopologySection = field(default_factory=TopologySection)
    output: OutputSection = field(default_factory=OutputSection)
    source: str = field(default="<defaults>", compare=False, metadata={"internal": True})

    def to_dict(self) -> dict:
        return {f.name: dataclasses.asdict(getattr(self, f.name)) for f in _sections()}

    def check_ready(self) -> None:
        """Reject placeholder paths that the user has to fill in before running."""
        for section, key in (("model", "checkpoint"), ("data", "path"), ("data", "tokenizer"),
                             ("data", "chat_template"), ("topology", "file"), ("topology", "bandwidth_file")):
            value = getattr(getattr(self, section), key)
            if isinstance(value, str) and value.startswith(PLACEHOLDER):
                raise ConfigError(f"{self.source}: {section}.{key} is still a placeholder ({value}); set it in the file "
                                  f"or with --{section}.{key}=PATH")


def _sections() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(Config) if not f.metadata.get("internal")]


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------
def _check_type(value: Any, tp: Any, where: str) -> Any:
    """Check (and gently coerce int -> float) a YAML value against a field's type hint."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in typing.get_args(tp):
            return None
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        return _check_type(value, inner[0], where)
    if origin is Literal:
        if isinstance(value, bool) and {"on", "off"} <= set(typing.get_args(tp)):
            value = "on" if value else "off"  # YAML 1.1 reads a bare on/off as a boolean
        if value not in typing.get_args(tp):
            choices = "|".join(str(a) for a in typing.get_args(tp))
            raise ConfigError(f"{where} must be one of {choices}, got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where} must be a list, got {value!r}")
        return [_check_type(v, typing.get_args(tp)[0], f"{where}[{i}]") for i, v in enumerate(value)]
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):  # YAML reads "3e-4" as a string
        try:
            return float(value)
        except ValueError:
            pass
    if tp in (int, float, str, bool) and (not isinstance(value, tp) or (tp is int and isinstance(value, bool))):
        raise ConfigError(f"{where} must be {tp.__name__}, got {value!r}")
    return value


def _build_section(cls: type, values: dict, where: str) -> Any:
    if not isinstance(values, dict):
        raise ConfigError(f"{where} must be a mapping of keys, got {values!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in values.items():
        if key not in names:
            near = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean {where}.{near[0]}?)" if near else f" (known: {', '.join(names)})"
            raise ConfigError(f"unknown key {where}.{key}{hint}")
        kwargs[key] = _check_type(value, hints[key], f"{where}.{key}")
    return cls(**kwargs)


def parse_overrides(overrides: list[str]) -> dict:
    """``["--train.lr=1e-4", "--model.preset", "gpt2"]`` -> ``{"train": {"lr": 1e-4}, "model": {...}}``."""
    out: dict = {}
    i = 0
    while i < len(overrides):
        arg = overrides[i]
        if not arg.startswith("--") or "." not in arg.split("=")[0]:
            raise ConfigError(f"unrecognised argument {arg!r}; overrides look like --section.key=value")
        if "=" in arg:
            key, raw = arg[2:].split("=", 1)
        elif i + 1 < len(overrides):
            key, raw = arg[2:], overrides[i + 1]
            i += 1
        else:
            raise ConfigError(f"override {arg} has no value")
        section, _, name = key.partition(".")
        out.setdefault(section, {})[name] = _override_value(section, name, raw)
        i += 1
    return out


NULLS = ("", "null", "Null", "NULL", "~")  # how an override sets an optional key to null


def _override_value(section: str, name: str, raw: str) -> Any:
    """The value an override's text stands for, read as the key's type says: text keys (paths, names,
    choices) take the text literally, so ``#``, ``:`` or ``yes`` in a path stay part of it (an optional
    one is null for empty text or ``null``; text in quotes is a YAML string, ``'null'`` included);
    numbers, booleans and lists are read as YAML."""
    hint = _field_type(section, name)
    kinds = [a for a in typing.get_args(hint) if a is not type(None)] if _optional(hint) else [hint]
    if len(kinds) == 1 and (kinds[0] is str or typing.get_origin(kinds[0]) is Literal):
        if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "'\"":
            try:
                quoted = yaml.safe_load(raw)
            except yaml.YAMLError:
                quoted = None
            if isinstance(quoted, str):
                return quoted
        return None if _optional(hint) and raw in NULLS else raw
    if raw == "":
        return None
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError as e:
        raise ConfigError(f"override --{section}.{name}: {raw!r} is not a valid YAML value "
                          f"({str(e).splitlines()[0]})") from None


def _field_type(section: str, name: str) -> Any:
    """The type hint of ``section.name`` (None for an unknown key, which the loader then names)."""
    sections = typing.get_type_hints(Config)
    if section not in sections or not dataclasses.is_dataclass(sections[section]):
        return None
    return typing.get_type_hints(sections[section]).get(name)


def _optional(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in typing.get_args(hint)


def config_from_dict(raw: dict, source: str = "<dict>") -> Config:
    """Build a :class:`Config` from nested dicts, naming ``source`` in every error."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the file must hold a mapping of sections, got {type(raw).__name__}")
    sections = {f.name: f for f in _sections()}
    hints = typing.get_type_hints(Config)
    built = {}
    try:
        for key in raw:
            if key not in sections:
                near = difflib.get_close_matches(str(key), list(sections), n=1)
                raise ConfigError(f"unknown section {key!r}" + (f" (did you mean {near[0]}?)" if near else
                                                                f" (known: {', '.join(sections)})"))
        for name in sections:
            if name in raw or name == "model":
                built[name] = _build_section(hints[name], raw.get(name) or {}, name)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    return Config(**built, source=source)


def merge(base: dict, extra: dict) -> dict:
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    for section, values in extra.items():
        if isinstance(out.get(section), dict) and isinstance(values, dict):
            out[section].update(values)
        else:
            out[section] = values
    return out


def load_config(path: str | os.PathLike, overrides: list[str] | None = None) -> Config:
    """Load a YAML run file and apply ``--section.key=value`` overrides."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {data[e.start]:#04x} at offset {e.start} cannot be read); "
                          f"save the file as UTF-8") from None
    try:
        raw = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the file must hold a mapping of sections, got {type(raw).__name__}")
    return config_from_dict(merge(raw, parse_overrides(overrides or [])), str(path))


def describe_fields() -> str:
    """Every configuration key with its default and documentation (for ``--help``)."""
    lines = []
    for sec in _sections():
        lines.append(f"{sec.name}:")
        for f in dataclasses.fields(typing.get_type_hints(Config)[sec.name]):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            domain = f", {domain_text(f)}" if f.metadata.get("domain") else ""
            lines.append(f"  {sec.name}.{f.name} (default {default!r}{domain}): {f.metadata['help']}")
    return "\n".join(lines)
