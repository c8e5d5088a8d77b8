"""`moet` command line: one module per subcommand under moet.commands, each with `register(subparsers)`."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from moet.errors import MoetError
from moet.knobs import describe

COMMANDS: tuple[str, ...] = ("serve", "bench", "supervise", "status", "install_units", "quantize", "inspect", "plan")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moet",
        description="Serve Mixture-of-Experts LLMs with 2-bit routed experts through vLLM.",
        epilog="Knobs (environment variables, also keys of config/models.yaml):\n" + describe(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"moet.commands.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point; everything after a bare `--` is passed through (e.g. to vLLM by `moet serve`)."""
    try:
        code = _run(list(sys.argv[1:] if argv is None else argv))
        sys.stdout.flush()  # a buffered tail written to a closed pipe fails here, not at interpreter exit
        return code
    except BrokenPipeError:
        # the reader left (`moet status | head`): stop quietly as coreutils do, and keep Python's exit-time
        # flush of stdout from raising again (the recipe in the signal module's documentation)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


def _run(argv: list[str]) -> int:
    passthrough: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1 :]
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    args.passthrough = passthrough
    try:
        return int(args.func(args) or 0)
    except MoetError as exc:
        print(f"moet: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
