"""The policies on the engine's own arguments: they agree with the spec, the release's `vllm serve` parses
them, and they split no context. Pure.

What the builders own is judged beside the table of flags they write (`builders.engine.arg_violations`);
every other argument is judged by the table of the release's own parser (`contracts.vllm_serve_argv`,
generated from each release), so what vLLM would refuse with exit status 2 is refused before any pod; context
parallelism, which the KV transfer cannot serve, is read from the user's extra arguments here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from disagg.operator.builders.engine import arg_violations, user_args, vllm_serve_args
from disagg.operator.policies.policy import PolicyInput
from disagg.worker.contracts.releases import release_of
from disagg.worker.contracts.vllm_serve_argv import UNRECOGNIZED, refused_engine_args, vllm_spelling
from disagg.worker.kv.errors import Violation
from disagg.worker.kv.rules import (
    decode_context_parallel,
    prefill_context_parallel,
)


def engine_arguments_agree(given: PolicyInput) -> Sequence[Violation]:
    return arg_violations(given.spec)


def engine_arguments_parse(given: PolicyInput) -> Sequence[Violation]:
    """Extra arguments the role's vLLM release refuses (an unknown flag, a missing value, an ambiguous
    abbreviation, a value its type or choices refuse: `--max-num-seqs abc`), judged in the whole argv the
    pod passes, as its parser reads it. The operator's own arguments always parse (an interop test holds
    them to every release's parser)."""
    found: list[Violation] = []
    for role in ("prefill", "decode"):
        argv = vllm_serve_args(given.spec, role)
        if argv is None:
            continue
        release = release_of(given.spec.effective(role, "version", given.spec.engine.version))
        if release is None:
            continue  # UnsupportedEngineVersion says so; no table to judge the arguments by
        written, kept = argv
        version = release.tested
        # The parser names a token as vLLM rewrote it (`--max_num_seqs` as `--max-num-seqs`): each the user's.
        users = {vllm_spelling(token): token for token in reversed(kept)} | {token: token for token in kept}
        for refused, why in refused_engine_args(version, [*written, *kept]):
            token = users.get(refused)
            if token is None:
                continue
            where = (
                "spec.engine.extraArgs" if token in given.spec.engine.extra_args else f"spec.{role}.extraArgs"
            )
            # The parser lists every unrecognized token at once; each violation names its own.
            reason = "not one of its options" if why.startswith(UNRECOGNIZED) else why
            violation = Violation(
                "UnknownEngineArgument",
                f"{where} sets {token!r}, which vLLM {version}'s `vllm serve` refuses ({reason}): remove or "
                "correct the argument",
            )
            if violation not in found:
                found.append(violation)
    return found


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
