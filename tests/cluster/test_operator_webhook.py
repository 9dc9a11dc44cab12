"""The validating admission webhook on the real kube-apiserver: `kubectl apply` of an incompatible spec is
refused with the operator's own message, a valid one is admitted, and an incompatible update is refused
too. kopf serves it on 127.0.0.1 with a self-signed certificate and writes its own webhook configuration,
whose name is unique to this module and removed afterwards (one left behind would block every write)."""

from __future__ import annotations

import json
import secrets
import ssl
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from operator_harness import Cluster, OperatorProcess, example, free_port, wait_for

from disagg.operator.control.webhook import HANDLER_ID, refusal

NAME = "gemma"


@pytest.fixture(scope="module")
def webhook_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def webhook_operator(
    cluster: Cluster, tmp_path_factory: pytest.TempPathFactory, webhook_port: int
) -> Iterator[str]:
    """The operator with its webhook; yields the namespace it serves."""
    # A letter first: a label value of digits and one "e" (9145e0) is a number to kubectl's YAML reader.
    token = "w" + secrets.token_hex(3)
    configuration = f"w{token}.dev.validate.disagg.io"
    namespace = cluster.create_namespace(f"opw-{token}")
    process = OperatorProcess(
        cluster.cp,
        [namespace],
        tmp_path_factory.mktemp("webhook") / "operator.log",
        "--webhook-port",
        str(webhook_port),
        "--webhook-dev",
        "--webhook-configuration",
        configuration,
    )
    admission = client.AdmissionregistrationV1Api(cluster.cp.api_client)
    process.start()
    try:
        probe = example("bad-decode-pp.yaml", namespace, "probe")
        wait_for(
            "the webhook to refuse (server-side dry run)",
            lambda: "denied the request" in _apply(cluster, probe, "--dry-run=server").stderr,
        )
        yield namespace
    finally:
        process.stop()
        for delete in (
            admission.delete_validating_webhook_configuration,
            admission.delete_mutating_webhook_configuration,
        ):
            try:
                delete(configuration)
            except ApiException as error:
                if error.status != 404:
                    raise
        cluster.delete_namespace(namespace)


def _apply(cluster: Cluster, document: dict[str, object], *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(cluster.cp.bin_dir / "kubectl"), "apply", *flags, "-f", "-"],
        input=yaml.safe_dump(document),
        capture_output=True,
        text=True,
        env=cluster.cp.env(),
        check=False,
    )


def test_incompatible_create_is_refused_with_the_operators_message(
    cluster: Cluster, webhook_operator: str
) -> None:
    document = example("bad-block-size.yaml", webhook_operator, "bad")
    result = _apply(cluster, document)
    assert result.returncode != 0
    expected = refusal(document["spec"])
    assert expected is not None and expected.startswith("BlockSizeMismatch")
    assert f'admission webhook "{HANDLER_ID}.' in result.stderr
    assert f"denied the request: {expected}" in result.stderr
    assert cluster.get(webhook_operator, "bad") is None


def test_valid_create_is_admitted_and_incompatible_update_refused(
    cluster: Cluster, webhook_operator: str
) -> None:
    result = _apply(cluster, example("pp2-hma.yaml", webhook_operator, NAME))
    assert result.returncode == 0, result.stderr
    assert "created" in result.stdout
    update = example("pp2-hma.yaml", webhook_operator, NAME, {"decode": {"pipelineParallelSize": 2}})
    refused = _apply(cluster, update)
    assert refused.returncode != 0
    assert "denied the request: DecodePipelineParallel: decode pipelineParallelSize is 2" in refused.stderr
    stored = cluster.get(webhook_operator, NAME)
    assert stored is not None and stored["spec"]["decode"].get("pipelineParallelSize", 1) == 1
    cluster.wait_condition(webhook_operator, NAME, "Compatible", "True")


def test_engine_argument_conflicts_are_refused(cluster: Cluster, webhook_operator: str) -> None:
    document = example(
        "pp2-hma.yaml", webhook_operator, "args", {"prefill": {"extraArgs": ["--block-size", "16"]}}
    )
    result = _apply(cluster, document)
    assert result.returncode != 0
    assert (
        "denied the request: EngineArgumentConflict: spec.engine.extraArgs or spec.prefill.extraArgs sets "
        in (result.stderr)
    )


@pytest.mark.parametrize(
    "body",
    [b"{}", b'{"request": {"uid": "u1"}}', b"\xff\xfe not utf-8", b"[" * 50000 + b"]" * 50000],
    ids=["no-request", "no-resource", "not-utf8", "deep"],
)
def test_a_malformed_review_is_answered_with_a_reason_never_a_500(
    webhook_operator: str, webhook_port: int, body: bytes
) -> None:
    """The operator's real webhook server, over HTTPS, as the API server would call it."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # kopf's self-signed certificate; what is checked here is the answer
    request = urllib.request.Request(
        f"https://127.0.0.1:{webhook_port}/{HANDLER_ID}",
        data=body,
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, context=context, timeout=30) as response:
            status, text = response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        status, text = error.code, error.read().decode()
    assert status in (200, 400), (status, text)
    assert "MalformedAdmissionReview" in text
    if status == 200:
        review = json.loads(text)
        assert review["kind"] == "AdmissionReview"
        assert review["response"] == {
            "uid": "u1",
            "allowed": False,
            "status": {"code": 400, "message": review["response"]["status"]["message"]},
        }


@pytest.mark.parametrize("path", ["/", "/x"])
def test_a_path_that_names_no_handler_is_404(webhook_operator: str, webhook_port: int, path: str) -> None:
    """kopf ran no handler on a path that names none and allowed the review (issue 22, finding 9)."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    document = example("bad-block-size.yaml", webhook_operator, "paths")
    body = {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "u1",
            "resource": {"group": "disagg.io", "version": "v1alpha1", "resource": "disaggdeployments"},
            "operation": "CREATE",
            "userInfo": {"username": "tester"},
            "object": document,
        },
    }
    request = urllib.request.Request(
        f"https://127.0.0.1:{webhook_port}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with pytest.raises(urllib.error.HTTPError) as answered:
        urllib.request.urlopen(request, context=context, timeout=30).close()
    assert answered.value.code == 404
    assert "NoSuchWebhook" in answered.value.read().decode()
