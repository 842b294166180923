"""Checkpoints: one writer and one reader for every engine, in one format.

A checkpoint directory::

    config.json                           Hugging Face config (architecture, dtype)
    model.safetensors                     weights; or model-0000k-of-0000n.safetensors + model.safetensors.index.json
    tokenizer.json, tokenizer_config.json
    mobius.json                           step and run config
    optimizer-0000r-of-0000w.safetensors  AdamW moments by parameter name, in the run's train.optimizer_states
                                          (fp32, bf16, or int8 codes and their .scale), one file per rank
                                          (resumable only)
    trainer_state.json                    step, data position, losses, RNG, loss scale, optimizer step (resumable only)
    compute-weights.safetensors           train.update=delayed: the fp32 weights the next step computes with (the
                                          update in flight), what trains only, by parameter name (resumable only)

Every rank of a run contributes a :class:`RankState` (complete fp32 tensors by mobius parameter
name, each name on exactly one rank) and writes its own shards into one temporary directory; rank 0
writes the rest and renames the finished directory into place, so a reader never sees half a
checkpoint. Optimizer moments are stored by parameter name, so a run resumes under any mode,
partition or number of ranks. Nothing is pickled: a checkpoint from elsewhere cannot run code.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import struct
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

import torch

from mobius.errors import CheckpointError
from mobius.files import write_failure
from mobius.models import ModelConfig, tied_weights
from mobius.models.hf import KEY_MAPS, config_to_hf, to_hf
from mobius.states import Moments

log = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"
STATE_FORMAT = "mobius.trainer_state/1"
MAX_SHARD_BYTES = 5 * 2**30
COMPUTE_FILE = "compute-weights.safetensors"  # train.update=delayed: the weights one update behind the newest
TMP_MARK = ".tmp-"  # temporary directories are named ".<name>.tmp-<suffix>" next to their target


class Collective(Protocol):
    """The ranks that write one checkpoint together."""

    rank: int
    world: int

    def barrier(self) -> None: ...
    def all_gather_object(self, obj: Any) -> list[Any]: ...


class SingleProcess:
    """One rank: every collective is trivial."""

    rank, world = 0, 1

    def barrier(self) -> None:
        pass

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]


class ProcessGroup:
    """The ranks of a ``torch.distributed`` process group (the default group unless given)."""

    def __init__(self, group: Any = None):
        import torch.distributed as dist

        self._dist, self.group = dist, group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)

    def barrier(self) -> None:
        self._dist.barrier(self.group)

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        self._dist.all_gather_object(out, obj, group=self.group)
        return out


@dataclass
class RankState:
    """What one rank holds of the model: fp32 weights and AdamW moments by mobius parameter name."""

    weights: dict[str, torch.Tensor]
    moments: dict[str, Moments] = field(default_factory=dict)  # name -> exp_avg and exp_avg_sq, in the rule's storage
    optimizer_step: int = 0  # AdamW steps taken (equal on every rank)
    scaler: dict = field(default_factory=dict)  # LossScaler.state_dict() (equal on every rank)
    compute: dict[str, torch.Tensor] | None = None  # train.update=delayed: what trains, as the next step computes it


def canonical_name(name: str, model_cfg: ModelConfig) -> str:
    """The name a tied weight's state is stored under (the embedding's)."""
    for embed, head in tied_weights(model_cfg):
        if name == head:
            return embed
    return name


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------
def save(path: str | os.PathLike, model_cfg: ModelConfig, dtype: torch.dtype, state: RankState,
         comm: Collective | None = None, resumable: bool = False,
         extra: Callable[[Path], None] | None = None, max_shard_bytes: int = MAX_SHARD_BYTES,
         base: str | None = None) -> Path:
    """Write a Hugging Face checkpoint (and, if ``resumable``, the optimizer moments) atomically;
    under LoRA the adapter (and whatever else trains) in PEFT's format, for the base model ``base``.

    Called by every rank of ``comm`` with its own ``state``; ``extra(tmp_dir)`` runs on rank 0
    before the rename (tokenizer, trainer state).
    """
    comm = comm or SingleProcess()
    path = Path(path)
    tmp = _shared_tmp_dir(path, comm)
    try:
        if model_cfg.lora is not None:  # what trains, in PEFT's format; the frozen weights stay where they were
            index = _write_adapter(tmp, model_cfg, dtype, state.weights, comm, base)
        else:
            index = _write_weights(tmp, model_cfg, dtype, state.weights, comm, max_shard_bytes)
        if resumable:
            _write_moments(tmp, model_cfg, state, comm)
            if state.compute is not None:
                _write_compute_weights(tmp, model_cfg, state.compute, comm)
        comm.barrier()
        if comm.rank == 0:
            (tmp / "config.json").write_text(json.dumps(config_to_hf(model_cfg, dtype), indent=2) + "\n")
            if index is not None:
                (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
            if extra is not None:
                extra(tmp)
            replace_dir(tmp, path)
        comm.barrier()
    except BaseException as e:
        if comm.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        reason = write_failure(e)
        if reason is not None:  # a full disk, a quota, a read-only filesystem: one line, not a traceback
            raise CheckpointError(f"cannot write checkpoint {path}: {reason}") from None
        raise
    return path


def checkpoint_bytes(model_cfg: ModelConfig, dtype: torch.dtype, resumable: bool, delayed: bool = False,
                     states: str = "fp32") -> int:
    """About how many bytes one checkpoint of this model takes: the weights in ``dtype`` (under LoRA
    only what trains) and, when ``resumable``, the AdamW moments of what trains in ``states``' precision (and,
    ``delayed``, its fp32 compute weights)."""
    from mobius.models.params import model_params
    from mobius.states import moment_bytes

    params = model_params(model_cfg)
    trains = sum(p.numel for p in params if p.trains)
    saved = trains if model_cfg.lora is not None else sum(p.numel for p in params)
    return round(saved * dtype.itemsize + ((moment_bytes(states) + (4 if delayed else 0)) * trains if resumable
                                           else 0))


def save_model(model: torch.nn.Module, path: str | os.PathLike, dtype: torch.dtype = torch.float32,
               max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
    """Write one process's whole model as a Hugging Face checkpoint (weights and config only)."""
    weights = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    return save(path, model.config, dtype, RankState(weights), max_shard_bytes=max_shard_bytes)


def _shared_tmp_dir(path: Path, comm: Collective) -> Path:
    """A fresh temporary directory beside ``path``, made by rank 0 and known to every rank."""
    name = None
    if comm.rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        name = tempfile.mkdtemp(prefix=f".{path.name}{TMP_MARK}", dir=path.parent)
    return Path(comm.all_gather_object(name)[0])


def _hf_views(model_cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's weights under Hugging Face names, as views (converted one shard at a time when written); a
    tied head is left out (transformers ties it again on load)."""
    hf = to_hf(weights, model_cfg, partial=True)
    km = KEY_MAPS[model_cfg.family](model_cfg)
    if km.tied is not None:
        hf.pop(km.tied[0], None)
    return hf


def _split(tensors: dict[str, torch.Tensor], max_bytes: int, dtype: torch.dtype) -> list[dict[str, torch.Tensor]]:
    """``tensors`` in shards of at most ``max_bytes`` once in ``dtype`` (a larger tensor alone)."""
    shards: list[dict[str, torch.Tensor]] = []
    size = max_bytes
    for key, t in tensors.items():
        nbytes = t.numel() * dtype.itemsize
        if size + nbytes > max_bytes and (not shards or shards[-1]):
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += nbytes
    return [s for s in shards if s]


def _write_weights(tmp: Path, model_cfg: ModelConfig, dtype: torch.dtype, weights: dict[str, torch.Tensor],
                   comm: Collective, max_bytes: int) -> dict | None:
    """Each rank writes its shards; returns the index (rank 0, several shards) or None."""
    shards = _split(_hf_views(model_cfg, weights), max_bytes, dtype)
    counts = comm.all_gather_object(len(shards))
    first, total = sum(counts[:comm.rank]), sum(counts)
    written = []
    for i, views in enumerate(shards):
        name = "model.safetensors" if total == 1 else f"model-{first + i + 1:05d}-of-{total:05d}.safetensors"
        written.append((name, sorted(views), _write_shard(tmp / name, views, dtype)))
    everything = [w for part in comm.all_gather_object(written) for w in part]
    if total == 0:
        raise CheckpointError("no weights to write: no rank holds any parameter")
    if total == 1 or comm.rank != 0:
        return None
    weight_map = {key: name for name, keys, _ in everything for key in keys}
    return {"metadata": {"total_size": sum(size for _, _, size in everything)}, "weight_map": weight_map}


def _write_shard(file: Path, views: dict[str, torch.Tensor], dtype: torch.dtype) -> int:
    """One shard, converted to ``dtype`` only now: a save holds one converted shard beside the weights, not a
    converted copy of them all (8B parameters in bf16: one 5 GiB shard instead of 16 GB); its bytes."""
    from safetensors.torch import save_file

    shard = {k: v.detach().to("cpu", dtype).contiguous() for k, v in views.items()}
    save_file(shard, str(file), metadata={"format": "pt"})
    return sum(t.nbytes for t in shard.values())


def _write_adapter(tmp: Path, model_cfg: ModelConfig, dtype: torch.dtype, weights: dict[str, torch.Tensor],
                   comm: Collective, base: str | None) -> None:
    """Every rank writes what trains of its weights; rank 0 joins them into one adapter file."""
    from safetensors.torch import load_file, save_file

    from mobius.models.lora import trains
    from mobius.models.peft import to_peft, write_adapter

    mine = {k: v for k, v in weights.items() if trains(model_cfg, k)}
    part = tmp / f".adapter-part-{comm.rank:05d}.safetensors"
    save_file({k: v.detach().to("cpu", torch.float32).contiguous() for k, v in to_peft(mine, model_cfg).items()},
              str(part))
    comm.barrier()
    if comm.rank == 0:
        from mobius.models.peft import from_peft

        joined: dict[str, torch.Tensor] = {}
        for f in sorted(tmp.glob(".adapter-part-*.safetensors")):
            joined.update(from_peft(load_file(str(f)), model_cfg))
            f.unlink()
        write_adapter(tmp, model_cfg, joined, dtype, base)
    return None


def _write_moments(tmp: Path, model_cfg: ModelConfig, state: RankState, comm: Collective) -> None:
    from safetensors.torch import save_file

    out: dict[str, torch.Tensor] = {}
    for name, mo in state.moments.items():
        if canonical_name(name, model_cfg) != name and canonical_name(name, model_cfg) in state.moments:
            continue  # the tied head's moments equal the embedding's
        key = canonical_name(name, model_cfg)
        out.update({f"{key}.{part}": t.detach().to("cpu").contiguous() for part, t in mo.tensors().items()})
    file = tmp / f"optimizer-{comm.rank + 1:05d}-of-{comm.world:05d}.safetensors"
    save_file(out, str(file), metadata={"optimizer_step": str(state.optimizer_step)})


def _write_compute_weights(tmp: Path, model_cfg: ModelConfig, compute: dict[str, torch.Tensor],
                           comm: Collective) -> None:
    """The weights the next step computes with (train.update=delayed), fp32 by parameter name (a tied
    head under the embedding's name), in one file whichever ranks hold them: several ranks (a
    pipeline's workers, each holding its stages') agree on the file's layout, rank 0 writes its header
    and each rank writes its own tensors' bytes in place, so no rank holds more than its own."""
    from safetensors.torch import save_file

    mine: dict[str, torch.Tensor] = {}
    for name, t in compute.items():
        mine.setdefault(canonical_name(name, model_cfg), t.detach().to("cpu", torch.float32).contiguous())
    file = tmp / COMPUTE_FILE
    if comm.world == 1:
        save_file(mine, str(file))
        return
    owner: dict[str, tuple[int, list[int]]] = {}  # name -> (the rank that writes it, shape); a tied weight once
    for rank, held in enumerate(comm.all_gather_object(sorted((k, list(t.shape)) for k, t in mine.items()))):
        for name, shape in held:
            owner.setdefault(name, (rank, shape))
    header: dict[str, dict] = {}
    end = 0
    for name in sorted(owner):
        shape = owner[name][1]
        size = 4 * math.prod(shape)
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [end, end + size]}
        end += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # safetensors pads its header to 8 bytes
    start = 8 + len(text)
    if comm.rank == 0:
        with open(file, "wb") as f:
            f.write(struct.pack("<Q", len(text)) + text)
            f.truncate(start + end)
    comm.barrier()
    with open(file, "r+b") as f:
        for name, t in mine.items():
            if owner[name][0] == comm.rank and t.numel():
                f.seek(start + header[name]["data_offsets"][0])
                f.write(memoryview(t.reshape(-1).numpy()).cast("B"))  # little-endian, as safetensors stores


def replace_dir(tmp: Path, path: Path) -> None:
    """Move a finished directory into place; an existing one is swapped out, then removed."""
    if path.exists():
        old = path.with_name(f".{path.name}.old-{os.getpid()}")
        os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, path)


def stale_temporaries(directory: Path) -> list[Path]:
    """Temporary checkpoint directories mobius left behind (an interrupted write), and only those."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if p.is_dir() and p.name.startswith(".")
                  and (TMP_MARK in p.name or ".old-" in p.name))


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------
STATE_FIELDS: dict[str, Any] = {  # what trainer_state.json holds: key -> type, or the fields of a nested object
    "step": int, "losses": list, "rng": {"python": list, "numpy": list, "torch": str},
    "data": {"position": int, "seed": int, "train_blocks": int},
    "engine": {"optimizer_step": int, "scaler": dict}}
OPTIONAL_FIELDS = {"tokenizer": str, "data.fingerprint": str}  # absent from checkpoints of older versions


def _check_fields(state: dict, fields: dict[str, Any], file: Path, prefix: str) -> None:
    """Every field of a trainer state present with its type (counts never negative), before any is used."""
    for key, kind in fields.items():
        name = prefix + key
        if key not in state:
            raise CheckpointError(f"{file}: incomplete trainer state: no {name}")
        value = state[key]
        if isinstance(kind, dict):
            if not isinstance(value, dict):
                raise CheckpointError(f"{file}: {name} must be an object, got {value!r:.60}")
            _check_fields(value, kind, file, name + ".")
            continue
        _check_value(value, kind, file, name)
    for name, kind in OPTIONAL_FIELDS.items():
        head, _, key = name.rpartition(".")
        if head + ("." if head else "") == prefix and key in state:
            _check_value(state[key], kind, file, name)


def _check_value(value: Any, kind: type, file: Path, name: str) -> None:
    ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if ok and name == "losses":
        ok = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in value)
    if not ok:
        words = "a list of numbers" if name == "losses" else _KIND_WORDS[kind]
        raise CheckpointError(f"{file}: {name} must be {words}, got {value!r:.60}")
    if kind is int and value < 0:
        raise CheckpointError(f"{file}: {name} must be >= 0, got {value}")


_KIND_WORDS = {int: "an integer", str: "a string", list: "a list", dict: "an object"}


class ResumeState:
    """The resumable part of a checkpoint: trainer state (JSON) and optimizer moments by name."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        file = self.path / STATE_FILE
        if not file.is_file():
            old = " (it holds trainer_state.pt: checkpoints of mobius 0.1 stored pickles, which are never loaded)" \
                if (self.path / "trainer_state.pt").exists() else ""
            raise CheckpointError(f"{self.path} is not a resumable checkpoint: no {STATE_FILE}{old}")
        try:
            self.trainer = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{file}: cannot be read as JSON ({e})") from None
        if not isinstance(self.trainer, dict) or self.trainer.get("format") != STATE_FORMAT:
            raise CheckpointError(f"{file}: not a mobius trainer state (format {STATE_FORMAT} expected)")
        _check_fields(self.trainer, STATE_FIELDS, file, "")
        self._files = sorted(self.path.glob("optimizer-*.safetensors"))
        if not self._files:
            raise CheckpointError(f"{self.path} is not a resumable checkpoint: no optimizer-*.safetensors files")
        self._where = self._index_moments()

    def _index_moments(self) -> dict[str, Path]:
        from safetensors import safe_open

        where: dict[str, Path] = {}
        for f in self._files:
            try:
                with safe_open(str(f), framework="pt") as h:
                    keys = list(h.keys())
            except Exception as e:  # safetensors raises its own error types
                raise CheckpointError(f"{f}: cannot be read, the file is truncated or corrupt ({e})") from None
            for k in keys:
                where[k] = f
        return where

    @property
    def optimizer_step(self) -> int:
        return int(self.trainer["engine"]["optimizer_step"])

    @property
    def scaler(self) -> dict:
        return dict(self.trainer["engine"]["scaler"])

    def moments(self, names: list[str], model_cfg: ModelConfig) -> dict[str, Moments]:
        """AdamW's moments for ``names`` (a tied head gets the embedding's), in the storage of the rule that wrote
        them (the engine converts them to its own); empty before the first optimizer step."""
        from safetensors import safe_open

        if self.optimizer_step == 0:
            return {}
        out = {}
        for name in names:
            key = canonical_name(name, model_cfg)
            if f"{key}.exp_avg" not in self._where:
                raise CheckpointError(f"{self.path}: no optimizer state for {key}")
            parts = [k for k in ("exp_avg", "exp_avg_sq", "exp_avg.scale", "exp_avg_sq.scale")
                     if f"{key}.{k}" in self._where]
            read = {}
            for part in parts:
                with safe_open(str(self._where[f"{key}.{part}"]), framework="pt") as h:
                    read[part] = h.get_tensor(f"{key}.{part}")
            out[name] = Moments.from_tensors(read)
        return out

    @property
    def states(self) -> str | None:
        """The train.optimizer_states of the run that wrote the moments (from their dtype); None before the first
        optimizer step."""
        from safetensors import safe_open

        first = next((k for k in self._where if k.endswith(".exp_avg")), None)
        if self.optimizer_step == 0 or first is None:
            return None
        with safe_open(str(self._where[first]), framework="pt") as h:
            dtype = h.get_slice(first).get_dtype()
        return {"F32": "fp32", "BF16": "bf16", "U8": "int8"}[dtype]

    @property
    def delayed(self) -> bool:
        """Whether the checkpoint holds compute weights (a train.update=delayed run's update in flight)."""
        return (self.path / COMPUTE_FILE).is_file()

    def compute_weights(self, names: list[str], model_cfg: ModelConfig) -> dict[str, torch.Tensor] | None:
        """The weights the next step computes with, for ``names`` (a tied head gets the embedding's),
        when the checkpoint holds them (train.update=delayed); None for a sync checkpoint."""
        from safetensors import safe_open

        file = self.path / COMPUTE_FILE
        if not self.delayed:
            return None
        keys = {n: canonical_name(n, model_cfg) for n in names}
        try:
            with safe_open(str(file), framework="pt") as h:  # only the tensors asked for (a worker's stages)
                held = set(h.keys())
                missing = sorted({k for k in keys.values() if k not in held})
                read = {k: h.get_tensor(k) for k in set(keys.values()) if k in held}
        except Exception as e:  # safetensors raises its own error types
            raise CheckpointError(f"{file}: cannot be read, the file is truncated or corrupt ({e})") from None
        if missing:
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            raise CheckpointError(f"{file}: no compute weights for {', '.join(missing[:3])}{more}")
        return {n: read[k] for n, k in keys.items()}
