"""`docs/code-map.md` names every module of the operator and the worker, and the README's and docs' links lead
somewhere: a module added without a line in the map, or a page moved without its links, fails here."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CODE_MAP = ROOT / "docs" / "code-map.md"
BACKTICKED = re.compile(r"`([^`]+)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")


@cache
def halves() -> tuple[str, str]:
    operator, worker = CODE_MAP.read_text(encoding="utf-8").split("\n## Worker", 1)
    return operator, worker


@cache
def worker_rooms() -> dict[str, frozenset[str]]:
    """The backticked names in each `### `room`` section of the worker's half."""
    rooms: dict[str, frozenset[str]] = {}
    for section in re.split(r"^### ", halves()[1], flags=re.MULTILINE)[1:]:
        match = re.match(r"`(\w+)`", section)
        assert match is not None, section[:80]
        rooms[match.group(1)] = frozenset(BACKTICKED.findall(section))
    return rooms


def operator_modules() -> list[str]:
    """Every operator module as the map's table names it (`control/reconcile.py`); a package's `__init__`
    only where it holds more than its docstring's room description (the API's face)."""
    modules = []
    for path in sorted((ROOT / "operator").rglob("*.py")):
        relative = path.relative_to(ROOT / "operator").as_posix()
        if path.name != "__init__.py" or relative == "api/__init__.py":
            modules.append(relative)
    return modules


def worker_modules() -> list[Path]:
    return [
        path.relative_to(ROOT / "worker")
        for path in sorted((ROOT / "worker").rglob("*.py"))
        if path.name != "__init__.py"
    ]


@pytest.mark.parametrize("module", operator_modules())
def test_every_operator_module_has_a_line(module: str) -> None:
    assert module in BACKTICKED.findall(halves()[0]), f"docs/code-map.md does not name operator/{module}"


@pytest.mark.parametrize("module", worker_modules(), ids=str)
def test_every_worker_module_is_named_in_its_rooms_section(module: Path) -> None:
    room, *inner = module.parts
    assert inner, f"worker/{module} is in no room"
    names = worker_rooms().get(room, frozenset())
    # A module of a nested package (kv/routing/regions.py) is named by its file in its room's section.
    assert module.name in names or Path(*inner).as_posix() in names, (
        f"docs/code-map.md's `{room}` section does not name worker/{module}"
    )


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower-cased, punctuation but `-` and `_` dropped, spaces as dashes."""
    found = set()
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


@pytest.mark.parametrize("page", pages(), ids=lambda page: page.name)
def test_every_relative_link_leads_to_a_file_and_heading_that_exist(page: Path) -> None:
    broken = []
    for target in LINK.findall(page.read_text(encoding="utf-8")):
        if re.match(r"^[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        missing_heading = anchor != "" and linked.suffix == ".md" and anchor not in anchors(linked)
        if not linked.exists() or missing_heading:
            broken.append(target)
    assert broken == []
