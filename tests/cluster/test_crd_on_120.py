"""The generated CRD on a real Kubernetes 1.20 API server: it applies, defaults, prunes, validates, explains.

The plain variant (crds/) must apply with 1.20's kubectl; the CEL variant (crds/cel/) is refused by it, which
is why two variants are generated (see disagg.operator.crd).
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from local_cluster import ControlPlane

REPO = Path(__file__).resolve().parents[2]
CRDS = REPO / "crds"
EXAMPLES = REPO / "examples"
CRD = "disaggdeployments.disagg.io"


def poll(check: Callable[[], bool], what: str, deadline_s: float = 60.0) -> None:
    """Wait for the API server to publish something; the deadline only bounds a hang."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if check():
            return
        time.sleep(0.5)
    pytest.fail(f"{what} did not happen within {deadline_s} s")


def must(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.fixture(scope="module")
def installed_crd(control_plane: ControlPlane) -> ControlPlane:
    # Plain `kubectl apply` validates client-side against the server's OpenAPI, as a user's apply would.
    must(control_plane.kubectl("apply", "-f", str(CRDS / "disagg.io_disaggdeployments.yaml")))
    must(control_plane.kubectl("wait", "--for=condition=established", "--timeout=60s", f"crd/{CRD}"))
    return control_plane


def _apply(
    cp: ControlPlane, namespace: str, document: dict[str, Any], *flags: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(cp.bin_dir / "kubectl"), "apply", "-n", namespace, *flags, "-f", "-"],
        input=yaml.safe_dump(document),
        capture_output=True,
        text=True,
        env=cp.env(),
        check=False,
    )


def _example(name: str) -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load((EXAMPLES / name).read_text(encoding="utf-8"))
    document["metadata"].pop("namespace", None)
    return document


def test_every_example_is_accepted_and_defaulted(installed_crd: ControlPlane, namespace: str) -> None:
    for example in sorted(EXAMPLES.glob("*.yaml")):
        must(_apply(installed_crd, namespace, _example(example.name)))
    # bad-mamba-pp.yaml has no kvTransfer: the schema's `default: {}` plus nested defaults fill it in
    stored = json.loads(
        must(installed_crd.kubectl("get", "disagg", "jamba-bad-pp", "-n", namespace, "-o", "json"))
    )
    assert stored["spec"]["kvTransfer"] == {
        "backends": ["UCX"],
        "connector": "Push",
        "leaseSeconds": 30,
        "sideChannelPort": 5600,
        "transport": "any",
    }
    assert stored["spec"]["decode"]["pipelineParallelSize"] == 1


def test_printer_columns_and_short_name(installed_crd: ControlPlane, namespace: str) -> None:
    must(_apply(installed_crd, namespace, _example("pp2-hma.yaml")))
    header = must(installed_crd.kubectl("get", "disagg", "-n", namespace)).splitlines()[0].split()
    columns = ["NAME", "COMPATIBLE", "KV", "READY", "PAIRS", "TRANSPORT", "REVISION", "OLD", "ROLLOUT"]
    assert header == [*columns, "AGE"]
    wide = must(installed_crd.kubectl("get", "disagg", "-n", namespace, "-o", "wide")).splitlines()[0].split()
    assert wide == [
        *columns,
        "STAGES",
        "PREFILL",
        "DECODE",
        "WANT",
        "SCALING",
        "REASON",
        "ENDPOINT",
        "AGE",
    ]


def test_schema_errors_are_refused_and_unknown_fields_pruned(
    installed_crd: ControlPlane, namespace: str
) -> None:
    base = _example("pp2-hma.yaml")

    zero_tp = json.loads(json.dumps(base))
    zero_tp["metadata"]["name"] = "zero-tp"
    zero_tp["spec"]["prefill"]["tensorParallelSize"] = 0
    refused = _apply(installed_crd, namespace, zero_tp)
    assert refused.returncode != 0
    assert "spec.prefill.tensorParallelSize" in refused.stderr

    typo = json.loads(json.dumps(base))
    typo["metadata"]["name"] = "typo"
    typo["spec"]["prefill"]["tensorParallelsize"] = 2
    client_side = _apply(installed_crd, namespace, typo)
    assert client_side.returncode != 0
    assert 'unknown field "tensorParallelsize"' in client_side.stderr
    must(_apply(installed_crd, namespace, typo, "--validate=false"))
    stored = json.loads(must(installed_crd.kubectl("get", "disagg", "typo", "-n", namespace, "-o", "json")))
    assert "tensorParallelsize" not in stored["spec"]["prefill"]


def test_kubectl_explain_shows_the_model_descriptions(installed_crd: ControlPlane) -> None:
    def explained() -> bool:
        proc = installed_crd.kubectl("explain", "disaggdeployment.spec.kvTransfer.sideChannelPort")
        return proc.returncode == 0 and "Handshake side-channel TCP port." in proc.stdout

    poll(explained, "kubectl explain of the published CRD schema")


def test_the_cel_variant_is_refused_by_kubectl_1_20(installed_crd: ControlPlane) -> None:
    proc = installed_crd.kubectl(
        "apply", "--dry-run=client", "-f", str(CRDS / "cel" / "disagg.io_disaggdeployments.yaml")
    )
    assert proc.returncode != 0
    assert 'unknown field "x-kubernetes-validations"' in proc.stderr
