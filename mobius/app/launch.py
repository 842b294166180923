"""Worker processes of a multi-process run, and the device each process opens.

``mobius train`` in pipeline and zero mode calls :func:`spawn`: one supervised process per worker
(:mod:`mobius.app.supervise`, torch.distributed.elastic's agent) with a torchrun-compatible
environment. Under ``torchrun`` the same :func:`run_worker` runs in every process torchrun started
(:mod:`mobius.app.torchrun`). If a worker fails, every other one is stopped and the error names the
rank and the cause.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from mobius.app.supervise import run_workers
from mobius.assemble import WeightSource, prepare_data, run_model_config, weights_source
from mobius.checkpoint import ResumeState
from mobius.config import Config, config_from_dict
from mobius.engine import Engine
from mobius.models import ModelConfig
from mobius.parallel import ParallelSettings
from mobius.trainer import Startup, Trainer, TrainResult, save_dtype_for
from partition.plan import Plan
from partition.zero import ZeroPlan
from scheduler.engine import PipelineEngine
from scheduler.zero import ZeroEngine

log = logging.getLogger(__name__)
TIMEOUT = timedelta(minutes=30)  # a collective that waits this long has lost its peer (supervision acts first)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def expandable_segments() -> None:
    """Let CUDA's caching allocator grow its segments in place, unless the user configured it.

    Without this a capped GPU loses about 1 GiB to fragmentation: Llama-3.1-8B LoRA planned to a 23.9
    GiB peak ran out of a 24 GiB cap asking for 1002 MiB with 1.06 GiB reserved but unused, and ran
    at 1.905 s per step with it. Takes effect only before the process first touches CUDA."""
    if "PYTORCH_CUDA_ALLOC_CONF" in os.environ or "PYTORCH_ALLOC_CONF" in os.environ:
        return
    if torch.cuda.is_initialized():
        log.debug("CUDA is already initialised: the allocator keeps its settings")
        return
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"


def open_device(settings: ParallelSettings, local_rank: int) -> torch.device:
    """This process's device: ``cuda:<local rank mod GPUs>`` (capped when the settings say so, with
    :func:`expandable_segments`), or the CPU."""
    torch.set_num_threads(settings.cpu_threads)
    if settings.device == "cpu":
        return torch.device("cpu")
    expandable_segments()
    dev = torch.device("cuda", local_rank % settings.gpus)
    torch.cuda.set_device(dev)
    if settings.memory_capped:
        total = torch.cuda.get_device_properties(dev).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, settings.memory_bytes / total), dev)
    return dev


def make_engine(cfg: Config, model_cfg: ModelConfig, plan: Plan | ZeroPlan, settings: ParallelSettings,
                device: torch.device, weights_from: WeightSource) -> Engine:
    """This worker's engine for ``settings.mode`` (pipeline or zero)."""
    engine = ZeroEngine if settings.mode == "zero" else PipelineEngine
    return engine(cfg, model_cfg, plan, settings, device, weights_from)


def worker(cfg_dict: dict, settings: ParallelSettings, plan: Plan | ZeroPlan, resume: str | None,
           startup: Startup) -> TrainResult:
    """One supervised worker: join the group, then :func:`run_worker`."""
    cfg = config_from_dict(cfg_dict["config"], cfg_dict["source"])
    dist.init_process_group("gloo", timeout=TIMEOUT)
    startup.add("workers", time.time() - startup.launched)
    return run_worker(cfg, settings, plan, Path(resume) if resume else None, startup)


def run_worker(cfg: Config, settings: ParallelSettings, plan: Plan | ZeroPlan, resume_from: Path | None,
               startup: Startup) -> TrainResult:
    """This process's part of a pipeline or zero run, in the default (gloo) process group: build the
    mode's engine and run the shared training loop.

    On failure it neither closes the engine nor leaves the group: the supervisor (or torchrun) ends
    the process and every other one (a graceful close could wait forever on a peer that is gone)."""
    device = open_device(settings, int(os.environ.get("LOCAL_RANK", dist.get_rank())))
    with startup.phase("data"):
        tokenizer, data = prepare_data(cfg)
        model_cfg, ck_dtype = run_model_config(cfg, tokenizer, resume_from)
    with startup.phase("weights"):
        engine = make_engine(cfg, model_cfg, plan, settings, device, weights_source(cfg, resume_from))
        trainer = Trainer(cfg, engine, data, tokenizer, model_cfg, save_dtype_for(cfg, ck_dtype), startup=startup)
        if resume_from is not None:
            trainer.restore(ResumeState(resume_from))
    trainer.run()
    result = trainer.finish()
    engine.close()
    dist.destroy_process_group()
    return result


def spawn(cfg: Config, settings: ParallelSettings, plan: Plan | ZeroPlan, resume: str | None,
          startup: Startup) -> TrainResult:
    """Run the workers (supervised) and return rank 0's result."""
    cfg_dict = {"config": cfg.to_dict(), "source": cfg.source}
    startup.launched = time.time()
    results = run_workers(worker, (cfg_dict, settings, plan, resume, startup), settings.workers,
                          logging.getLogger().getEffectiveLevel())
    return results[0]
