"""The pipeline engine: one per worker, the same interface as the reference ``SingleEngine``.

A step runs the worker's action list (:mod:`scheduler.executor`), then, across workers: the tied
embedding/head gradients are summed, the global gradient norm and fp16 overflow are reduced, and
each stage's CPU AdamW update is queued in stage order. Updates run in the background and overlap
the next step: a stage's next upload waits only for its own update. Without clipping and fp16, a
stage is updated as soon as its gradients reach the host (during the rest of the backward).
"""

from __future__ import annotations

import logging
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from mobius.config import Config
from mobius.engine import DTYPES, Batch, StepStats
from mobius.errors import CheckpointError, MobiusError
from mobius.models import ModelConfig, dropout_active, hidden_size, init_unit, tied_weights, unit_specs
from mobius.models.hf import KEY_MAPS, LazyCheckpoint, _replace_dir, config_to_hf, from_hf, to_hf
from mobius.optim import LossScaler, clip_coefficient
from scheduler.comm import Counters, DirectLink, LocalLink, StagedLink, UploadArbiter, arbiter_name
from scheduler.executor import Executor, StepIO, StepTrace
from scheduler.schedule import Schedule, build_schedule
from scheduler.stages import stage_layouts, unit_prefix, views
from scheduler.store import HostStage, check_host_memory, host_bytes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PipelineSpec:
    """What the runtime needs from a plan: the cut and the stage -> worker assignment."""

    boundaries: tuple[int, ...]  # stage j covers units [boundaries[j], boundaries[j+1])
    gpu_of: tuple[int, ...]  # stage -> worker rank
    groups: tuple[tuple[int, ...], ...]  # workers sharing a root complex (upload arbitration)
    p2p: bool = False  # activations GPU to GPU through NCCL
    offload_inputs: bool = False  # boundary inputs wait for the backward in host memory
    prefetch: bool = True  # two device slots: the next stage uploads while the current one computes
    predicted_step_s: float | None = None  # the planner's simulated step time

    @property
    def num_stages(self) -> int:
        return len(self.boundaries) - 1


def _weights_source(cfg: Config, resume_dir: Path | None) -> str | None:
    if resume_dir is not None:
        return str(resume_dir)
    return cfg.model.checkpoint


def cpu_threads() -> int:
    """Threads for this worker's CPU AdamW: its share of the cores, less two for the dispatch and
    copy threads (on a GPU worker, where the CPU update runs beside kernel dispatch)."""
    share = (os.cpu_count() or 1) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return max(1, share - 2 if share > 4 else share)


class PipelineEngine:
    """The swapped pipeline on this worker (rank) of ``world``."""

    def __init__(self, cfg: Config, model_cfg: ModelConfig, spec: PipelineSpec, device: torch.device,
                 resume_dir: Path | None = None):
        self.cfg, self.model_cfg, self.spec, self.device = cfg, model_cfg, spec, device
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.is_main = self.rank == 0
        self.dtype = DTYPES[cfg.train.precision]
        tied = tied_weights(model_cfg)
        self.layouts = stage_layouts(model_cfg, list(spec.boundaries), tied)
        mine = [j for j in range(spec.num_stages) if spec.gpu_of[j] == self.rank]
        if not mine:
            raise MobiusError(f"worker {self.rank} has no stage: {spec.num_stages} stages for {self.world} workers")
        check_host_memory(host_bytes([self.layouts[j] for j in mine], self.dtype), f"worker {self.rank}'s stages")
        pin = device.type == "cuda"
        if pin:
            torch.set_num_threads(cpu_threads())
        self.hosts = {j: HostStage(self.layouts[j], self.dtype, cfg.train, pin) for j in mine}
        self._load_weights(_weights_source(cfg, resume_dir))
        self.counters = Counters()
        self.arbiter = self._arbiter()
        self.ex = Executor(self.rank, device, model_cfg, self.layouts, self.hosts, self.dtype, cfg.train.precision,
                           self._links(), self.arbiter, self.counters,
                           (cfg.train.micro_batch_size, cfg.data.seq_len, hidden_size(model_cfg)),
                           num_slots=2 if spec.prefetch else 1)
        self.tied = self._tied_ranges(tied)
        self.ex.skip = {j: r for j, r in self.tied.items() if j in self.hosts}
        self.ex.immediate = cfg.train.grad_clip == 0 and cfg.train.precision != "fp16"
        self.ex.offload_inputs = spec.offload_inputs
        M = cfg.train.micro_batches
        self.train_sched = build_schedule(spec.num_stages, self.world, M, list(spec.gpu_of), spec.prefetch)
        self.eval_scheds: dict[int, Schedule] = {}
        self.scaler = LossScaler(enabled=cfg.train.precision == "fp16")
        self.dropout_seed = cfg.train.seed if dropout_active(model_cfg) else None
        self.param_bytes = sum(lay.param_count for lay in self.layouts) * self.dtype.itemsize

    # ---- set-up ---------------------------------------------------------------------------------
    def _names(self) -> set[str]:
        return {n for j in self.hosts for p in self.layouts[j].params for n in p.names}

    def _load_weights(self, source: str | None) -> None:
        """Each worker reads only its stages (a checkpoint) or initialises only them (from scratch)."""
        names = self._names()
        if source is not None:
            weights = from_hf(LazyCheckpoint(source), self.model_cfg, only=lambda k: k in names)
        else:
            weights = self._init_weights(names)
        missing = names - set(weights)
        if missing:
            raise CheckpointError(f"{source}: no weights for {sorted(missing)[:3]}")
        for host in self.hosts.values():
            host.load(weights)

    def _init_weights(self, names: set[str]) -> dict[str, torch.Tensor]:
        specs, seed = unit_specs(self.model_cfg), self.cfg.train.seed
        out: dict[str, torch.Tensor] = {}
        units = {k for j in self.hosts for k in range(self.layouts[j].first_unit, self.layouts[j].end_unit)}
        for (embed, head) in tied_weights(self.model_cfg):
            if head in names:
                units.add(0)  # the tied head starts as the embedding
        for k in sorted(units):
            unit = specs[k].build()
            init_unit(self.model_cfg, unit, k, seed)
            out.update({unit_prefix(k, len(specs)) + n: p.detach() for n, p in unit.named_parameters()})
        for embed, head in tied_weights(self.model_cfg):
            if head in names:
                out[head] = out[embed]
        return out

    def _arbiter(self) -> UploadArbiter:
        group = next((g for g in self.spec.groups if self.rank in g), (self.rank,))
        name = arbiter_name()
        if self.is_main:
            arb = UploadArbiter(name, self.rank, self.world, list(group), create=True)
            dist.barrier()
        else:
            dist.barrier()
            arb = UploadArbiter(name, self.rank, self.world, list(group), create=False)
        return arb

    def _links(self) -> dict:
        peers = {self.spec.gpu_of[j + d] for j in self.hosts for d in (-1, 1) if 0 <= j + d < self.spec.num_stages}
        links: dict = {}
        nccl = dist.new_group(backend="nccl") if self.spec.p2p else None
        for p in sorted(peers):
            if p == self.rank:
                links[p] = LocalLink()
            elif self.device.type != "cuda":
                links[p] = DirectLink(p, self.counters)
            elif self.spec.p2p:
                links[p] = DirectLink(p, self.counters, self.device, nccl)
            else:
                links[p] = StagedLink(p, self.device, self.counters)
        return links

    def _tied_ranges(self, tied: list[tuple[str, str]]) -> dict[int, tuple[int, int]]:
        """Stage -> (offset, numel) of its end of the tied weight, when the ends are on two stages."""
        out: dict[int, tuple[int, int]] = {}
        for embed, head in tied:
            first, last = self.layouts[0], self.layouts[-1]
            if first.index == last.index:
                continue  # one stage holds both ends: they share one buffer range
            a, b = first.slot_of(embed), last.slot_of(head)
            out[first.index], out[last.index] = (a.offset, a.numel), (b.offset, b.numel)
        return out

    def _eval_schedule(self, M: int) -> Schedule:
        from scheduler.schedule import Action, add_swaps, add_transfers

        gpu_of, S = self.spec.gpu_of, self.spec.num_stages
        lists = []
        for w in range(self.world):
            acts = [Action("forward", j, m) for j in range(S) if gpu_of[j] == w for m in range(M)]
            acts = add_transfers(add_swaps(acts, self.spec.prefetch), S, gpu_of)
            lists.append(tuple(a for a in acts if a.kind not in ("download", "update")))
        return Schedule(S, self.world, M, gpu_of, tuple(lists), self.spec.prefetch)

    # ---- a step ---------------------------------------------------------------------------------
    def train_step(self, step: int, batches: list[Batch], lr: float) -> StepStats:
        M = len(batches)
        scale = self.scaler.loss_factor()
        io = StepIO([x for x, _ in batches], [y for _, y in batches], step, scale / M, self.dropout_seed, lr)
        tracing = self.cfg.parallel.trace_step == step + 1
        if tracing:
            self.ex.trace = StepTrace(self.device)
        local = self.ex.run(self.train_sched, io, True)
        self.ex.order_base += 1 << 20
        for f in local.downloads.values():
            f.result()
        sumsq = sum(float(t) for t in local.sumsq) + self._sum_tied()
        h2d, d2h, p2p = self.counters.take()
        update_s, self.ex.update_s = self.ex.update_s, 0.0
        vec = torch.tensor([sumsq, local.loss_sum, local.losses, h2d, d2h, p2p, local.stall_s, local.wait_s, update_s],
                           dtype=torch.float64)
        dist.all_reduce(vec)
        norm = math.sqrt(vec[0]) if math.isfinite(vec[0]) else float("inf")
        norm /= scale
        skipped = self.scaler.update(not math.isfinite(norm))
        factor = clip_coefficient(norm, self.cfg.train.grad_clip) / scale
        for j in sorted(self.hosts):
            if self.hosts[j].updated.is_set():
                continue  # already updated as its gradients arrived
            if skipped:
                self.hosts[j].updated.set()
            else:
                self.ex.optim.submit(self.ex.update, j, lr, factor)
        if tracing:
            self._write_trace(step + 1)
        moved = float(vec[3] + vec[4] + vec[5])
        extra = {"h2d_bytes": int(vec[3]), "d2h_bytes": int(vec[4]), "p2p_bytes": int(vec[5]),
                 "traffic_x_params": round(moved / self.param_bytes, 3), "stall_s": round(float(vec[6]) / self.world, 4),
                 "upload_wait_s": round(float(vec[7]) / self.world, 4), "cpu_adam_s": round(float(vec[8]) / self.world, 4)}
        return StepStats(float(vec[1] / vec[2]), norm, skipped, self.scaler.scale if self.scaler.enabled else 1.0, extra)

    def _write_trace(self, step: int) -> None:
        """Finish the traced step (its CPU updates included) and write one Chrome trace for all workers."""
        import json
        import os

        self.sync()
        trace, self.ex.trace = self.ex.trace, None
        events = trace.events(self.rank + 1)
        events.insert(0, {"name": "process_name", "ph": "M", "pid": self.rank + 1, "args": {"name": f"worker {self.rank} "
                          f"({self.device})"}})
        gathered: list = [None] * self.world
        dist.all_gather_object(gathered, events)
        if self.is_main:
            out = Path(self.cfg.output.dir) / f"trace-step{step}.json"
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = out.with_name(f".{out.name}.tmp")
            tmp.write_text(json.dumps({"traceEvents": [e for part in gathered for e in part], "displayTimeUnit": "ms",
                                       "otherData": {"generator": "mobius runtime", "step": step}}))
            os.replace(tmp, out)
            log.info("wrote %s (open it in https://ui.perfetto.dev)", out)

    def _sum_tied(self) -> float:
        """Sum the two ends' gradients of the tied weight (both ends then take the same update);
        returns its sum of squares on the embedding's worker (counted once), else 0."""
        if not self.tied:
            return 0.0
        first, last = 0, self.spec.num_stages - 1
        ends = {j: self.hosts[j].grad[o:o + n] for j, (o, n) in self.tied.items() if j in self.hosts}
        if not ends:
            return 0.0
        if len(ends) == 2:
            total = ends[first] + ends[last]
        else:
            (j, mine), = ends.items()
            other = torch.empty_like(mine)
            peer = self.spec.gpu_of[last if j == first else first]
            reqs = [dist.isend(mine.contiguous(), peer, tag=1 << 30), dist.irecv(other, peer, tag=1 << 30)]
            for r in reqs:
                r.wait()
            total = mine + other
        for g in ends.values():
            g.copy_(total)
        return float(torch.dot(total, total)) if first in ends else 0.0

    @torch.no_grad()
    def evaluate(self, batches: list[Batch]) -> float:
        self.sync()
        io = StepIO([x for x, _ in batches], [y for _, y in batches], 0, 1.0, None)
        sched = self.eval_scheds.get(len(batches)) or self.eval_scheds.setdefault(len(batches),
                                                                                 self._eval_schedule(len(batches)))
        local = self.ex.run(sched, io, False)
        self.ex.order_base += 1 << 20
        self.counters.take()
        vec = torch.tensor([local.loss_sum, local.losses], dtype=torch.float64)
        dist.all_reduce(vec)
        return float(vec[0] / max(vec[1], 1))

    def sync(self) -> None:
        """Wait for every queued CPU update (and surface a failure of one)."""
        for host in self.hosts.values():
            host.updated.wait()
        self.ex.check()

    # ---- state ----------------------------------------------------------------------------------
    def model_state(self) -> dict[str, torch.Tensor]:
        """This worker's stages' fp32 weights by name."""
        self.sync()
        out = {}
        for j, host in self.hosts.items():
            out.update({k: v.clone() for k, v in views(host.master, self.layouts[j]).items()})
        return out

    def state_dict(self) -> dict:
        self.sync()
        opt: dict = {}
        for host in self.hosts.values():
            opt.update(host.optimizer_state())
        return {"optimizer": opt, "scaler": self.scaler.state_dict()}

    def save(self, path: Path, dtype: torch.dtype, extra: Callable[[Path], None] | None, resumable: bool) -> Path:
        """Every worker writes its shard of one Hugging Face checkpoint; rank 0 writes the index
        and the rest, then renames the finished directory into place."""
        from safetensors.torch import save_file

        tmp = path.parent / f".{path.name}.tmp-pipeline"
        if self.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        hf = to_hf(self.model_state(), self.model_cfg, partial=True)
        km = KEY_MAPS[self.model_cfg.family](self.model_cfg)
        if km.tied is not None:
            hf.pop(km.tied[0], None)
        shard = f"model-{self.rank + 1:05d}-of-{self.world:05d}.safetensors"
        save_file({k: v.to(dtype).contiguous() for k, v in hf.items()}, str(tmp / shard), metadata={"format": "pt"})
        if resumable:
            torch.save(self.state_dict(), tmp / f"engine-rank{self.rank}.pt")
        keys: list = [None] * self.world
        dist.all_gather_object(keys, (shard, sorted(hf)))
        if self.is_main:
            self._write_index(tmp, keys, dtype)
            if extra is not None:
                extra(tmp)
            _replace_dir(tmp, path)
        dist.barrier()
        return path

    def _write_index(self, tmp: Path, keys: list, dtype: torch.dtype) -> None:
        import json

        weight_map = {k: shard for shard, names in keys for k in names}
        (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
        (tmp / "config.json").write_text(json.dumps(config_to_hf(self.model_cfg, dtype), indent=2) + "\n")

    def restore(self, path: Path) -> None:
        """Optimizer states by name from every worker's file (any partition), and the loss scale."""
        files = sorted(path.glob("engine-rank*.pt"))
        if not files:
            raise CheckpointError(f"{path}: no engine-rank*.pt files (not a pipeline checkpoint)")
        merged: dict = {}
        scaler = None
        for f in files:
            st = torch.load(f, map_location="cpu", weights_only=False)
            merged.update(st["optimizer"])
            scaler = scaler or st["scaler"]
        for host in self.hosts.values():
            host.load_optimizer_state(merged)
        self.scaler.load_state_dict(scaler)

    def close(self) -> None:
        self.sync()
        self.ex.close()
        self.arbiter.close()
