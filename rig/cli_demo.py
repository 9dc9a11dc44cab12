"""`disagg demo`: the data path on this machine (2 PP prefill stages + 1 decoder, each with its sidecar)."""

from __future__ import annotations

import argparse
from typing import Any


def register(subparsers: Any) -> None:
    demo = subparsers.add_parser(
        "demo",
        help="run 2 PP prefill stages + 1 decoder with sidecars on loopback; compare with the monolithic run",
    )
    demo.add_argument("--prompts", type=int, default=5, help="how many of the built-in prompts to send (1-5)")
    demo.add_argument("--max-new-tokens", type=int, default=16)
    demo.set_defaults(func=_demo)


def _demo(args: argparse.Namespace) -> int:
    from disagg.rig.demo import DEFAULT_PROMPTS, run_demo

    if not 1 <= args.prompts <= len(DEFAULT_PROMPTS):
        print(f"--prompts must be between 1 and {len(DEFAULT_PROMPTS)}")
        return 2
    if args.max_new_tokens < 1:
        print("--max-new-tokens must be at least 1")
        return 2
    code: int = run_demo(
        DEFAULT_PROMPTS[: args.prompts], args.max_new_tokens, out=lambda line: print(line, flush=True)
    )
    return code
