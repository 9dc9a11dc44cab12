"""The import contracts in pyproject.toml reach every room: a room added to the operator is one the runtime's
contract forbids and the rooms' layers place, or this fails (lint-imports itself only checks the names it is
given)."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CONTRACTS: list[dict[str, Any]] = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))[
    "tool"
]["importlinter"]["contracts"]


def rooms() -> set[str]:
    """`disagg.operator.<room>` for every package and module directly under operator/."""
    found = set()
    for path in (ROOT / "operator").iterdir():
        if path.is_dir() and (path / "__init__.py").is_file():
            found.add(f"disagg.operator.{path.name}")
        elif path.suffix == ".py" and path.name != "__init__.py":
            found.add(f"disagg.operator.{path.stem}")
    return found


def contract(starting: str) -> dict[str, Any]:
    (found,) = [c for c in CONTRACTS if c["name"].startswith(starting)]
    return found


def test_the_runtime_may_import_no_other_room() -> None:
    forbidden = set(contract("the operator's runtime")["forbidden_modules"])
    assert rooms() - {"disagg.operator.runtime"} <= forbidden


def test_every_room_is_on_a_floor() -> None:
    layers = contract("the operator's rooms are layers")["layers"]
    placed = {room.strip() for layer in layers for room in layer.split("|")}
    assert rooms() == placed


def test_every_module_of_the_io_room_is_on_a_floor() -> None:
    layers = contract("the operator's I/O room is layers")["layers"]
    placed = {room.strip() for layer in layers for room in layer.split("|")}
    modules = {
        f"disagg.operator.control.{path.stem}"
        for path in (ROOT / "operator" / "control").glob("*.py")
        if path.name != "__init__.py"
    }
    assert modules == placed
