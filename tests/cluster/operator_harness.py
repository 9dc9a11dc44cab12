"""The operator as cluster tests run it: a real `disagg operator run` subprocess, and small API helpers.

A subprocess (not kopf's in-thread runner) makes "restart the operator mid-reconcile" real: SIGKILL, then
start it again. Each test module watches its own namespace glob: modules never reconcile each other's objects.
"""

from __future__ import annotations

import itertools
import json
import os
import secrets
import signal
import subprocess
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from local_cluster import REPO, ControlPlane

from disagg.operator.api import GROUP, PLURAL, VERSION
from disagg.operator.control.k8s_apply import MERGE, Kube
from disagg.rig import local
from disagg.rig.local import free_port

T = TypeVar("T")
DISAGG = REPO / ".venv" / "bin" / "disagg"
CRD = REPO / "crds" / "disagg.io_disaggdeployments.yaml"
EXAMPLES = REPO / "examples"


# Generous on purpose: these bound a hang, they do not measure anything. On a loaded 2-core machine kopf can
# take tens of seconds to notice a new namespace that matches its glob before it handles the first object.
WAIT_S = 150.0


def wait_for(what: str, probe: Callable[[], T | None], timeout: float = WAIT_S, interval: float = 0.2) -> T:
    """Poll until `probe` returns something truthy; fail the test with `what` and the last value otherwise."""
    return local.wait_for(what, probe, timeout, interval, error=AssertionError)


def satisfied(value: T, check: Callable[[T], bool]) -> T | None:
    """`value` if it passes `check`, for `wait_for` probes that should return what they saw."""
    return value if check(value) else None


class OperatorProcess:
    """`disagg operator run` against the test control plane, logging to a file the failure message shows."""

    def __init__(self, control_plane: ControlPlane, namespaces: list[str], log: Path, *extra: str) -> None:
        self.control_plane = control_plane
        self.namespaces = namespaces
        self.log = log
        self.extra = extra
        self.health_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        args = [str(DISAGG), "operator", "run", "--health-port", str(self.health_port), *self.extra]
        for namespace in self.namespaces:
            args += ["--namespace", namespace]
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                args, env=self.control_plane.env(), stdout=out, stderr=subprocess.STDOUT, cwd="/"
            )
        wait_for(f"the operator's /healthz (log: {self.log})", self._healthy)

    def _healthy(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"operator exited with {self.proc.returncode}:\n{self.tail()}")
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{self.health_port}/healthz", timeout=1
            ) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL: no cleanup at all, as a crashed or evicted operator."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


class Cluster:
    """Typed-enough shortcuts for what the operator tests read and write."""

    def __init__(self, control_plane: ControlPlane) -> None:
        self.cp = control_plane
        self.core = client.CoreV1Api(control_plane.api_client)
        self.apps = client.AppsV1Api(control_plane.api_client)
        self.custom = client.CustomObjectsApi(control_plane.api_client)
        self.kube = Kube(control_plane.api_client)

    def apply_crd(self) -> None:
        result = self.cp.kubectl("apply", "-f", str(CRD))
        assert result.returncode == 0, result.stderr
        wait_for(
            "the CRD to be established",
            lambda: (
                "True"
                in self.cp.kubectl(
                    "get",
                    "crd",
                    f"{PLURAL}.{GROUP}",
                    "-o",
                    'jsonpath={.status.conditions[?(@.type=="Established")].status}',
                ).stdout
            ),
        )

    def create_namespace(self, prefix: str) -> str:
        name = f"{prefix}-{secrets.token_hex(3)}"
        self.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
        return name

    def wait_watched(self, prefix: str) -> None:
        """Return once an operator watching the glob `{prefix}-*` handles objects in a new namespace.

        kopf starts watching a namespace that matches its glob when the namespace's watch event arrives; one
        that arrives before kopf has discovered its resources is passed over until the namespace changes again
        (seen here: an operator idle for minutes until the test deleted the namespace). So a probe namespace
        is relabelled until the operator has answered a refused probe object with its Compatible condition;
        the test namespaces created afterwards are then seen at once.
        """
        name = self.create_namespace(prefix)
        try:
            result = self.kubectl_apply(example("bad-decode-pp.yaml", name, "probe"))
            assert result.returncode == 0, result.stderr
            pokes = itertools.count()

            def answered() -> dict[str, Any] | None:
                found = self.condition(name, "probe", "Compatible")
                if found is None:
                    label = {"disagg.io/test-poke": str(next(pokes))}
                    self.core.patch_namespace(name, {"metadata": {"labels": label}})
                return found

            wait_for(f"the operator to watch {prefix}-* namespaces", answered, interval=2.0)
        finally:
            self.delete_namespace(name)

    def delete_namespace(self, name: str) -> None:
        try:
            self.core.delete_namespace(name)
        except ApiException as error:
            if error.status != 404:
                raise

    def kubectl_apply(self, document: dict[str, Any]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.cp.bin_dir / "kubectl"), "apply", "-f", "-"],
            input=yaml.safe_dump(document),
            capture_output=True,
            text=True,
            env=self.cp.env(),
            check=False,
        )

    def get(self, namespace: str, name: str) -> dict[str, Any] | None:
        # A plain GET: the operator's own reader, not the logic the tests judge.
        return self.kube.read_deployment(namespace, name)

    def patch_spec(self, namespace: str, name: str, spec_patch: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object(
            GROUP,
            VERSION,
            namespace,
            PLURAL,
            name,
            {"spec": spec_patch},
            _content_type=MERGE,
        )

    def delete(self, namespace: str, name: str) -> None:
        self.custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)

    def condition(self, namespace: str, name: str, type_: str) -> dict[str, Any] | None:
        body = self.get(namespace, name) or {}
        for item in (body.get("status") or {}).get("conditions") or ():
            if item["type"] == type_:
                found: dict[str, Any] = item
                return found
        return None

    def wait_condition(
        self,
        namespace: str,
        name: str,
        type_: str,
        status: str,
        reason: str | None = None,
        timeout: float = WAIT_S,
    ) -> dict[str, Any]:
        def probe() -> dict[str, Any] | None:
            found = self.condition(namespace, name, type_)
            if found and found["status"] == status and (reason is None or found["reason"] == reason):
                return found
            return None

        return wait_for(f"{type_}={status} ({reason}) on {namespace}/{name}", probe, timeout=timeout)

    def children(self, namespace: str, owner: str) -> dict[str, list[dict[str, Any]]]:
        """Every object the operator labels as this owner's, by kind (raw dicts)."""
        selector = f"app.kubernetes.io/instance={owner}"
        listers = {
            "StatefulSet": self.apps.list_namespaced_stateful_set,
            "Deployment": self.apps.list_namespaced_deployment,
            "Service": self.core.list_namespaced_service,
            "ConfigMap": self.core.list_namespaced_config_map,
            "Pod": self.core.list_namespaced_pod,
        }
        found = {}
        for kind, lister in listers.items():
            response = lister(namespace, label_selector=selector, _preload_content=False)
            found[kind] = _json(response)["items"]
        return found

    def names(self, namespace: str, owner: str) -> dict[str, list[str]]:
        return {
            kind: sorted(item["metadata"]["name"] for item in items)
            for kind, items in self.children(namespace, owner).items()
            if kind != "Pod"
        }

    def patch_pod_status(self, namespace: str, pod: str, status: dict[str, Any]) -> None:
        """Strategic merge on pods/status, as a kubelet (or the sidecar, for its own condition) would."""
        self.core.patch_namespaced_pod_status(pod, namespace, {"status": status})


def _json(response: Any) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(response.data)
    return body


def example(
    name: str, namespace: str, metadata_name: str, spec_patch: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A committed example with a new name and namespace, its spec deep-merged with `spec_patch`."""
    document: dict[str, Any] = yaml.safe_load((EXAMPLES / name).read_text())
    document["metadata"] = {"name": metadata_name, "namespace": namespace}
    if spec_patch:
        document["spec"] = _merge(document["spec"], spec_patch)
    return document


def _merge(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in patch.items():
        merged[key] = (
            _merge(merged[key], value)
            if isinstance(value, dict) and isinstance(merged.get(key), dict)
            else value
        )
    return merged
