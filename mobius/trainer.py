"""The training loop shared by every engine: schedule, data, evaluation, metrics, checkpoints, resume.

Run directory layout (``output.dir``)::

    metrics.jsonl                 one JSON object per logged step (step, loss, lr, tokens_per_s, target_tokens, ...)
    checkpoints/step-000050/      HF checkpoint (fp32) + tokenizer + optimizer moments + trainer_state.json
                                  (+ the compute weights under train.update=delayed)
    final/                        HF checkpoint in output.save_dtype + tokenizer
    loss.png                      the loss curve (output.plot)
    .mobius-lock                  while a run uses the directory (mobius.app.rundir)
    .mobius-replaced/             the run --overwrite replaces, until this run's first checkpoint

Checkpoints go through :mod:`mobius.checkpoint` (one format for every mode).
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import math
import os
import random
import re
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from mobius import checkpoint
from mobius.batch import step_targets
from mobius.checkpoint import STATE_FILE, STATE_FORMAT, ResumeState
from mobius.config import Config
from mobius.data import TextTokenizer, TrainData
from mobius.engine import DTYPES, Engine, StepStats
from mobius.errors import CheckpointError, MobiusError
from mobius.files import drop_replaced, write_failure, write_text_atomic
from mobius.models import ModelConfig
from mobius.optim import lr_at

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    steps: int
    losses: list[float] = field(default_factory=list)
    eval_losses: list[tuple[int, float]] = field(default_factory=list)
    final_dir: Path | None = None
    merged_dir: Path | None = None  # LoRA with output.save_merged: the adapters folded into the base model


def process_start_time() -> float:
    """When this process started (wall clock), from /proc on Linux; elsewhere when this module was
    imported."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return _IMPORTED


_IMPORTED = time.time()


@dataclass
class Startup:
    """Where the time before a run's first training step goes: seconds per phase (``data``: tokenizing
    or mapping the token cache and the resume checks; ``plan``: profiling and planning; ``workers``:
    starting the worker processes; ``weights``: building the model and loading or initialising its
    weights), counted from ``started``, the wall-clock start of the ``mobius`` process. What no phase
    covers (imports, the config, the run directory) is ``start``. Workers get the parent's copy."""

    started: float = field(default_factory=process_start_time)
    phases: dict[str, float] = field(default_factory=dict)
    launched: float | None = None  # when the parent launched the workers (wall clock)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)

    def add(self, name: str, seconds: float) -> None:
        self.phases[name] = self.phases.get(name, 0.0) + seconds

    def record(self) -> dict:
        """``{"ready_s": total, "ready": {phase: seconds}}`` now, for metrics.jsonl."""
        total = time.time() - self.started
        split = {k: round(v, 3) for k, v in sorted(self.phases.items(), key=lambda kv: -kv[1])}
        split["start"] = round(max(0.0, total - sum(self.phases.values())), 3)
        return {"ready_s": round(total, 3), "ready": split}

    @staticmethod
    def line(record: dict) -> str:
        """"ready in 14.2 s: weights 9.1 s, data 1.0 s, plan 2.8 s, workers 1.3 s, start 0.4 s"."""
        parts = ", ".join(f"{k} {v:.1f} s" for k, v in record["ready"].items())
        return f"ready in {record['ready_s']:.1f} s: {parts}"


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _unb64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def rng_state() -> dict:
    """Every RNG's state as JSON-ready values."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
             "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(gauss)],
             "torch": _b64(torch.get_rng_state())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_unb64(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_unb64(s) for s in state["cuda"]])


def step_checkpoints(out_dir: Path) -> list[Path]:
    """Resumable step checkpoints in a run directory, oldest first."""
    root = out_dir / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if re.fullmatch(r"step-\d+", p.name) and (p / STATE_FILE).is_file())


class Trainer:
    """Drives an engine through ``train.max_steps`` optimizer steps."""

    def __init__(self, cfg: Config, engine: Engine, data: TrainData, tokenizer: TextTokenizer,
                 model_cfg: ModelConfig, save_dtype: torch.dtype, tokens_per_step: int | None = None,
                 startup: Startup | None = None):
        self.cfg, self.engine, self.data, self.tokenizer = cfg, engine, data, tokenizer
        self.startup = startup
        self.model_cfg, self.save_dtype = model_cfg, save_dtype
        self.out = Path(cfg.output.dir)
        self.step = 0
        self.result = TrainResult(steps=0)
        self.tokens_per_step = tokens_per_step or cfg.train.micro_batch_size * cfg.train.micro_batches * cfg.data.seq_len
        self.main = engine.is_main

    # ---- resume -------------------------------------------------------------------------------
    def restore(self, resume: ResumeState) -> None:
        """Restore optimizer, schedule position, data position and RNG from a checkpoint."""
        state = resume.trainer
        try:
            self.engine.load_state(resume)
            self._restore_data(state["data"])
            set_rng_state(state["rng"])
            self.step = int(state["step"])
            self.result.losses = [float(x) for x in state.get("losses", [])]
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{resume.path / STATE_FILE}: incomplete or malformed trainer state "
                                  f"({type(e).__name__}: {e})") from None
        self._truncate_metrics()
        log.info("resumed at step %d", self.step)

    def _restore_data(self, saved: dict) -> None:
        """The data position; on new data (``data.accept_new_data``, checked before the run started) the
        data is read from its start in a fresh order."""
        now = self.data.state_dict()
        same = saved["train_blocks"] == now["train_blocks"] and saved.get("fingerprint", now["fingerprint"]) == \
            now["fingerprint"]
        if same or not self.cfg.data.accept_new_data:
            self.data.load_state_dict(saved)
        else:
            log.debug("data.accept_new_data: the data changed since the checkpoint; reading it from its start")

    def _truncate_metrics(self) -> None:
        """Drop metrics lines written after the checkpoint (a run that went on and then stopped)."""
        file = self.out / "metrics.jsonl"
        if file.is_file() and self.main:
            keep = [line for line in file.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= self.step]
            write_text_atomic(file, "".join(line + "\n" for line in keep))

    def _trainer_state(self, engine_state: checkpoint.RankState) -> dict:
        return {"format": STATE_FORMAT, "step": self.step, "data": self.data.state_dict(), "rng": rng_state(),
                "losses": self.result.losses, "config": self.cfg.to_dict(), "tokenizer": self.tokenizer.name,
                "engine": {"optimizer_step": engine_state.optimizer_step, "scaler": engine_state.scaler}}

    # ---- checkpoints --------------------------------------------------------------------------
    def save(self, path: Path, dtype: torch.dtype, resumable: bool) -> Path:
        """One checkpoint, written by every rank of the engine together (see :mod:`mobius.checkpoint`).
        A write that fails (a full disk) is a CheckpointError naming the last complete checkpoint."""
        rank_state = self.engine.rank_state(with_moments=resumable, frozen=self.model_cfg.lora is None)
        state = self._trainer_state(rank_state) if resumable else None

        def extra(tmp: Path) -> None:
            self.tokenizer.save(tmp)
            if state is not None:
                (tmp / STATE_FILE).write_text(json.dumps(state) + "\n")
            (tmp / "mobius.json").write_text(json.dumps({"step": self.step, "config": self.cfg.to_dict()}, indent=2))

        try:
            saved = checkpoint.save(path, self.model_cfg, dtype, rank_state, self.engine.comm, resumable, extra,
                                    base=self.cfg.model.checkpoint)
        except CheckpointError as e:
            last = step_checkpoints(self.out)
            kept = f"the last complete checkpoint, {last[-1]}, is intact (--resume continues from it)" if last else \
                "no earlier checkpoint of this run exists"
            raise CheckpointError(f"{e}; {kept}") from None
        if self.main:
            drop_replaced(self.out)  # this run has a checkpoint: the run --overwrite replaced can go
        return saved

    def save_merged(self, path: Path, dtype: torch.dtype) -> Path:
        """The base model with the adapters merged in, as a plain Hugging Face checkpoint."""
        import dataclasses

        from mobius.models.lora import merge

        weights = merge(self.engine.rank_state(with_moments=False).weights, self.model_cfg, dtype)
        plain = dataclasses.replace(self.model_cfg, lora=None)
        return checkpoint.save(path, plain, dtype, checkpoint.RankState(weights), self.engine.comm,
                               extra=self.tokenizer.save)

    def _save_step(self) -> None:
        self.save(self.out / "checkpoints" / f"step-{self.step:06d}", torch.float32, resumable=True)
        if self.main:
            for old in step_checkpoints(self.out)[:-self.cfg.output.keep_last]:
                shutil.rmtree(old, ignore_errors=True)

    # ---- the loop -----------------------------------------------------------------------------
    def evaluate(self) -> float:
        batches = list(self.data.eval_batches(self.cfg.train.micro_batch_size, self.cfg.train.eval_batches))
        return self.engine.evaluate(batches) if batches else float("nan")

    def _one_step(self) -> tuple[StepStats, float, float, int]:
        """One optimizer step: its statistics, learning rate, seconds and target tokens."""
        t = self.cfg.train
        lr = lr_at(self.step, t)
        batches = [self.data.next_batch(t.micro_batch_size) for _ in range(t.micro_batches)]
        start = time.perf_counter()
        stats = self.engine.train_step(self.step, batches, lr, self._upcoming())
        seconds = stats.seconds if stats.seconds is not None else time.perf_counter() - start
        return stats, lr, seconds, step_targets(batches)

    def _upcoming(self) -> tuple[list, float] | None:
        """The next step's batches and learning rate for an engine that may start it early, unless this step
        ends in a checkpoint, an evaluation or the run (their state is this step's)."""
        t, o, done = self.cfg.train, self.cfg.output, self.step + 1  # steps done once this one has
        if (not self.engine.looks_ahead or done >= t.max_steps or (o.save_every and done % o.save_every == 0)
                or (t.eval_every and done % t.eval_every == 0)):
            return None
        return self.data.peek_batches(t.micro_batch_size, t.micro_batches), lr_at(done, t)

    def run(self) -> TrainResult:
        from tqdm import tqdm

        t, o = self.cfg.train, self.cfg.output
        with output_errors(self.out, "metrics.jsonl"):
            self.out.mkdir(parents=True, exist_ok=True)
            metrics = (self.out / "metrics.jsonl").open("a" if self.step else "w") if self.main else open(os.devnull, "w")
        tty = sys.stderr.isatty() and self.main
        bar = tqdm(total=t.max_steps, initial=self.step, desc="train", unit="step", disable=not tty, dynamic_ncols=True)
        quiet_every = max(1, t.max_steps // 20)
        ready = self._ready()
        try:
            while self.step < t.max_steps:
                stats, lr, dt, targets = self._one_step()
                self.step += 1
                self.result.losses.append(stats.loss)
                record = {**self._record(stats, lr, dt, targets), **ready}
                if self.step % t.log_every == 0 or self.step == t.max_steps:
                    with output_errors(self.out, "metrics.jsonl"):
                        metrics.write(json.dumps(record) + "\n")
                        metrics.flush()
                    ready = {}  # the first line written carries it
                bar.set_postfix(loss=f"{stats.loss:.4f}", tok_s=f"{record['tokens_per_s']:.0f}", lr=f"{lr:.2e}")
                bar.update(1)
                if self.main and not tty and (self.step % quiet_every == 0 or self.step == t.max_steps):
                    log.info("step %d/%d  loss %.4f  lr %.2e  %.0f tok/s", self.step, t.max_steps, stats.loss, lr,
                             record["tokens_per_s"])
                if o.save_every and self.step % o.save_every == 0 and self.step < t.max_steps:
                    self._save_step()
        finally:
            bar.close()
            metrics.close()
        return self.result

    def _ready(self) -> dict:
        """The start-up's split (:class:`Startup`), logged once before the first step; {} without one."""
        if self.startup is None:
            return {}
        record = self.startup.record()
        if self.main:
            log.info("%s", Startup.line(record))
        return record

    def _record(self, stats: StepStats, lr: float, dt: float, targets: int) -> dict:
        t = self.cfg.train
        record = {"step": self.step, "loss": round(stats.loss, 6), "lr": lr,
                  "tokens_per_s": round(self.tokens_per_step / dt, 1), "step_s": round(dt, 4), "target_tokens": targets,
                  "grad_norm": round(stats.grad_norm, 6) if math.isfinite(stats.grad_norm) else None,
                  "update": t.update}
        if stats.skipped or stats.loss_scale != 1.0:
            record.update(skipped=stats.skipped, loss_scale=stats.loss_scale)
        if stats.extra:
            record.update(stats.extra)
        if torch.cuda.is_available() and torch.cuda.is_initialized():  # this process's GPU (rank 0's in a pipeline)
            record["gpu_peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
        if (t.eval_every and self.step % t.eval_every == 0) or self.step == t.max_steps:
            ev = self.evaluate()
            self.result.eval_losses.append((self.step, ev))
            record.update(eval_loss=round(ev, 6), eval_ppl=round(math.exp(min(ev, 50.0)), 3))
            log.debug("step %d eval loss %.4f", self.step, ev)
        return record

    def finish(self) -> TrainResult:
        """Write the final checkpoint (and the loss plot) after :meth:`run`."""
        self.result.steps = self.step
        self.result.final_dir = self.save(self.out / "final", self.save_dtype, resumable=self.save_dtype == torch.float32)
        if self.model_cfg.lora is not None and self.cfg.output.save_merged:
            self.result.merged_dir = self.save_merged(self.out / "merged", self.save_dtype)
        if self.cfg.output.plot and self.main:
            with output_errors(self.out, "loss.png"):
                plot_losses(self.out / "metrics.jsonl", self.out / "loss.png")
        return self.result


@contextlib.contextmanager
def output_errors(out: Path, what: str) -> Iterator[None]:
    """A write into ``output.dir`` that fails mid-run (a full disk) becomes one line naming the file."""
    try:
        yield
    except OSError as e:
        raise MobiusError(f"cannot write {what} in output.dir {out}: {write_failure(e)}") from None


def plot_losses(metrics_file: Path, png: Path) -> None:
    """Draw the training (and eval) loss curve into ``png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label="train loss")
    ev = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    if ev:
        ax.plot(*zip(*ev), "o-", label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = png.with_name(f".{png.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, png)
    log.info("loss plot: %s", png)


def save_dtype_for(cfg: Config, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
    if cfg.output.save_dtype != "auto":
        return DTYPES[cfg.output.save_dtype]
    return checkpoint_dtype or torch.float32
