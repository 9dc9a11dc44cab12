"""The deployment's engine pods, as the API server sees them: one list, then a watch, in a thread.

The router must learn a pod change (a decoder gone unready, a new prefill engine, a handshake refused) when
it happens, not at the next poll, so it lists once and then watches from the list's resourceVersion, resuming
each watch where the last event (or bookmark) left it. A 410 Gone (the API server no longer has that
version) or any other failure relists: the cache is then replaced whole, so a deletion missed while
disconnected cannot linger. Every change hands the whole pod list to `on_change` (the router recomputes
its routing from it).
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

from kubernetes import client
from kubernetes.watch.watch import iter_resp_lines

from disagg.worker.contracts.engine_pods import essentials
from disagg.worker.contracts.pod_contract import DEPLOYMENT_LABEL, ROLE_LABEL

log = logging.getLogger("disagg.worker.router.discovery")

PodList = list[dict[str, Any]]


def engine_pod_selector(deployment: str) -> str:
    """The deployment's engine pods: its label, and a role (router pods carry the label but no role)."""
    return f"{DEPLOYMENT_LABEL}={deployment},{ROLE_LABEL}"


class PodCache:
    """Pods by name, as the camelCase `engine_pods.essentials` of each. Not thread-safe: only the watch
    thread touches it."""

    def __init__(self) -> None:
        self._pods: dict[str, dict[str, Any]] = {}

    def replace(self, items: list[dict[str, Any]]) -> None:
        self._pods = {pod["metadata"]["name"]: essentials(pod) for pod in items}

    def apply(self, event_type: str, pod: Mapping[str, Any]) -> bool:
        """One watch event; True if the cache changed."""
        name = pod["metadata"]["name"]
        if event_type == "DELETED":
            return self._pods.pop(name, None) is not None
        if event_type in ("ADDED", "MODIFIED"):
            self._pods[name] = essentials(pod)
            return True
        return False

    def pods(self) -> PodList:
        return list(self._pods.values())


class PodWatcher:
    """Lists and watches the engine pods of `deployment` in `namespace`; calls `on_change(pods)` after the
    first list and after every change. `run` blocks until `stop` is set."""

    def __init__(
        self,
        api: client.ApiClient,
        namespace: str,
        deployment: str,
        on_change: Callable[[PodList], None],
        *,
        watch_timeout_s: int = 240,
        retry_s: float = 2.0,
    ) -> None:
        self.core = client.CoreV1Api(api)
        self.namespace = namespace
        self.selector = engine_pod_selector(deployment)
        self.on_change = on_change
        self.watch_timeout_s = watch_timeout_s
        self.retry_s = retry_s
        self.cache = PodCache()
        self.relists = 0
        self._stop = threading.Event()
        self._response: Any = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="pod-watch", daemon=True)
        self._thread.start()

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        self._stop.set()
        response = self._response
        if response is not None:
            # Unblocks the watch thread's read now rather than at the watch's timeout.
            with contextlib.suppress(Exception):
                response.shutdown()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def run(self) -> None:
        while not self._stop.is_set():
            try:
                version = self._list()
                self._watch_from(version)
            except client.ApiException as exc:
                if exc.status == 410:
                    log.info("pod watch: resourceVersion expired, relisting")
                    continue
                log.warning(
                    "pod watch: API error %s %s; relisting in %.0f s", exc.status, exc.reason, self.retry_s
                )
                self._stop.wait(self.retry_s)
            except Exception as exc:  # a dropped connection, an API server restart: relist, never die
                log.warning("pod watch: %s: %s; relisting in %.0f s", type(exc).__name__, exc, self.retry_s)
                self._stop.wait(self.retry_s)

    def _list(self) -> str:
        response: Any = self.core.list_namespaced_pod(
            self.namespace, label_selector=self.selector, _preload_content=False, _request_timeout=30
        )
        body = json.loads(response.data)
        self.cache.replace(body.get("items") or [])
        self.relists += 1
        self.on_change(self.cache.pods())
        version: str = body["metadata"]["resourceVersion"]
        return version

    def _watch_from(self, version: str) -> None:
        """Watch from `version`, resuming each (server-ended) watch at the last version seen, until stopped.
        Raises on 410 and on any failure, for `run` to relist."""
        while not self._stop.is_set():
            response: Any = self.core.list_namespaced_pod(
                self.namespace,
                label_selector=self.selector,
                watch=True,
                resource_version=version,
                allow_watch_bookmarks=True,
                timeout_seconds=self.watch_timeout_s,
                _request_timeout=(10, self.watch_timeout_s + 30),
                _preload_content=False,
            )
            self._response = response
            try:
                for line in iter_resp_lines(response):  # type: ignore[no-untyped-call]
                    if not line.strip():
                        continue
                    event = json.loads(line)
                    kind, obj = event.get("type"), event.get("object") or {}
                    if kind == "ERROR":
                        raise client.ApiException(status=obj.get("code"), reason=obj.get("message"))
                    version = (obj.get("metadata") or {}).get("resourceVersion") or version
                    if kind != "BOOKMARK" and self.cache.apply(kind, obj):
                        self.on_change(self.cache.pods())
                    if self._stop.is_set():
                        return
            finally:
                self._response = None
                response.close()
                response.release_conn()
