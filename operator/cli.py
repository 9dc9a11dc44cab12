"""The `disagg` command line.

Each command module exposes `register(subparsers)`, adding its subcommands with a `func(args) -> int` default.
Command modules import nothing heavy at module level (no torch, no nixl, no kopf): the heavy parts load
inside the command that needs them, so `disagg check` starts fast and the operator stays free of torch/nixl.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

COMMAND_MODULES: tuple[str, ...] = (
    "disagg.worker.cli_wire",
    "disagg.operator.cli_check",
    "disagg.operator.cli_operator",
    "disagg.worker.cli_worker",
    "disagg.worker.cli_probe",
    "disagg.operator.cli_bench",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="disagg",
        description=(
            "Disaggregated prefill/decode serving on Kubernetes: pre-flight checks, operator, KV worker."
        ),
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
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
