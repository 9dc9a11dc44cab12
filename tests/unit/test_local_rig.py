"""The local rig's stand-ins for a kubelet and kube-proxy: the pure rules they follow."""

from __future__ import annotations

import socket
import threading
from typing import Any

import pytest
from built import container, objects
from dd_specs import spec
from kubernetes import client

from disagg.operator.builders.pod_template import ENGINE_CONTAINER
from disagg.rig.local_kubelet import Readiness, expand, is_project_image, runs_vllm
from disagg.rig.local_serving import wait_until_served
from disagg.rig.service_proxy import Backend, ServiceProxy, backends


def test_project_images_are_recognised_on_any_registry_and_tag() -> None:
    assert is_project_image("ghcr.io/disagg/disagg:0.1.0")
    assert is_project_image("registry.local:5000/team/disagg-transfer@sha256:" + "0" * 64)
    assert is_project_image("disagg")
    assert not is_project_image("vllm/vllm-openai:v0.33.0")
    assert not is_project_image("ghcr.io/disagg/disagg-tools:1")


def test_a_vllm_engine_is_known_by_the_command_the_operator_gave_it_not_its_image() -> None:
    def engine(kind: str) -> dict[str, Any]:
        built = objects(spec({"engine": {"image": "registry.corp/ml/inference:0.33", "kind": kind}}))
        return container(built["Deployment", "gemma-pp2-decode"], ENGINE_CONTAINER)

    assert runs_vllm(engine("VLLM"))
    assert not runs_vllm(engine("Custom"))


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


class _Service:
    """A loopback listener standing in for a Service address: it closes the first `closing` connections
    unanswered (the proxy without a ready endpoint), answers 503 to the next `unready` (a router without a
    routable pair), then 200."""

    def __init__(self, closing: int, unready: int) -> None:
        self.plan = ["close"] * closing + ["503"] * unready
        self.seen = 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with conn:
                step = self.plan[self.seen] if self.seen < len(self.plan) else "200"
                self.seen += 1
                if step == "close":
                    continue
                conn.recv(65536)
                status = "503 Service Unavailable" if step == "503" else "200 OK"
                conn.sendall(
                    f"HTTP/1.1 {status}\r\nContent-Length: 3\r\nConnection: close\r\n\r\nok\n".encode()
                )


def test_a_service_is_served_only_once_readyz_answers_200_through_it() -> None:
    service = _Service(closing=3, unready=2)
    checks: list[int] = []
    try:
        wait_until_served(service.url, lambda: checks.append(1), timeout_s=30)
    finally:
        service.listener.close()
    assert service.seen == 6, "three closed connections and two 503s come before the 200"
    assert len(checks) == 6, "the caller's check runs before every probe"


def test_a_service_that_never_serves_fails_the_wait_with_what_it_last_answered() -> None:
    service = _Service(closing=0, unready=10**6)
    try:
        with pytest.raises(AssertionError, match=r"/readyz did not answer 200 in 0.5 s; last: 503"):
            wait_until_served(service.url, lambda: None, timeout_s=0.5)
    finally:
        service.listener.close()


def test_the_service_proxy_closes_open_connections_without_an_error_logged() -> None:
    """A client's keep-alive connection is still open when the proxy closes: its handler is cancelled, and
    asyncio (3.11) logged that as "Exception in callback" with a CancelledError traceback, pages of them in
    a bench run."""
    echo = socket.create_server(("127.0.0.1", 0))
    echo_port = echo.getsockname()[1]

    def serve() -> None:
        connection, _ = echo.accept()
        with connection:
            while data := connection.recv(1024):
                connection.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    proxy = ServiceProxy(client.ApiClient(), "ns")
    logged: list[dict[str, Any]] = []
    proxy._loop.set_exception_handler(lambda _loop, context: logged.append(context))
    listen = socket.create_server(("127.0.0.1", 0))
    port = listen.getsockname()[1]
    listen.close()
    proxy._call(proxy._apply({("127.0.0.1", port): [Backend("127.0.0.1", echo_port)]}))
    with socket.create_connection(("127.0.0.1", port), timeout=5) as kept_alive:
        kept_alive.sendall(b"ping")
        assert kept_alive.recv(4) == b"ping"
        proxy.close()
    echo.close()
    assert [context.get("message") for context in logged] == []
