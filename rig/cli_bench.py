"""`disagg bench`: every benchmark, each printing its ratio against a baseline measured in the same run.

Each benchmark runs in its own interpreter: the push benchmark loads NIXL, which the operator package never
imports, and a fresh process keeps one benchmark's memory and threads out of the next one's numbers.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from typing import Any

BENCHMARKS: dict[str, tuple[str, str]] = {
    "routing": ("disagg.rig.bench_routing", "descriptor ids: numpy against a pure-Python baseline"),
    "push": ("disagg.rig.bench_push", "KV push over NIXL against numpy.copyto of the same bytes"),
    "operator": (
        "disagg.rig.bench_operator",
        "apply-to-Compatible latency and {deployments} deployments end to end",
    ),
    "router": ("disagg.rig.bench_router", "the router's added latency against calling the engines directly"),
    "rollout": (
        "disagg.rig.bench_rollout",
        "engine 0.32.0 -> 0.33.0 under load through the router: failures, pairs, surge, duration",
    ),
    "autoscale": (
        "disagg.rig.bench_autoscale",
        "load 1 -> 16 -> 1 on an autoscaled deployment: time to scale, SLO attainment, failed requests",
    ),
    "vllm": (
        "disagg.rig.bench_vllm",
        "real vLLM engines behind disagg's router and vllm-router at concurrency 1, 8, 32, hop by hop",
    ),
}


def _run(args: argparse.Namespace) -> int:
    names = list(BENCHMARKS) if args.which == "all" else [args.which]
    failed = []
    for name in names:
        module, what = BENCHMARKS[name]
        print(f"== bench {name}: {what.format(deployments=args.deployments or 100)}", flush=True)
        # -P keeps the working directory off sys.path: the repository's operator/ folder would shadow the
        # standard library's operator module.
        extra = ["--deployments", str(args.deployments)] if name == "operator" and args.deployments else []
        code = subprocess.call([sys.executable, "-P", "-m", module, *extra])
        if code != 0:
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("bench", help="run the benchmarks and print their ratios")
    parser.add_argument("which", nargs="?", choices=[*BENCHMARKS, "all"], default="all")
    parser.add_argument(
        "--deployments",
        type=int,
        metavar="N",
        help="DisaggDeployments the operator bench reconciles end to end (default 100; 1000: scale).",
    )
    parser.set_defaults(func=_run)
