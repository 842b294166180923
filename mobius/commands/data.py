"""``mobius data CONFIG [--section.key=value ...]``: what a run trains on, before it trains.

Prints a few records as the model will see them (conversations as their chat template renders them, the
target text marked: coloured on a terminal, else between ⟦ and ⟧) and the totals: records, tokens, target
tokens, blocks, packing efficiency, and the records left out or truncated and why. It tokenizes into
``data.cache_dir`` exactly as ``mobius train`` does, which then starts from that cache.

Examples::

    mobius data configs/chat-demo.yaml
    mobius data run.yaml --data.train_on=all --show 5
"""

from __future__ import annotations

import argparse
import sys

from mobius.config import describe_fields, load_config


def configure(p: argparse.ArgumentParser) -> None:
    """The ``data`` sub-command's arguments."""
    p.description = ("Show what a run trains on: a few records as rendered with their targets marked, and the "
                     "totals (records, tokens, target tokens, blocks, packing efficiency, records left out and "
                     "why). Any configuration key can be overridden with --section.key=value.")
    p.epilog = "configuration keys:\n" + describe_fields()
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("config", help="YAML run file (see configs/)")
    p.add_argument("--show", type=int, default=3, metavar="N", help="records to print (default: %(default)s)")
    p.add_argument("--color", choices=("auto", "always", "never"), default="auto",
                   help="colour the targets (auto: on a terminal) or mark them with ⟦ ⟧")
    p.set_defaults(func=run, accepts_overrides=True)


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    cfg.check_ready()
    from mobius.assemble import prepare_data  # (imports torch: after the config's checks)
    from mobius.data.report import report

    tokenizer, data = prepare_data(cfg)
    colour = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
    print(report(data, tokenizer, cfg.data.path, max(0, args.show), colour))
    return 0
