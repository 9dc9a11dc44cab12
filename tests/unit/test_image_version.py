"""Images are tagged with pyproject's version and the chart defaults to its appVersion: the two are one."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_pyproject_version_is_the_charts_app_version() -> None:
    with open(REPO / "pyproject.toml", "rb") as f:
        version = tomllib.load(f)["project"]["version"]
    match = re.search(
        r'^appVersion:\s*"?([^"\s]+)"?\s*$', (REPO / "charts/disagg/Chart.yaml").read_text(), re.M
    )
    assert match is not None
    assert match.group(1) == version
