"""One side of a real two-process NIXL WRITE whose UCX lanes the transport reads from UCX's own log.

`python _lanes_peer.py ROLE DIR`: `dst` registers a zeroed buffer, `src` one of 7s and WRITEs it into `dst`'s
with a notification; each publishes its metadata (and `dst` its buffer's address) as files in DIR. Each prints
one JSON line: the lanes its agent reports for the peer, and (dst) whether the bytes arrived, or the refusal's
reason and message if its agent could not start.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from disagg.worker.connector.transport import NixlTransport, XferState, descriptor_array
from disagg.worker.connector.ucx_log import UcxLog, enable
from disagg.worker.kv.errors import DisaggError

NBYTES = 1 << 20
DEADLINE_S = 60.0


def wait_for(path: Path) -> bytes:
    deadline = time.monotonic() + DEADLINE_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.02)
    return path.read_bytes()


def publish(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    tmp.rename(path)


def main(role: str, where: Path) -> None:
    log_file = enable(os.environ, where)
    assert log_file is not None
    log = UcxLog(log_file)
    other = "src" if role == "dst" else "dst"
    buf = np.zeros(NBYTES, dtype=np.uint8) if role == "dst" else np.full(NBYTES, 7, dtype=np.uint8)
    try:
        transport = NixlTransport(f"lanes-{role}", ucx_log=log)
    except DisaggError as exc:
        print(json.dumps({"reason": exc.reason, "message": exc.message}), flush=True)
        return
    transport.register(buf.ctypes.data, NBYTES)
    if role == "dst":
        publish(where / "dst.addr", str(buf.ctypes.data).encode())
    publish(where / f"{role}.md", transport.metadata())
    peer = transport.add_peer(wait_for(where / f"{other}.md"))
    result: dict[str, object] = {"peer": peer, "lanes": list(transport.lanes(peer))}
    deadline = time.monotonic() + DEADLINE_S
    if role == "src":
        remote = int(wait_for(where / "dst.addr"))
        xfer = transport.write_descs(
            descriptor_array([buf.ctypes.data], [NBYTES]), peer, descriptor_array([remote], [NBYTES]), b"kv"
        )
        while transport.state(xfer) is not XferState.DONE and time.monotonic() < deadline:
            time.sleep(0.001)
        transport.release(xfer)
        wait_for(where / "dst.done")
    else:
        while not transport.notifs() and time.monotonic() < deadline:
            time.sleep(0.005)
        result["arrived"] = bool((buf == 7).all())
        publish(where / "dst.done", b"")
    transport.close()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
