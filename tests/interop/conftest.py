"""Interop tests: the project against a released vLLM's own code, run by a peer process in .venv-vllm.

Every test here is marked `vllm`. A missing .venv-vllm or extracted wheel fails the test (CI must really run
them): `make test` builds both (hack/vllm/venv.sh, hack/vllm/wheels.sh).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from _vllm_peer import INSTALLED_RELEASE, VENV_PYTHON, PeerFactory, VllmPeer, extracted_release


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.vllm)


@pytest.fixture(scope="session")
def vllm_peers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PeerFactory]:
    """`vllm_peers("0.32.0")`: that release's peer process, started on first use and kept for the session."""
    started: dict[str, VllmPeer] = {}
    base = tmp_path_factory.mktemp("vllm-peer")

    def get(version: str) -> VllmPeer:
        if version not in started:
            if not VENV_PYTHON.exists():
                pytest.fail(
                    f"{VENV_PYTHON} is missing: build the vLLM test peer with `bash hack/vllm/venv.sh` "
                    "(make test does)",
                    pytrace=False,
                )
            if version != INSTALLED_RELEASE and not (extracted_release(version) / "vllm").is_dir():
                pytest.fail(
                    f"vLLM {version} is not extracted at {extracted_release(version)}: run "
                    "`bash hack/vllm/wheels.sh` (make test does)",
                    pytrace=False,
                )
            started[version] = VllmPeer(version, base / f"peer-{version}.log", base / "hf")
        return started[version]

    yield get
    for peer in started.values():
        peer.close()


@pytest.fixture(scope="session")
def vllm_peer(vllm_peers: PeerFactory) -> VllmPeer:
    """The peer of the release .venv-vllm installs (0.33.0), the one users run."""
    return vllm_peers(INSTALLED_RELEASE)
