"""``mobius train CONFIG [--section.key=value ...] [--resume [DIR]]``; also every process of
``torchrun --nnodes N --nproc-per-node G -m mobius train CONFIG``."""

from __future__ import annotations

import argparse
import contextlib
import logging

from mobius.app.settings import Torchrun
from mobius.app.supervise import stop_on_signals
from mobius.config import describe_fields, load_config
from mobius.errors import ConfigError

log = logging.getLogger(__name__)


def configure(p: argparse.ArgumentParser) -> None:
    """The ``train`` sub-command's arguments."""
    p.description = ("Train or fine-tune a model. Any configuration key can be overridden with --section.key=value "
                     "(e.g. --train.max_steps=10).")
    p.epilog = "configuration keys:\n" + describe_fields()
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("config", help="YAML run file (see configs/)")
    p.add_argument("--resume", nargs="?", const="auto", default=None, metavar="DIR",
                   help="continue from the latest step checkpoint in output.dir, or from DIR")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the run output.dir already holds (its metrics, plan, checkpoints and final model): "
                        "kept aside until this run's first checkpoint, put back if it ends before")
    p.set_defaults(func=run, accepts_overrides=True)


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    if args.resume and args.overwrite:
        raise ConfigError("--resume continues the run in output.dir and --overwrite replaces it: pass one of them")
    from mobius.app.run import train  # the heavy imports only when training, after the config's checks

    run = Torchrun.from_env()
    with stop_on_signals() if run is None else contextlib.nullcontext():  # torchrun's agent stops its processes
        result = train(cfg, resume=args.resume, overwrite=args.overwrite)
    if run is not None and run.rank != 0:  # rank 0 reports the run
        return 0
    first, last = result.losses[0] if result.losses else float("nan"), result.losses[-1] if result.losses else float("nan")
    ev = f", eval loss {result.eval_losses[-1][1]:.4f}" if result.eval_losses else ""
    print(f"done: {result.steps} steps, loss {first:.4f} -> {last:.4f}{ev}; checkpoint: {result.final_dir}")
    return 0
