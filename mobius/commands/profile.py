"""``mobius profile CONFIG``: measure the run's units on this machine's GPU (the CPU without one) and
write their times as a profile file, which ``partition.profile_file`` plans with anywhere.

Examples::

    mobius profile run.yaml                              # -> unit_profile.json: forward and backward per kind
    mobius profile run.yaml --out box-4090.json --train.micro_batch_size=4
    mobius plan run.yaml --topology box.txt --partition.profile_file=box-4090.json   # elsewhere
"""

from __future__ import annotations

import argparse
import json
import os

from mobius.assemble import planned_architecture
from mobius.config import load_config
from mobius.errors import ConfigError
from mobius.files import write_failure, write_text_atomic


def configure(p: argparse.ArgumentParser) -> None:
    """The ``profile`` sub-command's arguments."""
    p.description = ("Measure one micro-batch's forward and backward of each kind of unit (embedding, block, head) of "
                     "the run's model on this machine's GPU (the CPU without one), at the run's micro-batch size, "
                     "sequence and precision, and write them as the JSON that partition.profile_file plans with. Any "
                     "configuration key can be overridden with --section.key=value.")
    p.add_argument("config", help="YAML run file (see configs/)")
    p.add_argument("--out", default="unit_profile.json", metavar="FILE",
                   help="where to write it (default: %(default)s)")
    p.set_defaults(func=run, accepts_overrides=True)


def run(args: argparse.Namespace) -> int:
    import torch

    from mobius.models import unit_specs
    from partition.profile import get_profile, profile_file_json

    cfg = load_config(args.config, args.overrides)
    if cfg.partition.profile_file:
        raise ConfigError("mobius profile measures the units; unset partition.profile_file, which would replace them")
    t = cfg.train
    threads = None if torch.cuda.is_available() else torch.get_num_threads()
    prof = get_profile(unit_specs(planned_architecture(cfg)), t.micro_batch_size, cfg.data.seq_len, t.precision,
                       "measured", None, cache_dir=os.path.join(cfg.partition.cache_dir, "partition"), threads=threads)
    data = profile_file_json(prof)
    try:
        write_text_atomic(args.out, json.dumps(data, indent=1) + "\n")
    except OSError as e:
        raise ConfigError(f"cannot write {args.out}: {write_failure(e)}") from None
    for kind, times in data["units"].items():
        print(f"  {kind:<6} forward {times['forward_ms']:9.3f} ms  backward {times['backward_ms']:9.3f} ms")
    print(f"wrote {args.out} (measured on {prof.device_name}; plan with --partition.profile_file={args.out})")
    return 0
