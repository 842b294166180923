"""Worker processes of a multi-process run, and the device each process opens.

``mobius train`` in pipeline mode calls :func:`spawn`: one process per worker with a
torchrun-compatible environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``). Under ``torchrun`` the same :func:`worker` runs directly. If a worker fails, the
others are stopped and the error names the rank and the reason.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mobius.assemble import prepare_data, run_model_config, weights_source
from mobius.checkpoint import ResumeState
from mobius.config import Config, config_from_dict
from mobius.errors import MobiusError
from mobius.parallel import ParallelSettings
from mobius.trainer import Trainer, TrainResult, save_dtype_for
from partition.plan import Plan
from scheduler.engine import PipelineEngine

log = logging.getLogger(__name__)
TIMEOUT = timedelta(minutes=30)  # a collective that waits this long has lost its peer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def open_device(settings: ParallelSettings, local_rank: int) -> torch.device:
    """This process's device: ``cuda:<local rank mod GPUs>`` (capped when the settings say so), or the CPU."""
    torch.set_num_threads(settings.cpu_threads)
    if settings.device == "cpu":
        return torch.device("cpu")
    dev = torch.device("cuda", local_rank % settings.gpus)
    torch.cuda.set_device(dev)
    if settings.memory_capped:
        total = torch.cuda.get_device_properties(dev).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, settings.memory_bytes / total), dev)
    return dev


def worker(cfg_dict: dict, settings: ParallelSettings, plan: Plan, resume: str | None,
           results: "mp.SimpleQueue | None") -> TrainResult:
    """One worker: join the group, build the pipeline engine, run the shared training loop."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cfg = config_from_dict(cfg_dict["config"], cfg_dict["source"])
    if rank != 0:
        logging.getLogger().setLevel(logging.WARNING)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=TIMEOUT)
    try:
        device = open_device(settings, int(os.environ.get("LOCAL_RANK", rank)))
        resume_from = Path(resume) if resume else None
        tokenizer, data = prepare_data(cfg, resume_from)
        model_cfg, ck_dtype = run_model_config(cfg, tokenizer, resume_from)
        engine = PipelineEngine(cfg, model_cfg, plan, settings, device, weights_source(cfg, resume_from))
        trainer = Trainer(cfg, engine, data, tokenizer, model_cfg, save_dtype_for(cfg, ck_dtype))
        if resume_from is not None:
            trainer.restore(ResumeState(resume_from))
        try:
            trainer.run()
            result = trainer.finish()
        finally:
            engine.close()
        if results is not None and rank == 0:
            results.put(("ok", asdict(result)))
        return result
    finally:
        dist.destroy_process_group()


def _entry(local_rank: int, world: int, port: int, run_id: str, cfg_dict: dict, settings: ParallelSettings,
           plan: Plan, resume: str | None, results: "mp.SimpleQueue") -> None:
    os.environ.update(RANK=str(local_rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local_rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      MOBIUS_RUN_ID=run_id)
    logging.basicConfig(level=logging.INFO, format=f"[rank {local_rank}] %(message)s")
    try:
        worker(cfg_dict, settings, plan, resume, results)
    except MobiusError as e:
        results.put(("error", local_rank, str(e)))
        sys.exit(2)


def spawn(cfg: Config, settings: ParallelSettings, plan: Plan, resume: str | None) -> TrainResult:
    """Start one process per worker and wait; a failure anywhere stops them all."""
    cfg_dict = {"config": cfg.to_dict(), "source": cfg.source}
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # already started by torchrun
        return worker(cfg_dict, settings, plan, resume, None)
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    args = (settings.workers, free_port(), str(os.getpid()), cfg_dict, settings, plan, resume, results)
    procs = mp.start_processes(_entry, args=args, nprocs=settings.workers, join=False, start_method="spawn")
    try:
        while not procs.join(timeout=1.0):
            pass
    except mp.ProcessRaisedException as e:
        log.debug("%s", e)  # the worker's whole traceback, with -v
        raise MobiusError(f"worker rank {e.error_index} failed: {_last_line(str(e))}") from None
    except mp.ProcessExitedException as e:
        raise MobiusError(_exit_reason(e, results)) from None
    return _result(results)


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else text


def _exit_reason(e: "mp.ProcessExitedException", results: "mp.SimpleQueue") -> str:
    while not results.empty():
        item = results.get()
        if item[0] == "error":
            return f"worker rank {item[1]}: {item[2]}"
    if e.signal_name:
        return f"worker rank {e.error_index} was killed ({e.signal_name}); the other workers were stopped"
    return f"worker rank {e.error_index} exited with code {e.exit_code}; the other workers were stopped"


def _result(results: "mp.SimpleQueue") -> TrainResult:
    while not results.empty():
        item = results.get()
        if item[0] == "ok":
            r = item[1]
            return TrainResult(r["steps"], r["losses"], [tuple(x) for x in r["eval_losses"]],
                               Path(r["final_dir"]) if r["final_dir"] else None)
    raise MobiusError("the workers finished without reporting a result")
