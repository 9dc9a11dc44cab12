"""The engine socket of a real sidecar: bad input gets a typed error reply and the sidecar keeps serving;
health and readiness follow the registration; SIGTERM exits 0 and releases everything."""

from __future__ import annotations

import os
import socket
import struct
from pathlib import Path
from typing import Any

import msgspec
import pytest
from sidecar_procs import KVShape, SidecarProcess, metric

from disagg.rig.local import free_port
from disagg.worker.kv.errors import (
    BlockIdOutOfRange,
    DisaggError,
    DuplicateRequest,
    EngineLayoutMismatch,
    EngineProtocolError,
    LayoutNotRegistered,
    UnknownRequest,
    WrongRole,
)
from disagg.worker.kv.layout import ModelGeometry
from disagg.worker.link.engine_link import (
    MAX_FRAME_BYTES,
    EngineLink,
    Error,
    ExpectRequest,
    PrefillEngine,
    QueryRequest,
    RequestFinished,
    decode_sidecar_message,
    encode_frame,
    read_frame,
)
from disagg.worker.link.kv_pool import ShmPool

GEOMETRY = ModelGeometry.with_full_every(6, 3, num_kv_heads=2, head_size=8, dtype_bytes=2)
BLOCK_SIZE, NUM_BLOCKS = 16, 24
ENGINE_ID = "socket-test-prefill"


SHAPE = KVShape(GEOMETRY, BLOCK_SIZE, NUM_BLOCKS)


def refused(link: EngineLink, message: Any, error: type[DisaggError], reason: str | None = None) -> str:
    with pytest.raises(error) as caught:
        link.call(message)
    if reason is not None:
        assert caught.value.reason == reason
    return caught.value.message


def raw_call(sock: socket.socket, frame: bytes) -> Any:
    sock.sendall(frame)
    body = read_frame(sock)
    assert body is not None
    return decode_sidecar_message(body)


def test_bad_engine_input_gets_typed_errors_and_the_sidecar_keeps_serving(
    workdir: Path, sidecars: list[SidecarProcess]
) -> None:
    sidecar = SidecarProcess(
        workdir, "p0", SHAPE.topology(), DISAGG_ROLE="prefill", DISAGG_ENGINE_ID=ENGINE_ID, DISAGG_PP_RANK="0"
    )
    sidecars.append(sidecar)
    sidecar.wait_listening()
    code, body = sidecar.get("/readyz")
    assert (code, body.strip()) == (503, "the engine has not registered its KV layout")
    assert sidecar.get("/healthz") == (200, "ok\n")

    pool = ShmPool.create(workdir / "p0.kv", SHAPE.stage_layout().total_bytes)
    good = SHAPE.registration(pool, ENGINE_ID, "prefill")
    groups = len(SHAPE.stage_layout().groups)
    with EngineLink(sidecar.socket_path) as link:
        refused(link, QueryRequest("never-seen"), UnknownRequest)
        refused(link, RequestFinished("r1", [[1]] * groups), LayoutNotRegistered)

        text = refused(link, msgspec.structs.replace(good, block_size=32), EngineLayoutMismatch)
        assert text == "block_size: the engine registers 32, the sidecar's configuration says 16"
        regions = list(good.regions)
        regions[1] = msgspec.structs.replace(regions[1], offset=regions[1].offset + 64)
        text = refused(link, msgspec.structs.replace(good, regions=regions), EngineLayoutMismatch)
        assert text.startswith("regions[1].offset: the engine registers")
        kinds = ["full"] * GEOMETRY.num_layers
        wrong_model = msgspec.structs.replace(
            good, model=msgspec.structs.replace(good.model, layer_kinds=kinds)
        )
        assert refused(link, wrong_model, EngineLayoutMismatch).startswith("model.layer_kinds:")
        assert sidecar.get("/readyz")[0] == 503

        link.register_layout(good)
        link.register_layout(good)  # the same registration again is idempotent
        assert sidecar.get("/readyz") == (200, "ready\n")

        text = refused(
            link, RequestFinished("r1", [[3, NUM_BLOCKS]] + [[1]] * (groups - 1)), BlockIdOutOfRange
        )
        assert (
            text
            == f"group 0: block ids [{NUM_BLOCKS}] are outside 0..{NUM_BLOCKS - 1} (the pool holds 24 blocks)"
        )
        refused(link, RequestFinished("r1", [[-1]] * groups), BlockIdOutOfRange)
        assert "KV cache groups" in refused(link, RequestFinished("r1", [[1]]), EngineProtocolError)
        prefill = PrefillEngine("someone", "127.0.0.1", 5600)
        refused(link, ExpectRequest("r1", [[1]] * groups, prefill), WrongRole)

        link.request_finished("r1", [[g + 1] for g in range(groups)])
        refused(link, RequestFinished("r1", [[9]] * groups), DuplicateRequest)
        status = link.query("r1")
        assert (status.request_id, status.state) == ("r1", "pending")

    # Undecodable bytes and oversized frames on a raw connection.
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
        raw.connect(sidecar.socket_path)
        garbage = b"\xc1 not msgpack"
        reply = raw_call(raw, struct.pack(">I", len(garbage)) + garbage)
        assert isinstance(reply, Error) and reply.reason == "InvalidEngineMessage"
        unknown_type = msgspec.msgpack.encode({"type": "drop_tables"})
        reply = raw_call(raw, struct.pack(">I", len(unknown_type)) + unknown_type)
        assert isinstance(reply, Error) and "drop_tables" in reply.message
        reply = raw_call(raw, encode_frame(QueryRequest("r1")))  # the same connection still works
        assert reply.state == "pending"
        reply = raw_call(raw, struct.pack(">I", MAX_FRAME_BYTES + 1))
        assert isinstance(reply, Error) and "limit" in reply.message
        assert raw.recv(1) == b""  # a frame that cannot be skipped ends that connection
    with EngineLink(sidecar.socket_path) as link:
        assert link.query("r1").state == "pending"

    _, metrics = sidecar.get("/metrics")
    assert metric(metrics, "disagg_engine_message_errors_total", reason="EngineLayoutMismatch") == 3
    assert metric(metrics, "disagg_engine_message_errors_total", reason="BlockIdOutOfRange") == 2
    assert metric(metrics, "disagg_engine_message_errors_total", reason="InvalidEngineMessage") == 4
    assert metric(metrics, "disagg_sidecar_ready") == 1
    assert metric(metrics, "disagg_kv_bytes_pushed_total") == 0

    assert sidecar.terminate() == 0
    assert not os.path.exists(sidecar.socket_path)
    assert '"msg": "sidecar stopped, NIXL agent released"' in sidecar.log()
    pool.close()


def test_invalid_configuration_exits_2_with_a_structured_reason(
    workdir: Path, sidecars: list[SidecarProcess]
) -> None:
    sidecar = SidecarProcess(
        workdir,
        "bad",
        SHAPE.topology(),
        DISAGG_ROLE="prefill",
        DISAGG_ENGINE_ID=ENGINE_ID,
        DISAGG_PP_RANK="0",
        DISAGG_BLOCK_SIZE="32",
    )
    sidecars.append(sidecar)
    assert sidecar.proc.wait(timeout=60) == 2
    assert (
        '"reason": "InvalidWorkerConfig", "error": "DISAGG_BLOCK_SIZE=32 contradicts the topology file\'s '
        'blockSize 16"'
    ) in sidecar.log()


def test_an_unreachable_prefill_engine_fails_the_request_with_its_reason(
    workdir: Path, sidecars: list[SidecarProcess]
) -> None:
    sidecar = SidecarProcess(
        workdir, "d0", SHAPE.topology(), DISAGG_ROLE="decode", DISAGG_ENGINE_ID="socket-test-decode"
    )
    sidecars.append(sidecar)
    sidecar.wait_listening()
    pool = ShmPool.create(workdir / "d0.kv", SHAPE.stage_layout().total_bytes)
    message = SHAPE.registration(pool, "socket-test-decode", "decode")
    groups = len(SHAPE.stage_layout().groups)
    nobody = PrefillEngine("gone-prefill", "127.0.0.1", free_port(), tp_size=1, pp_size=2)
    with EngineLink(sidecar.socket_path) as link:
        link.register_layout(message)
        link.expect_request("r1", [[g + 1] for g in range(groups)], nobody)
        with pytest.raises(DisaggError) as caught:
            link.wait("r1", timeout_s=60)
        assert caught.value.reason == "PeerUnreachable"
        status = link.query("r1")
        assert (status.state, status.reason) == ("failed", "PeerUnreachable")
        refused(link, RequestFinished("r2", [[1]] * groups), WrongRole)
    _, metrics = sidecar.get("/metrics")
    assert metric(metrics, "disagg_kv_transfer_failures_total", reason="PeerUnreachable") == 1
    assert metric(metrics, "disagg_kv_transfers_total", direction="received") is None
    assert sidecar.get("/readyz")[0] == 200
    assert sidecar.terminate() == 0
    pool.close()


def test_a_killed_sidecar_is_reported_to_the_engine_as_unreachable(
    workdir: Path, sidecars: list[SidecarProcess]
) -> None:
    sidecar = SidecarProcess(
        workdir, "p0", SHAPE.topology(), DISAGG_ROLE="prefill", DISAGG_ENGINE_ID=ENGINE_ID, DISAGG_PP_RANK="0"
    )
    sidecars.append(sidecar)
    sidecar.wait_listening()
    pool = ShmPool.create(workdir / "p0.kv", SHAPE.stage_layout().total_bytes)
    with EngineLink(sidecar.socket_path) as link:
        link.register_layout(SHAPE.registration(pool, ENGINE_ID, "prefill"))
        sidecar.kill()
        # Whether the send or the wait for the reply notices first, the engine gets the typed reason.
        for _ in range(2):
            with pytest.raises(DisaggError) as caught:
                link.query("never-seen")
            assert caught.value.reason == "PeerUnreachable", caught.value
