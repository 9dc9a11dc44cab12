"""The admission webhook as the Helm chart runs it: `--webhook-port` with `--webhook-cert-dir` (tls.crt and
tls.key, as the chart mounts them), serving the path the chart's configuration calls. A module of its own:
the dev-mode webhook of test_operator_webhook.py is cluster-wide and would answer first."""

from __future__ import annotations

import base64
import secrets

import pytest
from kubernetes import client
from operator_harness import Cluster, OperatorProcess, example, free_port, satisfied, wait_for

from disagg.operator.control.webhook import HANDLER_ID, SelfSignedWebhookServer, refusal


def test_cert_dir_mode_serves_the_charts_path(
    cluster: Cluster, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The chart's mode: certificate files, no configuration written by kopf. The configuration here is the
    chart's, except that it calls a URL (no kubelet or proxy routes a Service) and selects one namespace."""
    cert_dir = tmp_path_factory.mktemp("certs")
    cert, key = SelfSignedWebhookServer.build_certificate(["127.0.0.1"])
    (cert_dir / "tls.crt").write_bytes(cert)
    (cert_dir / "tls.key").write_bytes(key)
    # A letter first: a label value of digits and one "e" (9145e0) is a number to kubectl's YAML reader.
    token = "w" + secrets.token_hex(3)
    namespace = cluster.create_namespace(f"opc-{token}")
    cluster.core.patch_namespace(namespace, {"metadata": {"labels": {"disagg.io/webhook-test": token}}})
    port = free_port()
    process = OperatorProcess(
        cluster.cp,
        [namespace],
        tmp_path_factory.mktemp("certdir") / "operator.log",
        "--webhook-port",
        str(port),
        "--webhook-cert-dir",
        str(cert_dir),
    )
    admission = client.AdmissionregistrationV1Api(cluster.cp.api_client)
    name = f"chart-{token}.validate.disagg.io"
    process.start()
    try:
        created = cluster.kubectl_apply(
            {
                "apiVersion": "admissionregistration.k8s.io/v1",
                "kind": "ValidatingWebhookConfiguration",
                "metadata": {"name": name},
                "webhooks": [
                    {
                        "name": "validate.disaggdeployments.disagg.io",
                        "admissionReviewVersions": ["v1"],
                        "sideEffects": "None",
                        "failurePolicy": "Fail",
                        "clientConfig": {
                            "url": f"https://127.0.0.1:{port}/{HANDLER_ID}",
                            "caBundle": base64.b64encode(cert).decode(),
                        },
                        "namespaceSelector": {"matchLabels": {"disagg.io/webhook-test": token}},
                        "rules": [
                            {
                                "apiGroups": ["disagg.io"],
                                "apiVersions": ["v1alpha1"],
                                "operations": ["CREATE", "UPDATE"],
                                "resources": ["disaggdeployments"],
                                "scope": "Namespaced",
                            }
                        ],
                    }
                ],
            }
        )
        assert created.returncode == 0, created.stderr
        document = example("bad-tp-not-divisible.yaml", namespace, "bad")
        result = wait_for(
            "the chart-style webhook to refuse",
            lambda: satisfied(cluster.kubectl_apply(document), lambda r: "denied the request" in r.stderr),
        )
        expected = refusal(document["spec"])
        assert expected is not None
        assert f'admission webhook "validate.disaggdeployments.disagg.io" denied the request: {expected}' in (
            result.stderr
        )
    finally:
        process.stop()
        admission.delete_validating_webhook_configuration(name)
        cluster.delete_namespace(namespace)
