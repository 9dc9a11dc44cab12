"""What every process the rig starts on this machine needs: free ports, loopback UCX, and a bounded wait.

The tests, the demos and the benchmarks all start servers on 127.0.0.1; they take these from here rather than
each keeping a copy.
"""

from __future__ import annotations

import itertools
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TypeVar

from disagg.worker.connector.transport import LOOPBACK_UCX_ENV as _TRANSPORT_LOOPBACK

T = TypeVar("T")

REPO = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"

# UCX on loopback only, with the transports a single host has (CMA between processes, TCP for control), and
# NIXL quiet: every rig process that owns an agent runs with these.
LOOPBACK_UCX_ENV: Mapping[str, str] = {
    **_TRANSPORT_LOOPBACK,
    "UCX_TLS": "tcp,cma,self",
    "NIXL_LOG_LEVEL": "ERROR",
}

# Ports handed out lie below the kernel's ephemeral range: a port bound and released there can be taken
# by any outgoing connection (UCX, ZMQ and HTTP clients make many) before the server that was promised it
# binds it, which showed as "Address already in use" under load. Below the range only a server that binds
# explicitly can take it, and each process starts at its own offset so concurrent sessions rarely meet.
# The fixed control-plane ports (12379, 12380, 16443) lie below PORT_FLOOR.
PORT_FLOOR = 20000
_lock = threading.Lock()


def _ephemeral_low() -> int:
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return max(low, PORT_FLOOR + 1000)


def _candidates() -> itertools.cycle[int]:
    low = _ephemeral_low()
    span = low - PORT_FLOOR
    start = (os.getpid() * 7919) % span
    return itertools.cycle([PORT_FLOOR + (start + i) % span for i in range(span)])


_ports = _candidates()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now and that this process has not handed out before."""
    with _lock:
        for _ in range(_ephemeral_low() - PORT_FLOOR):
            port = next(_ports)
            with socket.socket() as sock:
                try:
                    sock.bind((HOST, port))
                except OSError:
                    continue
            return port
    raise OSError(f"no free TCP port on {HOST} between {PORT_FLOOR} and the ephemeral range")


def wait_for(
    what: str,
    probe: Callable[[], T | None],
    timeout_s: float,
    interval_s: float = 0.2,
    error: Callable[[str], Exception] = TimeoutError,
) -> T:
    """Poll `probe` until it returns something truthy; raise `error` naming `what` and the last value seen."""
    deadline = time.monotonic() + timeout_s
    last: T | None = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(interval_s)
    raise error(f"timed out after {timeout_s:.0f} s waiting for {what}; last seen: {last!r}")
