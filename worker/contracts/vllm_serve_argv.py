"""Which `vllm serve` arguments a supported vLLM release's own parser refuses, judged without vLLM. Pure.

`refused_engine_args(release, argv)` reads `argv` (what follows `vllm serve`, the model first) as the
release reads it, from the release's option table (`vllm_serve_options`, generated from the release):

- vLLM's `FlexibleArgumentParser.parse_args` first rewrites the arguments (vllm/utils/argparse_utils.py,
  the same in 0.31 to 0.33): a `--model X` moves to the front as the positional; `--config FILE` is replaced
  by the file's arguments (a file this module cannot read: it is taken to add none, and only its name is
  judged, as vLLM judges it: one, present, `.yaml`/`.yml`); underscores in a `--` name become dashes up to
  the first `.`; `-O3`, `-O=3`, `-Oname` and `-O 3` become `--optimization-level`; every token that starts
  with `-` and holds a `.` before any `=` is a dotted key (`--compilation-config.mode 3`, `-cc.mode=3`,
  but also a value such as `-0.5`) that takes the next token as its value whatever it is, and all dotted
  keys of one name become one JSON object appended at the end (`--compilation-config '{"mode": 3}'`).
- Then argparse (CPython 3.11, the peers' and the generator's Python) parses the result: an option is
  an exact option string, `--name=value`, an abbreviation of exactly one option string where the release
  allows them (more than one is "ambiguous option"), or a one-letter short option with its value attached
  (`-n2`); a token that starts with `-` and is none of these (nor a negative number, nor holds a space) is
  an unknown option; `--` ends the options; a value-taking option takes the following non-option tokens its
  nargs allows ("expected one argument" where it finds none); tokens nobody takes are "unrecognized
  arguments"; help exits.

- Each value goes through its action's type and choices as argparse does (`--max-num-seqs abc`: "invalid
  int value"), for the types the table names (int, float, JSON, vLLM's human-readable integers, its
  optional and lower-cased variants, plain strings with choices); an action of another type (vLLM's config
  dataclasses, dict-or-string) has its values taken as they are.

Not judged: a dotted key's sub-key, ranges and vLLM's other checks after parsing
(`validate_parsed_serve_args`, `create_engine_config`: `--gpu-memory-utilization 7` parses), and what a
`--config` file holds. tests/interop/test_serve_options_interop.py checks the judgement against each
release's own parser.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Final

from disagg.worker.contracts.releases import release_of
from disagg.worker.contracts.vllm_serve_options import SERVE_OPTIONS

UNRECOGNIZED: Final = "unrecognized arguments"

_NEGATIVE_NUMBER: Final = re.compile(r"^-\d+$|^-\d*\.\d+$")
# vLLM's pattern for the part of a `--` token whose underscores become dashes.
_DASHED_PART: Final = re.compile(r"(?<=--)[^\.]*")
_MODEL_FLAG: Final = re.compile(r"^--model(=.+|$)")
_SERVED_MODEL_NAME: Final = re.compile(r"^--served[-_]model[-_]name(=.+|$)")
_CONFIG_FLAG: Final = re.compile(r"^--config(=.+|$)")
_HUMAN_READABLE_INT: Final = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")


@dataclass(frozen=True)
class ValueKind:
    """How an action's type and choices judge one value (the table's `=` code)."""

    # "int", "float", "str", "json", "hint", "hint-auto" or "lower_" (`_converted`).
    kind: str
    # vLLM's optional_type: "" and "None" read as None.
    optional: bool
    choices: tuple[object, ...] | None

    def refusal(self, text: str) -> str | None:
        """argparse's complaint about `text` as this action's value, or None when it converts and is a
        choice."""
        if self.optional and text in ("", "None"):
            value: object = None
        else:
            try:
                value = _converted(self.kind, text)
            except (ValueError, TypeError):
                return f"invalid {_TYPE_NAMES.get(self.kind, self.kind)} value: {text!r}"
            except RecursionError:
                return f"{text[:32]!r}... nests deeper than the parser's stack (it fails on it)"
        if self.choices is not None and value not in self.choices:
            shown = ", ".join(repr(c) for c in self.choices)
            return f"invalid choice: {value!r} (choose from {shown})"
        return None


# The names argparse's message gives vLLM's types.
_TYPE_NAMES: Final = {
    "hint": "human_readable_int",
    "hint-auto": "human_readable_int_or_auto",
    "json": "loads",
}


def _converted(kind: str, text: str) -> object:
    """The value as the type vLLM's parser gives the action reads it (the same CPython converts both)."""
    if kind == "int":
        return int(text)
    if kind == "float":
        return float(text)
    if kind == "json":
        return json.loads(text)
    if kind == "lower_":
        return text.lower().replace("-", "_")
    if kind == "hint-auto" and (text.strip() == "-1" or text.strip().lower() == "auto"):
        return -1
    if kind in ("hint", "hint-auto"):
        return _human_readable_int(text)
    return text


def _human_readable_int(text: str) -> int:
    """vLLM's `human_readable_int` (vllm/utils/argparse_utils.py, the same in 0.31 to 0.34)."""
    text = text.strip()
    match = _HUMAN_READABLE_INT.fullmatch(text)
    if match is not None:
        number, suffix = str(match.group(1)), str(match.group(2))
        if suffix in "kmgt":
            return int(float(number) * 10 ** (3 * ("kmgt".index(suffix) + 1)))
        return int(number) << (10 * ("KMGT".index(suffix) + 1))  # a decimal raises ValueError
    return int(text)


@dataclass(frozen=True)
class ServeAction:
    """One action of the serve parser: its option strings and what it takes."""

    options: tuple[str, ...]
    # argparse's nargs: 0, 1 (argparse's None), "?", "*", "+" or a count; "exit" for help.
    nargs: int | str
    # Whether its value may be a JSON object, so whether vLLM's dotted keys of it can parse.
    takes_object: bool
    # How each value is judged; None: taken as it is.
    value: ValueKind | None = None

    @property
    def name(self) -> str:
        return "/".join(self.options)


@dataclass(frozen=True)
class ServeParser:
    """A release's `vllm serve` parser as its option table describes it."""

    release: str
    allow_abbrev: bool
    positionals: tuple[int | str, ...]
    actions: Mapping[str, ServeAction]


def _nargs(code: str) -> int | str:
    return int(code) if code.isdigit() else code


def _action(line: str) -> ServeAction:
    code, *options = line.split(" ")
    value = _value_kind(options.pop(0)) if options[0].startswith("=") else None
    return ServeAction(tuple(options), _nargs(code.removesuffix("o")), code.endswith("o"), value)


def _value_kind(code: str) -> ValueKind:
    """`=[?]kind[:choices as JSON]`."""
    kind, _, choices = code[1:].partition(":")
    optional = kind.startswith("?")
    return ValueKind(kind.removeprefix("?"), optional, tuple(json.loads(choices)) if choices else None)


@cache
def serve_parser(release: str) -> ServeParser:
    """The table of the supported release whose minor line `release` ("0.33.0", "v0.33.1") is on."""
    row = release_of(release)
    if row is None or row.tested not in SERVE_OPTIONS:
        raise ValueError(f"no vllm serve option table for vLLM {release!r}: {sorted(SERVE_OPTIONS)}")
    allow_abbrev, positionals, lines = SERVE_OPTIONS[row.tested]
    actions = {option: action for action in map(_action, lines) for option in action.options}
    return ServeParser(row.tested, allow_abbrev, tuple(map(_nargs, positionals)), actions)


class _Refused(Exception):
    def __init__(self, token: str, why: str) -> None:
        super().__init__(why)
        self.token = token
        self.why = why


def refused_engine_args(release: str, argv: Sequence[str]) -> list[tuple[str, str]]:
    """(token, why) for what the release's `vllm serve` parser refuses in `argv` (the arguments after
    `vllm serve`, the model first): every unrecognized argument, or the one error the parser stops at,
    worded as vLLM's parser words it. Empty when the parser accepts `argv`."""
    parser = serve_parser(release)
    try:
        args, objects = _rewrite(["serve", *argv])
        extras = _parse(parser, args[1:], {index - 1 for index in objects})
    except _Refused as refused:
        return [(refused.token, refused.why)]
    return [(token, f"{UNRECOGNIZED}: {' '.join(extras)}") for token in extras]


# --- vLLM's FlexibleArgumentParser.parse_args: the rewriting before argparse ------------------------------


def _rewrite(args: list[str]) -> tuple[list[str], set[int]]:
    """vLLM's rewritten arguments, and the indices of the JSON objects it made of dotted keys."""
    args = _move_model(args)
    if (
        len(args) > 1
        and args[1].startswith("-")
        and not any(_CONFIG_FLAG.match(arg) for arg in args)
        and any(_SERVED_MODEL_NAME.match(arg) for arg in args)
    ):
        raise _Refused(args[1], "`model` should be provided as the first positional argument")
    if "--config" in args:
        args = _drop_config(args)
    processed: list[str] = []
    for index, arg in enumerate(args):
        if arg.startswith("--"):
            processed.append(vllm_spelling(arg))
        elif arg.startswith("-O") and arg != "-O":
            processed += ["--optimization-level", arg[3:] if arg[2] == "=" else arg[2:]]
        elif arg == "-O" and index + 1 < len(args) and args[index + 1] in {"0", "1", "2", "3"}:
            processed.append("--optimization-level")
        else:
            processed.append(arg)
    return _gather_dotted(processed)


def vllm_spelling(token: str) -> str:
    """A `--` token as vLLM's rewriting spells it (underscores to dashes before the first `.` and `=`)."""
    if not token.startswith("--"):
        return token
    key, equals, value = token.partition("=")
    return _DASHED_PART.sub(lambda m: m.group(0).replace("_", "-"), key, count=1) + equals + value


def _move_model(args: list[str]) -> list[str]:
    index = next((i for i, arg in enumerate(args) if _MODEL_FLAG.match(arg)), None)
    if index is None:
        return args
    if args[index] == "--model":
        if index + 1 >= len(args):
            raise _Refused("--model", "--model has no value (vLLM's parser fails on it)")
        return ["serve", args[index + 1], *args[1:index], *args[index + 2 :]]
    return ["serve", args[index].removeprefix("--model="), *args[1:index], *args[index + 1 :]]


def _drop_config(args: list[str]) -> list[str]:
    if args.count("--config") > 1:
        raise _Refused("--config", "More than one config file specified!")
    index = args.index("--config")
    if index == len(args) - 1:
        raise _Refused("--config", "No config file specified! Please check your command-line arguments.")
    extension = args[index + 1].split(".")[-1]
    if extension not in ("yaml", "yml"):
        raise _Refused(args[index + 1], f"Config file must be of a yaml/yml type. {extension} supplied")
    if not (len(args) > 1 and not args[1].startswith("-")):
        raise _Refused(
            "--config", "No model specified! Please specify model either as a positional argument or in a "
            "config file."
        )  # fmt: skip
    return [*args[:index], *args[index + 2 :]]


def _dotted_value(text: str) -> object:
    """vLLM's reading of a dotted key's value: JSON, else a human-readable integer (`80g`), else the text."""
    try:
        return json.loads(text)
    except ValueError:
        pass
    match = _HUMAN_READABLE_INT.fullmatch(text.strip())
    if match is None:
        return text
    number, suffix = match.groups()
    if suffix in "kmgt":
        return int(float(number) * 10 ** (3 * ("kmgt".index(suffix) + 1)))
    return int(number) * 2 ** (10 * ("KMGT".index(suffix) + 1)) if number.isdigit() else text


def _gather_dotted(processed: list[str]) -> tuple[list[str], set[int]]:
    """vLLM's dotted keys: each takes the next token as its value; one JSON object per key, appended."""
    consumed: set[int] = set()
    objects: dict[str, dict[str, object]] = {}
    for index, arg in enumerate(processed):
        if index in consumed or (arg.startswith("--") and "." not in arg):
            continue
        if not (arg.startswith("-") and "." in arg):
            continue
        if "=" in arg:
            arg, value = arg.split("=", 1)
            if "." not in arg:
                continue
        elif index + 1 < len(processed):
            value = processed[index + 1]
            consumed.add(index + 1)
        else:
            raise _Refused(arg, f"{arg} has no value (vLLM's parser fails on a dotted key at the end)")
        try:
            parsed = _dotted_value(value)
        except RecursionError:
            # vLLM's parser dies of it too; the operator's judgement must not.
            why = f"{arg}: its value nests deeper than the parser's stack"
            raise _Refused(processed[index], why) from None
        if arg.endswith("+"):
            arg, parsed = arg[:-1], list(value.split(","))
        key, *keys = arg.split(".")
        nested: dict[str, object] = objects.setdefault(key, {})
        for part in keys[:-1]:
            inner = nested.get(part)
            if not isinstance(inner, dict):
                inner = nested[part] = {}
            nested = inner
        old = nested.get(keys[-1])
        if isinstance(parsed, list) and isinstance(old, list):
            parsed = old + parsed
        nested[keys[-1]] = parsed
        consumed.add(index)
    kept = [arg for index, arg in enumerate(processed) if index not in consumed]
    made: set[int] = set()
    for key, made_object in objects.items():
        kept += [key, json.dumps(made_object)]
        made.add(len(kept) - 1)
    return kept, made


# --- argparse (CPython 3.11) on the serve subparser ---------------------------------------------------------

_Option = tuple[ServeAction | None, str, str | None]


def _parse_optional(parser: ServeParser, arg: str) -> _Option | None:
    """argparse's _parse_optional: (action or None for an unknown option, option string, explicit value),
    or None for a positional."""
    actions = parser.actions
    if not arg or arg[0] != "-":
        return None
    if arg in actions:
        return actions[arg], arg, None
    if len(arg) == 1:
        return None
    if "=" in arg:
        option, explicit = arg.split("=", 1)
        if option in actions:
            return actions[option], option, explicit
    matches = _option_tuples(parser, arg)
    if len(matches) > 1:
        names = ", ".join(option for _, option, _ in matches)
        raise _Refused(arg, f"ambiguous option: {arg} could match {names}")
    if len(matches) == 1:
        return matches[0]
    if _NEGATIVE_NUMBER.match(arg) or " " in arg:
        return None
    return None, arg, None


def _option_tuples(parser: ServeParser, arg: str) -> list[_Option]:
    actions = parser.actions
    if arg[1] == "-":
        if not parser.allow_abbrev:
            return []
        prefix, equals, explicit = arg.partition("=")
        return [
            (a, option, explicit if equals else None)
            for option, a in actions.items()
            if option.startswith(prefix)
        ]
    found: list[_Option] = []
    for option, action in actions.items():
        if option == arg[:2]:
            found.append((action, option, arg[2:]))
        elif option.startswith(arg):
            found.append((action, option, None))
    return found


def _nargs_pattern(nargs: int | str, *, optional: bool) -> str:
    fixed = {1: "(-*A-*)", "?": "(-*A?-*)", "*": "(-*[A-]*)", "+": "(-*A[A-]*)", "exit": "(-*-*)"}
    pattern = fixed[nargs] if nargs in fixed else "(-*" + "-*".join("A" * int(nargs)) + "-*)"
    return pattern.replace("-*", "").replace("-", "") if optional else pattern


def _match_argument(action: ServeAction, pattern: str, token: str) -> int:
    match = re.match(_nargs_pattern(action.nargs, optional=True), pattern)
    if match is None:
        count = action.nargs
        expected = {1: "expected one argument", "?": "expected at most one argument"}.get(
            count, "expected at least one argument" if count == "+" else f"expected {count} arguments"
        )
        raise _Refused(token, f"argument {action.name}: {expected}")
    return len(match.group(1))


def _parse(parser: ServeParser, args: list[str], objects: set[int]) -> list[str]:
    """argparse's _parse_known_args on the serve subparser: the extras, or _Refused at the first error.
    `objects`: the indices of the JSON objects vLLM made of dotted keys, which only some actions take."""
    options: dict[int, _Option] = {}
    kinds: list[str] = []
    for index, arg in enumerate(args):
        if "-" in kinds:  # everything after `--` is a positional
            kinds.append("A")
        elif arg == "--":
            kinds.append("-")
        elif (option := _parse_optional(parser, arg)) is None:
            kinds.append("A")
        else:
            options[index] = option
            kinds.append("O")
    pattern = "".join(kinds)
    positionals = list(parser.positionals)
    extras: list[str] = []

    def take(action: ServeAction, option: str) -> None:
        if action.nargs == "exit":
            raise _Refused(option, "vLLM's parser prints its help and exits")

    def judge_values(action: ServeAction, token: str, values: Sequence[str]) -> None:
        """argparse converts every value of the action and checks it against the choices: the first that
        fails ends the parse."""
        kind = action.value
        if kind is None:
            return
        for text in values:
            why = kind.refusal(text)
            if why is not None:
                raise _Refused(token, f"argument {action.name}: {why}")

    def consume_optional(start: int) -> int:
        action, option, explicit = options[start]
        while True:
            if action is None:
                extras.append(args[start])
                return start + 1
            if explicit is None:
                count = _match_argument(action, pattern[start + 1 :], args[start])
                made = [args[i] for i in range(start + 1, start + 1 + count) if i in objects]
                if made and not action.takes_object:
                    raise _Refused(args[start], f"argument {action.name}: invalid value: {made[0]}")
                take(action, option)
                judge_values(action, args[start], args[start + 1 : start + 1 + count])
                return start + 1 + count
            count = _match_argument(action, "A", args[start])
            if count == 0 and option[1] != "-" and explicit != "":
                take(action, option)
                option = "-" + explicit[0]
                if option not in parser.actions:
                    raise _Refused(
                        args[start], f"argument {action.name}: ignored explicit argument {explicit!r}"
                    )
                action, explicit = parser.actions[option], explicit[1:] or None
            elif count == 1:
                take(action, option)
                judge_values(action, args[start], [explicit])
                return start + 1
            else:
                raise _Refused(args[start], f"argument {action.name}: ignored explicit argument {explicit!r}")

    def consume_positionals(start: int) -> int:
        selected = pattern[start:]
        for count in range(len(positionals), 0, -1):
            match = re.match(
                "".join(_nargs_pattern(n, optional=False) for n in positionals[:count]), selected
            )
            if match is not None:
                start += sum(len(group) for group in match.groups())
                del positionals[:count]
                break
        return start

    start = 0
    last_option = max(options, default=-1)
    while start <= last_option:
        next_option = min(index for index in options if index >= start)
        if start != next_option:
            end = consume_positionals(start)
            if end > start:
                start = end
                continue
        if start not in options:
            extras += args[start:next_option]
            start = next_option
        start = consume_optional(start)
    extras += args[consume_positionals(start) :]
    return extras
