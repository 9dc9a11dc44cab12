"""The operator outlives an API server outage longer than kopf's retries and converges after it (issue 22,
finding 6: after a 70 s outage kopf logged `Request attempt #9/9 failed; escalating` and the process ended).

The shared control plane cannot be stopped under other sessions, so the outage is made in front of it: the
operator reaches the API server only through a TCP proxy in this test (TLS passes through untouched; the
certificate names 127.0.0.1), and for longer than kopf's default schedule retries the proxy drops every
connection and answers each new one as the restarted API server did: 503 "server is starting". (A refused
connection would not do: kopf's watch swallows connection errors and starts over; a 5xx it escalates, and
the escalation out of its CRD watch ends the operator.) Meanwhile a DisaggDeployment is created directly;
once the proxy forwards again, the same operator process must still be running and reconcile it."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import secrets
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest
from local_cluster import ControlPlane
from operator_harness import Cluster, OperatorProcess, example, wait_for

# kopf's default retries (1+1+2+3+5+8+13+21 s) end about 54 s after a watch first fails; the reported
# outage that ended the operator lasted 70 s.
OUTAGE_S = 80.0

pytestmark = pytest.mark.slow


STARTING = json.dumps(
    {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "message": "server is starting",
        "reason": "ServiceUnavailable",
        "code": 503,
    }
).encode()


class Proxy:
    """127.0.0.1:port forwarded to the API server byte for byte; while `starting`, every connection is
    dropped and each new one answered as a restarting kube-apiserver answers: 503 "server is starting",
    over TLS with the API server's own certificate."""

    def __init__(self, target: tuple[str, int], tls: ssl.SSLContext) -> None:
        self.target = target
        self.tls = tls
        self.starting = False
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def start_outage(self) -> None:
        self.starting = True
        with self._lock:
            for sock in self._open:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
            self._open.clear()

    def end_outage(self) -> None:
        self.starting = False

    def close(self) -> None:
        self.start_outage()
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self.starting:
                threading.Thread(target=self._answer_starting, args=(client,), daemon=True).start()
                continue
            try:
                server = socket.create_connection(self.target, timeout=10)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            with self._lock:
                self._open |= {client, server}
            for source, sink in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _answer_starting(self, client: socket.socket) -> None:
        client.settimeout(10)
        try:
            with self.tls.wrap_socket(client, server_side=True) as tls:
                head = b""
                while b"\r\n\r\n" not in head:
                    chunk = tls.recv(65536)
                    if not chunk:
                        return
                    head += chunk
                tls.sendall(
                    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                    + f"Content-Length: {len(STARTING)}\r\nConnection: close\r\n\r\n".encode()
                    + STARTING
                )
        except OSError:
            pass
        finally:
            client.close()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while chunk := source.recv(65536):
                sink.sendall(chunk)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)


@pytest.fixture
def proxied(control_plane: ControlPlane, tmp_path: Path) -> Iterator[tuple[ControlPlane, Proxy]]:
    """The control plane as the operator sees it: the same, but its server is the proxy."""
    target = urllib.parse.urlsplit(control_plane.server)
    pki = control_plane.kubeconfig.parent / "pki"
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(pki / "apiserver.crt", pki / "apiserver.key")
    proxy = Proxy((target.hostname or "127.0.0.1", target.port or 443), tls)
    kubeconfig = tmp_path / "proxied.kubeconfig"
    kubeconfig.write_text(
        control_plane.kubeconfig.read_text().replace(control_plane.server, f"https://127.0.0.1:{proxy.port}")
    )
    try:
        yield dataclasses.replace(control_plane, kubeconfig=kubeconfig), proxy
    finally:
        proxy.close()


def test_the_operator_outlives_an_outage_longer_than_kopfs_retries_and_converges(
    cluster: Cluster, proxied: tuple[ControlPlane, Proxy], tmp_path: Path
) -> None:
    through_proxy, proxy = proxied
    namespace = cluster.create_namespace(f"out-{secrets.token_hex(2)}")
    operator = OperatorProcess(through_proxy, [namespace], tmp_path / "operator.log")
    try:
        operator.start()
        assert cluster.kubectl_apply(example("pp2-hma.yaml", namespace, "before")).returncode == 0
        cluster.wait_condition(namespace, "before", "Compatible", "True")
        proxy.start_outage()
        # Written while the operator cannot see the API server: only the same process, alive after the
        # outage, can reconcile it (nothing restarts the operator here).
        assert cluster.kubectl_apply(example("pp2-hma.yaml", namespace, "during")).returncode == 0
        deadline = time.monotonic() + OUTAGE_S
        while time.monotonic() < deadline:
            assert operator.proc is not None and operator.proc.poll() is None, (
                f"the operator exited during the outage:\n{operator.tail()}"
            )
            time.sleep(1)
        proxy.end_outage()
        cluster.wait_condition(namespace, "during", "Compatible", "True")
        # The verdict is written before the children are applied: wait for them.
        wait_for(
            "the StatefulSet of the deployment written during the outage",
            lambda: cluster.names(namespace, "during")["StatefulSet"] == ["during-prefill-0"],
        )
        assert operator.proc is not None and operator.proc.poll() is None, operator.tail()
        log = operator.log.read_text(errors="replace").splitlines()
        assert any("failed; will retry" in line for line in log), operator.tail()
        # Only Events may be given up on (kopf posts them best-effort, on its own schedule); no watch or
        # write escalates.
        escalated = [line for line in log if "escalating" in line and "/events" not in line]
        assert escalated == [], escalated[:5]
    finally:
        operator.stop()
        cluster.delete_namespace(namespace)
