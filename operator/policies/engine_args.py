"""The policies on the engine's own arguments: they agree with the spec, and split no context. Pure.

What the builders own is judged beside the table of flags they write (`builders.engine.arg_violations`);
context parallelism, which the KV transfer cannot serve, is read from the user's extra arguments here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from disagg.operator.builders.engine import arg_violations, user_args
from disagg.operator.policies.policy import PolicyInput
from disagg.worker.kv.errors import Violation
from disagg.worker.kv.rules import (
    decode_context_parallel,
    prefill_context_parallel,
)


def engine_arguments_agree(given: PolicyInput) -> Sequence[Violation]:
    return arg_violations(given.spec)


def prefill_context_is_not_split(given: PolicyInput) -> Sequence[Violation]:
    """A prefill engine started with prefill context parallelism (`--prefill-context-parallel-size`)."""
    size = flag_value(user_args(given.spec, "prefill"), PCP_FLAGS)
    # isdecimal, not isdigit: int() refuses digits such as "²" that isdigit accepts.
    violation = prefill_context_parallel(int(size)) if size is not None and size.isdecimal() else None
    return [] if violation is None else [violation]


def decode_context_is_not_split(given: PolicyInput) -> Sequence[Violation]:
    """A decode engine started with decode context parallelism (`--decode-context-parallel-size`)."""
    size = flag_value(user_args(given.spec, "decode"), DCP_FLAGS)
    violation = decode_context_parallel(int(size)) if size is not None and size.isdecimal() else None
    return [] if violation is None else [violation]


PCP_FLAGS: Final = ("--prefill-context-parallel-size", "-pcp")


DCP_FLAGS: Final = ("--decode-context-parallel-size", "-dcp")


def flag_value(args: Sequence[str], spellings: Sequence[str]) -> str | None:
    """The last value an engine argument list gives one flag (`--flag value` or `--flag=value`), if any, read
    as vLLM's parser reads it: underscores for dashes, and a prefix of a spelling for it (argparse's
    abbreviations, `builders.engine`)."""
    found: str | None = None
    for index, token in enumerate(args):
        name, has_inline, inline = token.partition("=")
        flag = name.replace("_", "-") if name.startswith("--") else name
        if flag in ("-", "--") or not flag.startswith("-"):
            continue
        if not any(spelling.startswith(flag) for spelling in spellings):
            continue
        if has_inline:
            found = inline
        elif index + 1 < len(args):
            found = args[index + 1]
    return found
