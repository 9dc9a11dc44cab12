"""The engine-argument check against the option table of vLLM 0.33's own `vllm serve` parser
(`disagg.worker.contracts.vllm_serve_options`, written by hack/vllm/serve_options.py from the release):
every spelling vLLM's argparse would read as a flag the operator owns, abbreviations included, is judged as
that flag, and nothing vLLM reads as another option is."""

from __future__ import annotations

from typing import Any

import pytest
from dd_specs import HMA_ON, spec, spec_dict, valid_document

from disagg.operator.builders.engine import ARG_CONFLICT_REASON, arg_violations
from disagg.operator.control.reconcile import judge
from disagg.operator.naming import Installation
from disagg.worker.contracts.vllm_serve_argv import ServeAction, serve_parser

PARSER = serve_parser("0.33.0")
ACTIONS: dict[str, ServeAction] = dict(PARSER.actions)
# What the operator decides for a PP2 prefill of a vLLM image (the example spec), one spelling per action.
OWNED = {
    ACTIONS[option]
    for option in (
        "--tensor-parallel-size",
        "--pipeline-parallel-size",
        "--block-size",
        "--dtype",
        "--kv-cache-dtype",
        "--kv-transfer-config",
        "--port",
        "--disable-hybrid-kv-cache-manager",
        "--nnodes",
        "--master-addr",
        "--master-port",
        "--node-rank",
        "--headless",
        "--model",
        "--config",
    )
}
# With HMA_ON the example spec leaves the hybrid KV cache manager on: these spellings agree with it.
AGREEING = {"--enable-hybrid-kv-cache-manager", "--no-disable-hybrid-kv-cache-manager"}


def argparse_reads(token: str) -> set[ServeAction]:
    """The actions vLLM's parser (argparse, Python 3.11, allow_abbrev on) could read `token` as: an exact
    option, else every option it is a prefix of (more than one is argparse's "ambiguous option" error)."""
    if token in ACTIONS:
        return {ACTIONS[token]}
    if token.startswith("--"):
        return {action for option, action in ACTIONS.items() if option.startswith(token)}
    return {
        action
        for option, action in ACTIONS.items()
        if not option.startswith("--") and (option == token[:2] or option.startswith(token))
    }


def refused(*extra: str) -> bool:
    model = spec({**HMA_ON, "prefill": {"extraArgs": list(extra)}})
    return any(violation.reason == ARG_CONFLICT_REASON for violation in arg_violations(model))


def contradicting(option: str) -> list[str]:
    """`option` with a value no example-spec field has (switches take none)."""
    return [option] if ACTIONS[option].nargs == 0 else [option, "7"]


def test_vllms_parser_reads_abbreviations() -> None:
    assert PARSER.release == "0.33.0"
    assert PARSER.allow_abbrev is True


@pytest.mark.parametrize("option", sorted(o for o, a in ACTIONS.items() if a in OWNED))
def test_every_spelling_vllm_has_for_an_owned_flag_is_judged(option: str) -> None:
    assert refused(*contradicting(option)) is (option not in AGREEING)


def test_every_abbreviation_vllm_reads_as_an_owned_flag_is_refused_and_no_other_option_is() -> None:
    judged = 0
    for option, action in ACTIONS.items():
        if action not in OWNED or option in AGREEING:
            continue
        for length in range(2, len(option)):
            prefix = option[:length]
            if prefix in ("-", "--"):
                continue
            dests = argparse_reads(prefix)
            value = [prefix] if action.nargs == 0 else [prefix, "7"]
            if dests == {action}:
                assert refused(*value), prefix
                judged += 1
            elif len(dests) == 1:
                # Exactly another option (a prefix of an owned spelling that vLLM reads as something else).
                assert not refused(*value), prefix
    assert judged > 100


@pytest.mark.parametrize("option", ["--kv-transfer-config", "--kv-transfer", "--block-size", "-tp"])
def test_a_dotted_key_of_an_owned_flag_is_refused(option: str) -> None:
    assert refused(f"{option}.kv_role", "kv_producer")
    assert refused(f"{option}.kv_role=kv_producer")


def test_every_spelling_vllm_reads_as_the_prefill_context_parallel_size_is_refused() -> None:
    judged = 0
    for option, action in ACTIONS.items():
        if action != ACTIONS["--prefill-context-parallel-size"]:
            continue
        for length in range(2, len(option) + 1):
            prefix = option[:length]
            if argparse_reads(prefix) != {action}:
                continue
            document = valid_document({"prefill": {"extraArgs": [prefix, "2"]}})
            verdict = judge(document["spec"], Installation(worker_image="w:1"))
            assert "PrefillContextParallel" in [v.reason for v in verdict.violations], prefix
            judged += 1
    assert judged > 10


def unknown(**extra_args: list[str]) -> list[str]:
    """The UnknownEngineArgument messages judge gives a spec with these extra arguments per place."""
    patch: dict[str, Any] = {place: {"extraArgs": args} for place, args in extra_args.items()}
    patch.setdefault("engine", {})
    verdict = judge(spec_dict(spec(patch)), Installation(worker_image="w:1"))
    return [v.message for v in verdict.violations if v.reason == "UnknownEngineArgument"]


def test_an_argument_no_vllm_option_has_is_refused_once_with_where_it_came_from() -> None:
    found = unknown(engine=["--max-model-len", "4096", "--frobnicate"], decode=["--enforce-eagr"])
    assert found == [
        "spec.engine.extraArgs sets '--frobnicate', which vLLM 0.33.0's `vllm serve` refuses (not one of its "
        "options): remove or correct the argument",
        "spec.decode.extraArgs sets '--enforce-eagr', which vLLM 0.33.0's `vllm serve` refuses (not one of "
        "its options): remove or correct the argument",
    ]


@pytest.mark.parametrize(
    "args",
    [
        ["--max-model-len", "4096"],
        ["--enforce_eager"],
        ["--gpu-memory-util", "0.5"],
        ["--compilation-config.mode", "3"],
        ["--no-enable-prefix-caching"],
    ],
)
def test_arguments_vllm_reads_are_kept(args: list[str]) -> None:
    assert unknown(engine=args) == []


def test_a_missing_value_and_an_ambiguous_abbreviation_are_refused_as_vllm_words_them() -> None:
    (missing,) = unknown(decode=["--max-num-seqs"])
    assert "'--max-num-seqs'" in missing and "expected one argument" in missing
    (ambiguous,) = unknown(decode=["--max-num", "8"])
    assert "ambiguous option" in ambiguous


def test_the_table_of_the_roles_release_judges() -> None:
    # 0.33 has both --enable-x and --disable-x for a boolean pair; 0.31 has only --x and --no-x.
    parser_31, parser_33 = serve_parser("0.31.0"), serve_parser("0.33.0")
    only_33 = sorted(set(parser_33.actions) - set(parser_31.actions))
    flag = next(o for o in only_33 if o.startswith("--") and parser_33.actions[o].nargs == 0)
    assert unknown(engine=[flag]) == []
    older = judge(
        spec_dict(spec({"engine": {"version": "0.31.0", "extraArgs": [flag]}})),
        Installation(worker_image="w:1"),
    )
    assert [v.reason for v in older.violations] == ["UnknownEngineArgument"], older.violations


@pytest.mark.parametrize(
    ("args", "why"),
    [
        (["--max-num-seqs", "abc"], "argument --max-num-seqs: invalid int value: 'abc'"),
        (["--seed=x"], "argument --seed: invalid int value: 'x'"),
        (["--max-model-len", "lots"], "invalid human_readable_int_or_auto value: 'lots'"),
        (["--gpu-memory-utilization", "high"], "--gpu-memory-utilization: invalid float value: 'high'"),
        (["--chat-template-content-format", "xml"], "invalid choice: 'xml' (choose from 'auto', 'openai'"),
        (["--max-model-len", "1.5K"], "invalid human_readable_int_or_auto value: '1.5K'"),
    ],
)
def test_a_value_the_releases_parser_refuses_is_refused_with_its_words(args: list[str], why: str) -> None:
    (found,) = unknown(decode=args)
    assert found.startswith(
        f"spec.decode.extraArgs sets {args[0]!r}, which vLLM 0.33.0's `vllm serve` refuses"
    )
    assert why in found


def test_a_value_after_an_underscore_spelling_is_refused_under_the_users_spelling() -> None:
    (found,) = unknown(engine=["--max_num_seqs", "many"])
    assert found.startswith("spec.engine.extraArgs sets '--max_num_seqs'") and "invalid int value" in found


@pytest.mark.parametrize(
    "args",
    [
        ["--max-model-len", "2k"],
        ["--max-model-len", "auto"],
        ["--max-num-seqs", " 8 "],
        ["--gpu-memory-utilization=0.8"],
        ["--chat-template-content-format", "openai"],
        ["--moe-backend", "Deep-Gemm"],
        ["--collect-detailed-traces", "None"],
    ],
)
def test_values_the_releases_parser_converts_are_kept(args: list[str]) -> None:
    assert unknown(engine=args) == []


def test_a_value_nested_past_the_parsers_stack_is_refused_not_raised() -> None:
    deep = "[" * 3000
    assert len(unknown(engine=["--compilation-config.mode", deep])) == 1
    assert len(unknown(engine=["--allowed-origins", deep])) == 1
