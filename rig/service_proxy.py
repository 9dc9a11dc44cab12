"""What kube-proxy would do for a namespace's Services, on a control plane that has none.

The local control plane (`hack/control-plane.sh`) allocates ClusterIPs from a loopback range, so a Service's
address can be bound on this host. `ServiceProxy` listens on `<ClusterIP>:<port>` for every port of every
ClusterIP Service in one namespace and forwards each TCP connection to one Ready pod the Service selects (its
`targetPort`, by number or by the pod's container port name), as kube-proxy's userspace mode did. The
endpoints are the proxy's own: Kubernetes 1.20 refuses loopback addresses in Endpoints objects, and every
local pod has a loopback IP. `sync()` refreshes Services and endpoints; call it as often as the kubelet's.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import itertools
import json
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from kubernetes import client

CHUNK = 1 << 16


@dataclass(frozen=True)
class Backend:
    host: str
    port: int


def _json(response: Any) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(response.data)
    return body


def _ready(pod: Mapping[str, Any]) -> bool:
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    status = pod.get("status") or {}
    conditions = {c.get("type"): c.get("status") for c in status.get("conditions") or ()}
    return bool(status.get("podIP")) and conditions.get("Ready") == "True"


def _target_port(pod: Mapping[str, Any], target: int | str) -> int | None:
    if isinstance(target, int):
        return target
    if target.isdigit():
        return int(target)
    for container in (pod.get("spec") or {}).get("containers") or ():
        for port in container.get("ports") or ():
            if port.get("name") == target:
                return int(port["containerPort"])
    return None


def backends(service: Mapping[str, Any], pods: Sequence[Mapping[str, Any]]) -> dict[int, list[Backend]]:
    """For each port of `service`: the Ready pods it selects, at the port it targets. Pure."""
    selector: Mapping[str, str] = (service.get("spec") or {}).get("selector") or {}
    chosen = [
        pod
        for pod in pods
        if selector
        and _ready(pod)
        and all(((pod.get("metadata") or {}).get("labels") or {}).get(k) == v for k, v in selector.items())
    ]
    found: dict[int, list[Backend]] = {}
    for port in (service.get("spec") or {}).get("ports") or ():
        if port.get("protocol", "TCP") != "TCP":
            continue
        target = port.get("targetPort", port["port"])
        found[int(port["port"])] = [
            Backend(pod["status"]["podIP"], number)
            for pod in chosen
            if (number := _target_port(pod, target)) is not None
        ]
    return found


@dataclass
class ServiceProxy:
    """Forwards each bound ClusterIP port to the Service's Ready pods, round robin; `close()` stops it."""

    api: client.ApiClient
    namespace: str
    _loop: asyncio.AbstractEventLoop = field(init=False)
    _thread: threading.Thread = field(init=False)
    _servers: dict[tuple[str, int], asyncio.AbstractServer] = field(init=False, default_factory=dict)
    _backends: dict[tuple[str, int], list[Backend]] = field(init=False, default_factory=dict)
    _turn: itertools.count[int] = field(init=False, default_factory=itertools.count)

    def __post_init__(self) -> None:
        self.core = client.CoreV1Api(self.api)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="service-proxy", daemon=True)
        self._thread.start()

    def _call(self, coroutine: Any) -> Any:
        future: Future[Any] = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        return future.result(timeout=30)

    def sync(self) -> None:
        services = _json(self.core.list_namespaced_service(self.namespace, _preload_content=False))["items"]
        pods = _json(self.core.list_namespaced_pod(self.namespace, _preload_content=False))["items"]
        wanted: dict[tuple[str, int], list[Backend]] = {}
        for service in services:
            address = (service.get("spec") or {}).get("clusterIP") or ""
            if address in ("", "None") or not ipaddress.ip_address(address).is_loopback:
                continue
            for port, found in backends(service, pods).items():
                wanted[(address, port)] = found
        self._call(self._apply(wanted))

    async def _apply(self, wanted: dict[tuple[str, int], list[Backend]]) -> None:
        self._backends = wanted
        for key in set(self._servers) - set(wanted):
            self._servers.pop(key).close()
        for key in set(wanted) - set(self._servers):
            host, port = key
            self._servers[key] = await asyncio.start_server(
                functools.partial(self._forward, key), host, port, reuse_address=True
            )

    def addresses(self) -> list[tuple[str, int]]:
        return sorted(self._servers)

    async def _forward(
        self, key: tuple[str, int], reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        try:
            await self._relay(key, reader, writer)
        except asyncio.CancelledError:
            # `close()` ends the connections still open. The handler's task must then end normally:
            # asyncio 3.11's stream server asks a finished handler task for its exception, which raises
            # for a cancelled one, and logs that as "Exception in callback" with a traceback per connection.
            writer.close()

    async def _relay(
        self, key: tuple[str, int], reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        found = self._backends.get(key) or []
        if not found:
            # kube-proxy rejects a connection to a Service without ready endpoints.
            writer.close()
            return
        backend = found[next(self._turn) % len(found)]
        try:
            up_reader, up_writer = await asyncio.open_connection(backend.host, backend.port)
        except OSError:
            writer.close()
            return
        try:
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        except (OSError, ConnectionError):
            pass  # either side went away: the connection ends, as it would through kube-proxy
        finally:
            writer.close()
            up_writer.close()

    def close(self) -> None:
        async def stop() -> None:
            for server in self._servers.values():
                server.close()
            self._servers.clear()
            # The connections still open (a client's keep-alive) end here, while the loop runs: left pending,
            # each would close its sockets when collected, on a stopped loop, and raise there.
            open_now = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in open_now:
                task.cancel()
            await asyncio.gather(*open_now, return_exceptions=True)

        with contextlib.suppress(Exception):
            self._call(stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy until end of stream, then half-close: the other direction may still be answering."""
    while data := await reader.read(CHUNK):
        writer.write(data)
        await writer.drain()
    if writer.can_write_eof():
        writer.write_eof()
