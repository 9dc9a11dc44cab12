"""The image tests read the images `make image` built (build/images) and run their programs for real in their
unpacked root file systems, as the image's user. They need root (chroot, mount namespaces) and umoci; a
missing image is a failure, not a skip: `make test` builds the images first."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from image_layout import LIGHT, TRANSFER, Image, project_version, remove, unpack


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.image)


def _read(name: str) -> Image:
    if os.geteuid() != 0:
        pytest.skip("the image tests chroot into the unpacked images: they run as root (as CI does)")
    try:
        return Image.read(name, project_version())
    except FileNotFoundError:
        pytest.fail(f"build/images/{name} is missing: run `make image` first")


@pytest.fixture(scope="session")
def light() -> Image:
    return _read(LIGHT)


@pytest.fixture(scope="session")
def transfer() -> Image:
    return _read(TRANSFER)


@pytest.fixture(scope="session")
def light_root(light: Image) -> Iterator[Path]:
    rootfs = unpack(light)
    yield rootfs
    remove(rootfs)


@pytest.fixture(scope="session")
def transfer_root(transfer: Image) -> Iterator[Path]:
    rootfs = unpack(transfer)
    yield rootfs
    remove(rootfs)
