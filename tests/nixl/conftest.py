"""Every test here moves real bytes between real processes through NIXL (UCX on loopback)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from _procs import UCX_ENV, Cluster, cluster

# Agents created in the test process itself stay on loopback too.
for _key, _value in UCX_ENV.items():
    os.environ.setdefault(_key, _value)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.nixl)


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Cluster]:
    with cluster(tmp_path) as c:
        yield c
