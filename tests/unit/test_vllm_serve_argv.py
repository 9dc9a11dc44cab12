"""`refused_engine_args`: vLLM's `vllm serve` parser emulated from the shipped option tables, without vLLM
(tests/interop/test_serve_options_interop.py checks it against each release's own parser)."""

from __future__ import annotations

import pytest

from disagg.worker.contracts.releases import RELEASES
from disagg.worker.contracts.vllm_serve_argv import refused_engine_args, serve_parser
from disagg.worker.contracts.vllm_serve_options import SERVE_OPTIONS

MODEL = "org/model"


def refused(*args: str, release: str = "0.33.0") -> list[tuple[str, str]]:
    return refused_engine_args(release, [MODEL, *args])


def test_every_supported_release_has_a_table() -> None:
    assert sorted(SERVE_OPTIONS) == sorted(row.tested for row in RELEASES)
    assert serve_parser("v0.33.1").release == "0.33.0"
    with pytest.raises(ValueError):
        serve_parser("0.30.0")


@pytest.mark.parametrize(
    "args",
    [
        ("-tp", "4"),
        ("-t", "4"),  # an abbreviation of exactly one option
        ("--block", "8"),
        ("--port=8001",),
        ("-n2",),  # a one-letter short option with its value attached
        ("--enforce_eager",),  # underscores are dashes
        ("--max-model-len", "2048", "--max-model-len", "4096"),  # repeated
        ("--kv-transfer-config.kv_role", "kv_producer"),  # a dotted key of an option taking an object
        ("--compilation-config.mode=3",),
        ("-O3",),
        ("--served-model-name", "-1"),  # a negative number is a value
        ("--",),  # taken by the optional model positional
        ("--no-enable-prefix-caching",),
    ],
)
def test_what_vllm_accepts(args: tuple[str, ...]) -> None:
    assert refused(*args) == []


@pytest.mark.parametrize(
    ("args", "token", "why"),
    [
        (("--frobnicate",), "--frobnicate", "unrecognized arguments: --frobnicate"),
        (("-tp4",), "-tp4", "unrecognized arguments: -tp4"),
        (("--block-size32",), "--block-size32", "unrecognized arguments: --block-size32"),
        (("--no-enable-hybrid-kv-cache-manager",), "--no-enable-hybrid-kv-cache-manager", "unrecognized"),
        (("--enable",), "--enable", "ambiguous option: --enable could match"),
        (("--port",), "--port", "argument --port: expected one argument"),
        (("--served-model-name", "--x"), "--served-model-name", "expected at least one argument"),
        (("--headless=1",), "--headless=1", "ignored explicit argument '1'"),
        (("--", "x"), "x", "unrecognized arguments: x"),
        (("extra",), "extra", "unrecognized arguments: extra"),
        (("--enforce-eager.x", "1"), '{"x": 1}', 'unrecognized arguments: {"x": 1}'),
        (("--port.x", "1"), "--port", "invalid value"),
        (("--temperature", "-0.5"), "-0.5", "has no value"),  # vLLM reads -0.5 as a dotted key
        (("--model", "other"), MODEL, "unrecognized arguments"),  # --model moves to the front
        (("--help",), "--help", "help"),
        (("--config", "file.json"), "file.json", "yaml/yml"),
    ],
)
def test_what_vllm_refuses(args: tuple[str, ...], token: str, why: str) -> None:
    found = refused(*args)
    assert found and found[0][0] == token and why in found[0][1], found


def test_each_unrecognized_argument_is_named() -> None:
    assert refused("--frobnicate", "1", "--port", "8001", "-zz") == [
        (token, "unrecognized arguments: --frobnicate 1 -zz") for token in ("--frobnicate", "1", "-zz")
    ]


def test_the_enable_disable_pairs_are_0_33s() -> None:
    assert refused("--enable-hybrid-kv-cache-manager") == []
    assert refused("--enable-hybrid-kv-cache-manager", release="0.32.0") != []
