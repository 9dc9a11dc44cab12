"""The chart ships the generated CRD unchanged: charts/disagg/crds/ must equal crds/*.yaml byte for byte.

Only the top-level variant (no CEL rules, accepted from Kubernetes 1.20 on) belongs in the chart: Helm
installs every file under a chart's crds/, sub-folders included, and crds/cel/ defines the same CRD again.
Fix a failure with `bash hack/chart-sync`.
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GENERATED = REPO / "crds"
IN_CHART = REPO / "charts" / "disagg" / "crds"


def relative_files(root: Path) -> set[Path]:
    return {p.relative_to(root) for p in root.rglob("*") if p.is_file()}


def test_chart_crds_are_exactly_the_generated_top_level_crds() -> None:
    generated = {p.relative_to(GENERATED) for p in GENERATED.glob("*.yaml")}
    assert generated, "crds/ holds no generated CRD"
    assert relative_files(IN_CHART) == generated, "run `bash hack/chart-sync`"
    drifted = [
        str(p) for p in sorted(generated) if (IN_CHART / p).read_bytes() != (GENERATED / p).read_bytes()
    ]
    assert drifted == [], f"charts/disagg/crds/ differs from crds/ in {drifted}: run `bash hack/chart-sync`"
