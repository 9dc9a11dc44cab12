"""`disagg worker`: the KV worker sidecar of an engine pod.

`disagg worker` reads its whole configuration from the environment and the topology file it names (see
`disagg.worker.sidecar.config`); `disagg worker sidecar --mode transfer|watch` is the same command as the
operator's pod spec spells it.
"""

from __future__ import annotations

import argparse
from typing import Any


def register(subparsers: Any) -> None:
    worker = subparsers.add_parser(
        "worker",
        help="run the KV worker sidecar (configured by DISAGG_* environment variables and a topology file)",
        description=(
            "Run the KV worker sidecar. transfer: owns the NIXL agent, registers the engine's KV pool, "
            "serves the side channel and pushes KV with layer-name routing. watch: the engine moves its own "
            "KV (vLLM's NixlPushConnector); the sidecar handshakes the engine's side channel and its peers' "
            "and reports to its Pod, moving no data. Exits 0 on SIGTERM."
        ),
    )
    worker.add_argument(
        "role_command", nargs="?", choices=["sidecar"], help="the only worker process (default)"
    )
    worker.add_argument(
        "--mode",
        choices=["transfer", "watch"],
        default="transfer",
        help="transfer: the sidecar moves the engine's KV itself; watch: the engine does, this reports",
    )
    worker.add_argument(
        "--interval",
        type=float,
        default=10.0,
        help="watch: seconds between rounds of handshakes and reports (default 10)",
    )
    worker.set_defaults(func=_worker)


def _worker(args: argparse.Namespace) -> int:
    if args.mode == "watch":
        from disagg.worker.reporting.watch import main as watch

        if args.interval <= 0:
            print("--interval must be positive")
            return 2
        watched: int = watch(interval_s=args.interval)
        return watched
    from disagg.worker.cli.transfer import main

    code: int = main()
    return code
