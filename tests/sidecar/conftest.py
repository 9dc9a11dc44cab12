"""Sidecar tests run real sidecar processes (`python -m disagg.worker.cli.transfer`), real NIXL agents."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from sidecar_procs import SidecarProcess


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents and "sidecar_config" not in item.nodeid:
            item.add_marker(pytest.mark.nixl)


@pytest.fixture
def workdir() -> Iterator[Path]:
    """A short directory (Unix socket paths are limited to 107 bytes) in /dev/shm, where KV pools live."""
    shm = Path("/dev/shm")
    path = Path(tempfile.mkdtemp(prefix="disagg-sc-", dir=shm if shm.is_dir() else None))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def sidecars() -> Iterator[list[SidecarProcess]]:
    """Every sidecar a test starts; all are killed at teardown."""
    started: list[SidecarProcess] = []
    yield started
    for sidecar in started:
        sidecar.kill()
