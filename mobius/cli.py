"""The ``mobius`` command: thin entry points over the library.

Every user-facing failure is a :class:`mobius.errors.MobiusError`; it is printed as one line
(``mobius: error: ...``) and the process exits with code 2, never with a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from mobius import __version__
from mobius.app.supervise import Interrupted
from mobius.errors import MobiusError

# sub-command name -> module in mobius.commands exposing add_parser(subparsers) and run(args) -> int
COMMANDS = {
    "train": "mobius.commands.train",
    "plan": "mobius.commands.plan",
    "topo": "mobius.commands.topo",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mobius", description="Fine-tune large OPT / GPT-2 models on commodity GPU servers.")
    parser.add_argument("--version", action="version", version=f"mobius {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in COMMANDS.items():
        importlib.import_module(module).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        parser = build_parser()
        args, extra = parser.parse_known_args(argv)
        logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(message)s")
        if args.command is None:
            parser.print_help()
            return 2
        if extra and not getattr(args, "accepts_overrides", False):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = extra
        return int(args.func(args) or 0)
    except Interrupted as e:
        print(f"mobius: {e}", file=sys.stderr)
        return e.exit_code
    except MobiusError as e:
        print(f"mobius: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("mobius: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
