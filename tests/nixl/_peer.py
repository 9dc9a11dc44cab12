"""One connector worker process for the NIXL tests (run by `_procs.Peer`; argv[1] is its JSON spec).

It maps a seeded KV pool in /dev/shm, registers it with its own NIXL agent, serves (or hands to the
engine's serving rank) its handshake payload, and runs a PushProducer or PushConsumer, taking commands on
stdin and printing events on stdout, one JSON object per line.
"""

from __future__ import annotations

import json
import os
import select
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from _procs import initial_pool, layout_of, model_of

from disagg.worker.connector.consumer import PushConsumer
from disagg.worker.connector.producer import PushProducer
from disagg.worker.connector.push import LocalKV, PushConfig, RemoteEngine, agent_name
from disagg.worker.connector.side_channel import SideChannelServer
from disagg.worker.connector.transport import NixlTransport
from disagg.worker.link.kv_pool import ShmPool

LIFETIME_S = 300.0


def emit(**event: Any) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def serve_engine(spec: dict[str, Any], payload: bytes) -> SideChannelServer:
    """The engine's side channel, hosted by rank (0, 0): it serves every rank's payload, as vLLM's does."""
    server = SideChannelServer(spec["host"], spec["port"]).start()
    server.set_payload(spec["pp_rank"], spec["tp_rank"], payload)
    deadline = time.monotonic() + 60
    for pp, tp in spec["serve_ranks"]:
        if (pp, tp) == (spec["pp_rank"], spec["tp_rank"]):
            continue
        path = Path(spec["payload_dir"]) / f"{pp}-{tp}.msgpack"
        while not path.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank ({pp}, {tp}) never published its payload")
            time.sleep(0.05)
        server.set_payload(pp, tp, path.read_bytes())
    return server


def main() -> int:
    spec = json.loads(sys.argv[1])
    layout = layout_of(spec)
    pool = ShmPool.create(spec["pool_path"], layout.total_bytes)
    pool.array[:] = initial_pool(spec, layout.total_bytes)
    config = PushConfig(
        engine_id=spec["engine_id"],
        model=model_of(spec),
        side_channel_host=spec["host"],
        side_channel_port=spec["port"],
        compat_hash=spec["compat_hash"],
        compat_factors=spec.get("compat_factors"),
        tp_rank=spec["tp_rank"],
        tp_size=spec["tp_size"],
        kv_lease_duration_s=spec["lease_s"],
        push_registration_timeout_s=spec["registration_timeout_s"],
    )
    transport = NixlTransport(agent_name(spec["engine_id"], spec["pp_rank"], spec["tp_rank"]))
    local = LocalKV(layout, transport, pool.addr, pool.nbytes, config)
    payload = local.handshake_payload()
    server = None
    if spec["serve"]:
        server = serve_engine(spec, payload)
    else:
        tmp = Path(spec["payload_dir"]) / f".{spec['pp_rank']}-{spec['tp_rank']}.tmp"
        tmp.write_bytes(payload)
        os.replace(tmp, tmp.with_name(f"{spec['pp_rank']}-{spec['tp_rank']}.msgpack"))
    connector: PushProducer | PushConsumer
    connector = PushProducer(local) if spec["role"] == "producer" else PushConsumer(local)
    emit(event="ready", agent=transport.name)

    deadline = time.monotonic() + LIFETIME_S
    stdin = sys.stdin.buffer
    while time.monotonic() < deadline:
        readable, _, _ = select.select([stdin], [], [], 0.002)
        if readable:
            line = stdin.readline()
            if not line:
                break
            cmd = json.loads(line)
            if cmd["cmd"] == "quit":
                break
            if cmd["cmd"] == "finish":
                assert isinstance(connector, PushProducer)
                connector.request_finished(cmd["req"], cmd["blocks"])
                if cmd.get("announce"):
                    # The poll right below posts the WRITE when the decoder is connected and registered.
                    emit(event="posting", req=cmd["req"])
            elif cmd["cmd"] == "expect":
                assert isinstance(connector, PushConsumer)
                connector.expect(cmd["req"], cmd["blocks"], RemoteEngine(**cmd["remote"]))
            elif cmd["cmd"] == "peers":
                emit(event="peers", peers=sorted(transport.peers))
        events = connector.poll()
        for failure in events.failed:
            emit(
                event="failed",
                req=failure.request_id,
                reason=failure.reason,
                message=failure.message,
                peers=sorted(transport.peers),
            )
        for sent in getattr(events, "sent", ()):
            emit(event="sent", req=sent.request_id, nbytes=sent.nbytes)
        for kind in ("expired", "registered", "finished"):
            for req in getattr(events, kind, ()):
                emit(event=kind, req=req)
    connector.close()
    if server is not None:
        emit(event="server", served=server.served, rejected=server.rejected)
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
