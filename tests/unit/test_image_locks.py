"""The images' lock files still satisfy pyproject.toml: every dependency (and, in the transfer image, the
worker extra) is pinned there at a version its specifier allows. `make image-lock` rewrites them."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]


def pins(lock: str) -> dict[str, str]:
    text = (REPO / "hack/image" / lock).read_text()
    return {canonicalize_name(n): v for n, v in re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", text, re.M)}


def project() -> dict:  # type: ignore[type-arg]
    with open(REPO / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("lock", ["light.lock", "transfer.lock"])
def test_every_dependency_is_pinned_at_an_allowed_version(lock: str) -> None:
    wanted = list(project()["dependencies"])
    if lock == "transfer.lock":
        wanted += project()["optional-dependencies"]["worker"]
    pinned = pins(lock)
    for text in wanted:
        requirement = Requirement(text)
        name = canonicalize_name(requirement.name)
        assert name in pinned, f"{lock} does not pin {name}: run make image-lock"
        assert requirement.specifier.contains(pinned[name], prereleases=True), (
            f"{lock} pins {name}=={pinned[name]}, pyproject asks {requirement.specifier}: run make image-lock"
        )


def test_the_light_lock_has_no_torch_and_the_transfer_lock_the_cpu_build() -> None:
    assert not {"torch", "nixl-cu12"} & set(pins("light.lock"))
    assert pins("transfer.lock")["torch"] == "2.13.0+cpu"
    assert pins("transfer.lock")["nixl-cu12"] == "1.5.1"
