"""The `disagg` command line: a front door that knows no command itself.

Each half of the project (the operator, the worker, and the rig where it is installed) declares its command
modules as `disagg.commands` entry points in pyproject.toml, so this module imports none of them by name and
an image without the rig simply has no `demo` or `bench`. Each command module exposes `register(subparsers)`,
adding its subcommands with a `func(args) -> int` default, and imports nothing heavy at module level (no
torch, no nixl, no kopf): the heavy parts load inside the command that needs them, so `disagg check` starts
fast and the operator stays free of torch/nixl.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points

COMMAND_GROUP = "disagg.commands"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="disagg",
        description=(
            "Disaggregated prefill/decode serving on Kubernetes: pre-flight checks, operator, KV worker."
        ),
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    # Sorted by entry-point name, so the help lists commands in the same order on every install.
    for command in sorted(entry_points(group=COMMAND_GROUP), key=lambda e: e.name):
        command.load()(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    result: int = func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
