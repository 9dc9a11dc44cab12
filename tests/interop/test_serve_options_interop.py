"""The shipped `vllm serve` option tables (disagg.worker.contracts.vllm_serve_options) are each release's, and
`refused_engine_args` judges seeded argvs as that release's own parser does (both refuse or neither)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from _vllm_peer import RELEASES, PeerFactory, VllmPeer

from disagg.worker.contracts.vllm_serve_argv import UNRECOGNIZED, refused_engine_args, serve_parser
from disagg.worker.contracts.vllm_serve_options import SERVE_OPTIONS

MODEL = "org/model"
SEED = 8
RANDOM_ARGVS = 400
GARBAGE = ("-", "--", "---x", "-0.5", "-7", "word", '{"a": 1}', "-x y", "=", "--=x", "", "-O", "-Ox", "-O=1")
UNKNOWN = ("--frobnicate", "-z", "-zz", "--no-frobnicate", "--x.y")


@pytest.mark.parametrize("version", RELEASES)
def test_the_shipped_table_is_the_releases(vllm_peers: PeerFactory, version: str) -> None:
    allow_abbrev, positionals, actions = SERVE_OPTIONS[version]
    shipped = {"allow_abbrev": allow_abbrev, "positionals": list(positionals), "actions": list(actions)}
    assert vllm_peers(version).call("serve_options") == shipped, (
        "stale: run `PYTHONSAFEPATH=1 .venv/bin/python hack/vllm/serve_options.py`"
    )


def _with_value(option: str, nargs: int | str, value: str | None) -> list[str]:
    if nargs in (0, "exit"):
        return [option]
    return [option] if value is None else [option, value]


def _argvs(version: str, samples: dict[str, Any]) -> list[list[str]]:
    """Every option alone and with a value the release accepts; then seeded variations."""
    parser = serve_parser(version)
    values: dict[str, str | None] = samples["values"]
    dotted: dict[str, list[str] | None] = samples["dotted"]
    usable = sorted(o for o, v in values.items() if v is not None)
    argvs: list[list[str]] = []
    for option, action in sorted(parser.actions.items()):
        # Alone: a value-taking option is refused for the missing value; others only where vLLM's later
        # checks accept them alone (`--enable-auto-tool-choice` needs `--tool-call-parser`).
        needs_value = action.nargs in (1, "+") or (isinstance(action.nargs, int) and action.nargs > 1)
        if needs_value or values.get(option) is not None or action.nargs == "exit":
            argvs.append([option])
        if values.get(option):
            argvs.append([option, str(values[option])])
    rng = random.Random(f"{SEED}-{version}")

    def part() -> list[str]:
        option = rng.choice(usable)
        action = parser.actions[option]
        value = values[option] or None
        form = rng.choice(
            ("plain", "abbrev", "underscore", "equals", "attached", "dotted", "dotted-other", "unknown",
             "garbage", "repeat", "dash-value", "near")
        )  # fmt: skip
        if form == "abbrev":
            cut = rng.randrange(2 if option[1] != "-" else 3, len(option) + 1)
            return _with_value(option[:cut], action.nargs, value)
        if form == "underscore" and option.startswith("--"):
            return _with_value("--" + option[2:].replace("-", "_"), action.nargs, value)
        if form == "equals" and value is not None:
            return [f"{option}={value}"]
        if form == "attached" and value is not None:
            return [option + value]
        if form == "dotted" and dotted:
            chosen = rng.choice(sorted(dotted))
            if dotted[chosen] is not None:
                key, given = dotted[chosen]  # type: ignore[misc]
                return rng.choice(([f"{chosen}.{key}", given], [f"{chosen}.{key}={given}"]))
        if form == "dotted-other" and not action.takes_object:
            # A sub-key of an option that takes an object is not judged (only its release's types know it).
            return [f"{option}.x", "1"]
        if form == "unknown":
            return [rng.choice((*UNKNOWN, option + "x", "--no-" + option.lstrip("-")))]
        if form == "garbage":
            return [rng.choice(GARBAGE)]
        if form == "repeat":
            return [*_with_value(option, action.nargs, value), *_with_value(option, action.nargs, value)]
        if form == "dash-value" and value == "x":
            # A value that looks like an option, for an option that takes any text (values are not judged).
            return [option, rng.choice(("-x", "--x", "-1", "-0.5", "-tp", "-x y"))]
        if form == "near" and option.startswith("--"):
            return _with_value(option[:-1] + rng.choice("xyz-"), action.nargs, value)
        return _with_value(option, action.nargs, value)

    for _ in range(RANDOM_ARGVS):
        parts = [part() for _ in range(rng.randint(1, 3))]
        argvs.append([token for p in parts for token in p])
    return argvs


def _unrecognized(refusal: str) -> str | None:
    marker = f"{UNRECOGNIZED}: "
    return refusal.split(marker, 1)[1] if marker in refusal else None


@pytest.mark.parametrize("version", RELEASES)
def test_refused_engine_args_judges_as_the_releases_parser(
    vllm_peers: PeerFactory, tmp_path: Path, version: str
) -> None:
    peer: VllmPeer = vllm_peers(version)
    config = tmp_path / "serve.yaml"
    config.write_text("{}\n")
    samples = peer.call("serve_option_samples", model=MODEL, config_file=str(config))
    argvs = _argvs(version, samples)
    counts = {"accepted by both": 0, "refused by both": 0}
    disagreements = []
    for args in argvs:
        argv = [MODEL, *args]
        ours = refused_engine_args(version, argv)
        theirs = peer.call("parse_refusal", argv=argv)
        if bool(ours) != (theirs is not None):
            disagreements.append((args, ours, theirs))
            continue
        counts["refused by both" if ours else "accepted by both"] += 1
        # The peer reads the last line vLLM printed, stripped.
        named = None if theirs is None else _unrecognized(theirs)
        if named is not None and ours[0][1].strip() != f"{UNRECOGNIZED}: {named}":
            disagreements.append((args, ours, theirs))
    print(f"vLLM {version}: {len(argvs)} argvs: {counts}, {len(disagreements)} disagreements")
    assert disagreements == [], "\n".join(map(repr, disagreements))
    assert len(argvs) >= 200 and min(counts.values()) >= 50, counts


# Values each value-judging action is given, beside its choices in other spellings: what int, float, JSON and
# vLLM's human-readable integers and optional types accept and refuse.
VALUES = (
    "x", "1", "-1", "1.5", "1e3", "2k", "1.5K", "1K", "auto", "AUTO", "None", "", "{}", "[1]", "nan", " 7 ",
    "٣", "²", "1_000", "0x10",
)  # fmt: skip
VALUES_PER_ACTION = 5


@pytest.mark.parametrize("version", RELEASES)
def test_values_are_judged_as_the_releases_parser_converts_them(
    vllm_peers: PeerFactory, version: str
) -> None:
    """Both refuse a value (argparse's exit status 2) or neither; vLLM's checks after parsing, which the
    table does not judge, may still refuse what both parse."""
    peer: VllmPeer = vllm_peers(version)
    parser = serve_parser(version)
    rng = random.Random(f"{SEED}-values-{version}")
    actions = {id(a): a for a in parser.actions.values() if a.value is not None and a.nargs in (1, "?", "+")}
    cases = []
    for action in sorted(actions.values(), key=lambda a: a.options[0]):
        assert action.value is not None
        choices = [str(c) for c in action.value.choices or () if c is not None]
        spelt = [c.upper().replace("_", "-") for c in choices[:2]]
        for value in rng.sample([*VALUES, *choices[:2], *spelt], VALUES_PER_ACTION):
            cases.append([f"{action.options[0]}={value}"])
    counts = {"refused by both": 0, "parsed by both": 0}
    disagreements = []
    for args in cases:
        argv = [MODEL, *args]
        ours = refused_engine_args(version, argv)
        theirs = peer.call("parse_refusal", argv=argv)
        refused = theirs is not None and theirs.startswith("exit status 2")
        if bool(ours) != refused:
            disagreements.append((args, ours, theirs))
        counts["refused by both" if ours else "parsed by both"] += 1
    print(f"vLLM {version}: {len(cases)} values: {counts}, {len(disagreements)} disagreements")
    assert disagreements == [], "\n".join(map(repr, disagreements))
    assert min(counts.values()) >= 50, counts
