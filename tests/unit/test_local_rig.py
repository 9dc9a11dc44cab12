"""The local rig's stand-ins for a kubelet and kube-proxy: the pure rules they follow."""

from __future__ import annotations

from typing import Any

from disagg.rig.local_kubelet import Readiness, expand, is_project_image
from disagg.rig.service_proxy import Backend, backends


def test_project_images_are_recognised_on_any_registry_and_tag() -> None:
    assert is_project_image("ghcr.io/disagg/disagg:0.1.0")
    assert is_project_image("registry.local:5000/team/disagg-transfer@sha256:" + "0" * 64)
    assert is_project_image("disagg")
    assert not is_project_image("vllm/vllm-openai:v0.33.0")
    assert not is_project_image("ghcr.io/disagg/disagg-tools:1")


def test_expansion_follows_kubernetes_rules() -> None:
    env = {"POD_NAME": "p-0", "EMPTY": ""}
    assert expand("--name=$(POD_NAME)", env) == "--name=p-0"
    assert expand("$(UNKNOWN) stays", env) == "$(UNKNOWN) stays"
    assert expand("$$(POD_NAME) is escaped", env) == "$(POD_NAME) is escaped"
    assert expand("$(EMPTY)x", env) == "x"


def pod(
    name: str, ip: str | None, ready: bool, labels: dict[str, str], deleting: bool = False
) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name, "labels": labels}
    if deleting:
        metadata["deletionTimestamp"] = "2026-12-01T00:00:00Z"
    return {
        "metadata": metadata,
        "spec": {"containers": [{"name": "router", "ports": [{"name": "http", "containerPort": 8000}]}]},
        "status": {
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def test_a_service_forwards_only_to_ready_selected_pods_at_their_target_port() -> None:
    service = {
        "spec": {
            "selector": {"app": "r"},
            "ports": [{"port": 80, "targetPort": "http"}, {"port": 9, "targetPort": 9090}],
        }
    }
    pods = [
        pod("a", "127.1.1.1", True, {"app": "r"}),
        pod("b", "127.1.1.2", False, {"app": "r"}),
        pod("c", "127.1.1.3", True, {"app": "other"}),
        pod("d", None, True, {"app": "r"}),
        pod("e", "127.1.1.5", True, {"app": "r"}, deleting=True),
    ]
    assert backends(service, pods) == {80: [Backend("127.1.1.1", 8000)], 9: [Backend("127.1.1.1", 9090)]}


def test_a_service_without_selector_has_no_backends() -> None:
    service = {"spec": {"ports": [{"port": 80}]}}
    assert backends(service, [pod("a", "127.1.1.1", True, {})]) == {80: []}


def test_a_ready_container_turns_unready_only_after_the_probes_failure_threshold() -> None:
    answers = iter([False, True, False, False, True, False, False, False])
    readiness = Readiness(lambda: next(answers), failure_threshold=3)
    # Not ready until a probe passes; then a failure or two in a row (a slow answer on a loaded machine)
    # leaves it ready, and the third in a row takes it out, as a kubelet's failureThreshold does.
    assert [readiness.ready() for _ in range(8)] == [False, True, True, True, True, True, True, False]
