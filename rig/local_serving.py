"""One DisaggDeployment's pods served on this machine: `LocalKubelet` runs every container as a process and
`ServiceProxy` stands in for kube-proxy, both synced by one `KubeletLoop`; and the reads a caller of the
served deployment makes (its pods, its router Service's address, whether that address serves yet)."""

from __future__ import annotations

import ipaddress
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kubernetes import client

from disagg.operator.api import GROUP, PLURAL, VERSION
from disagg.rig.local_kubelet import KubeletLoop, LocalKubelet
from disagg.rig.service_proxy import ServiceProxy
from disagg.worker.contracts.pod_contract import DEPLOYMENT_LABEL


@contextmanager
def local_serving(
    api: client.ApiClient, kubeconfig: Path, namespace: str, name: str, workdir: Path
) -> Iterator[tuple[LocalKubelet, KubeletLoop]]:
    """The pods of deployment `name` as processes while the block runs (their files under `workdir`); every
    process stopped after it, and the loop's first error raised."""
    kubelet = LocalKubelet(api, kubeconfig, namespace, name, workdir)
    proxy = ServiceProxy(api, namespace)
    loop = KubeletLoop([kubelet.sync, proxy.sync]).start()
    try:
        yield kubelet, loop
    finally:
        try:
            loop.stop()
        finally:
            proxy.close()
            kubelet.stop_all()


def read_deployment(custom: client.CustomObjectsApi, namespace: str, name: str) -> dict[str, Any]:
    """DisaggDeployment `name` as the API server's JSON."""
    response: Any = custom.get_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, name, _preload_content=False
    )
    found: dict[str, Any] = json.loads(response.data)
    return found


def live_pods(core: client.CoreV1Api, namespace: str, name: str) -> list[dict[str, Any]]:
    """The pods of deployment `name`, as the API server's JSON (what `routing_from_pods` reads)."""
    response: Any = core.list_namespaced_pod(
        namespace, label_selector=f"{DEPLOYMENT_LABEL}={name}", _preload_content=False
    )
    items: list[dict[str, Any]] = json.loads(response.data)["items"]
    return items


def service_url(core: client.CoreV1Api, namespace: str, name: str) -> str:
    """The base URL of deployment `name`'s router Service, where `ServiceProxy` listens."""
    response: Any = core.read_namespaced_service(f"{name}-router", namespace, _preload_content=False)
    spec = json.loads(response.data)["spec"]
    address = spec["clusterIP"]
    if not ipaddress.ip_address(address).is_loopback:
        raise RuntimeError(
            f"ClusterIP {address} is not a loopback address: restart the control plane "
            "(hack/control-plane.sh allocates ClusterIPs from a loopback range for the kube-proxy stand-in)"
        )
    return f"http://{address}:{spec['ports'][0]['port']}"


def wait_until_served(url: str, check: Callable[[], None], timeout_s: float = 120.0) -> float:
    """Seconds until the router Service at `url` answers /readyz with 200: a routable pair, reached through
    the Service. The deployment's `routablePairs` is what the router sees, not that its Service has a ready
    endpoint yet; until it has one, the proxy closes every connection (as kube-proxy rejects them), and a
    load started on the status alone fails its first requests, each at once (the likeliest cause of a CI
    run's 311 failed requests at the start of the autoscale test's load)."""
    start = time.monotonic()
    last = ""
    while True:
        check()
        try:
            with urllib.request.urlopen(f"{url}/readyz", timeout=5) as response:
                if response.status == 200:
                    return time.monotonic() - start
                last = f"{response.status}"
        except urllib.error.HTTPError as exc:
            last = f"{exc.code} {exc.read()[:200]!r}"
        except OSError as exc:
            last = f"{type(exc).__name__}: {exc}"
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"{url}/readyz did not answer 200 in {timeout_s:g} s; last: {last}")
        time.sleep(0.2)
