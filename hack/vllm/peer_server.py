"""vLLM's own code behind a JSON-lines request/response loop: the interop tests' long-lived peer process.

The project's tests run in the project venv; vLLM runs here, in .venv-vllm, imported once (an import costs
~10 s). One request per line on stdin, one reply per line on the original stdout:

    {"op": "metadata_encode", "args": {...}}   ->   {"ok": true, "result": ...}
                                               or   {"ok": false, "type": "KeyError", "error": "..."}

vLLM logs to stdout, so the protocol keeps the original stdout file descriptor and fd 1 becomes stderr.
Bytes travel as {"$bytes": "<hex>"}, tuples as lists. Start it with the release on sys.path (the installed
0.33.0, or PYTHONPATH=<an extracted wheel> for 0.31.0 / 0.32.0, as golden.py does):

    PYTHONSAFEPATH=1 .venv-vllm/bin/python hack/vllm/peer_server.py

Every operation calls vLLM's classes and functions; this file only converts arguments and results.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import sys
import threading
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
_PROTOCOL = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)
sys.stdout = sys.stderr

import msgspec  # noqa: E402
import peer  # noqa: E402  (sets HF_HUB_OFFLINE, VLLM_TARGET_DEVICE, HF_HOME before vLLM is imported)
import vllm  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import metadata as M  # noqa: E402

_ENCODER = msgspec.msgpack.Encoder()
_LISTENERS: dict[int, tuple[threading.Thread, threading.Event, dict[tuple[int, int], bytes]]] = {}


def to_json(value: Any) -> Any:
    if isinstance(value, bytes):
        return {"$bytes": value.hex()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {
            str(k) if not isinstance(k, tuple) else ",".join(map(str, k)): to_json(v)
            for k, v in value.items()
        }
    if isinstance(value, list | tuple | set | frozenset):
        return [to_json(v) for v in value]
    return value


def from_json(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"$bytes"}:
            return bytes.fromhex(value["$bytes"])
        return {k: from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_json(v) for v in value]
    return value


def _metadata(fields: dict[str, Any]) -> Any:
    fields = dict(fields)
    if "ssm_sizes" in fields:
        fields["ssm_sizes"] = tuple(fields["ssm_sizes"])
    if "packed_member_layouts" in fields:
        fields["packed_member_layouts"] = {k: tuple(v) for k, v in fields["packed_member_layouts"].items()}
    return M.NixlAgentMetadata(**fields)


# --- operations --------------------------------------------------------------------------------------------


def op_version() -> dict[str, Any]:
    return {
        "vllm_version": vllm.__version__,
        "vllm_file": vllm.__file__,
        "connector_version": M.NIXL_CONNECTOR_VERSION,
        "metadata_fields": [f.name for f in dataclasses.fields(M.NixlAgentMetadata)],
        "payload_fields": [f.name for f in dataclasses.fields(M.NixlHandshakePayload)],
    }


def op_metadata_encode(fields: dict[str, Any]) -> bytes:
    """vLLM's NixlAgentMetadata(**fields), encoded as register_kv_caches does."""
    return _ENCODER.encode(_metadata(fields))


def op_metadata_decode(data: bytes) -> dict[str, Any]:
    """vLLM's typed decode (as _nixl_handshake does), and vLLM's re-encoding of the decoded object."""
    decoded = msgspec.msgpack.Decoder(M.NixlAgentMetadata).decode(data)
    return {"fields": to_json(decoded), "reencoded": _ENCODER.encode(decoded)}


def op_payload_encode(compatibility_hash: str, agent_metadata_bytes: bytes) -> bytes:
    return _ENCODER.encode(M.NixlHandshakePayload(compatibility_hash, agent_metadata_bytes))


def op_payload_decode(data: bytes) -> dict[str, Any]:
    decoded = msgspec.msgpack.Decoder(M.NixlHandshakePayload).decode(data)
    return {"fields": to_json(decoded), "reencoded": _ENCODER.encode(decoded)}


def op_config_hash(
    argv: list[str],
    attn_backend_name: str | None = None,
    transfer_mode: str | None = None,
    restore_repo_id: bool = True,
) -> dict[str, Any]:
    """A VllmConfig built by vLLM from a `vllm serve` argv, and vLLM's compatibility hash of it.

    The backend defaults to the one the config names (`--attention-backend`, which the GPU worker's backend
    selection honours; CPU auto-selection would name a CPU backend), and the transfer mode to the connector
    worker's `_TRANSFER_MODE`: what register_kv_caches passes."""
    config = peer.build_vllm_config(argv, restore_repo_id=restore_repo_id)
    ktc = config.kv_transfer_config
    backend = getattr(config.attention_config, "backend", None)
    if attn_backend_name is None:
        attn_backend_name = backend.get_class().get_name()
    if transfer_mode is None:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import NixlBaseConnectorWorker
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPushConnector
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import NixlPushConnectorWorker

        cls = KVConnectorFactory.get_connector_class_by_name(ktc.kv_connector)
        worker = NixlPushConnectorWorker if issubclass(cls, NixlPushConnector) else NixlBaseConnectorWorker
        transfer_mode = worker._TRANSFER_MODE
    digest, factors = peer.compat_hash(config, attn_backend_name, transfer_mode)
    return {
        "hash": digest,
        "factors": factors,
        "engine_id": None if ktc is None else ktc.engine_id,
        "kv_role": None if ktc is None else ktc.kv_role,
        "kv_connector": None if ktc is None else ktc.kv_connector,
        "kv_load_failure_policy": None if ktc is None else ktc.kv_load_failure_policy,
        "tensor_parallel_size": config.parallel_config.tensor_parallel_size,
        "pipeline_parallel_size": config.parallel_config.pipeline_parallel_size,
        "block_size": config.cache_config.block_size,
        "attention_backend": None if backend is None else backend.name,
    }


def op_parse_argv(argv: list[str]) -> dict[str, Any]:
    """`vllm serve`'s own parser and validation; the parsed namespace, JSON-safe values only."""
    args = peer.parse_serve_argv(argv)
    return {k: v for k, v in vars(args).items() if isinstance(v, str | int | float | bool | type(None))}


def op_parse_refusal(argv: list[str]) -> str | None:
    """None when `vllm serve`'s parser and validation accept `argv`; else why they refuse it. argparse's
    error() prints to stderr and raises SystemExit(2), which would end this loop: it is caught here, and
    the message it printed is the answer."""
    printed = io.StringIO()
    try:
        with contextlib.redirect_stderr(printed):
            peer.parse_serve_argv(argv)
    except SystemExit as exc:
        lines = printed.getvalue().strip().splitlines()
        return f"exit status {exc.code}: {lines[-1] if lines else ''}"
    except Exception as exc:  # vLLM's own checks (cmd.validate, parse_args) raise rather than exit
        return f"{type(exc).__name__}: {exc}"
    return None


def op_python_version() -> str:
    return sys.version.split()[0]


def op_serve_options() -> dict[str, Any]:
    """The release's `vllm serve` option table, as disagg.worker.contracts.vllm_serve_options ships it."""
    return peer.serve_option_table()


def op_release_facts(backends: list[str]) -> dict[str, Any]:
    """The release's NIXL P/D facts (hack/vllm/peer.py `release_facts`), for hack/vllm/release.py."""
    return peer.release_facts(backends)


def op_serve_option_samples(model: str, config_file: str) -> dict[str, Any]:
    """A value (and a dotted key) for each option with which the release's parser accepts it."""
    return peer.serve_option_samples(model, config_file)


def op_env_names() -> list[str]:
    return sorted(peer.known_env_names())


def op_pp_indices(num_layers: int, pp_size: int, partition: str | None = None) -> list[list[int]]:
    """vLLM's get_pp_indices for every rank (with VLLM_PP_LAYER_PARTITION when given)."""
    import vllm.envs as envs
    from vllm.distributed.utils import get_pp_indices

    old = os.environ.get("VLLM_PP_LAYER_PARTITION")
    try:
        if partition is None:
            os.environ.pop("VLLM_PP_LAYER_PARTITION", None)
        else:
            os.environ["VLLM_PP_LAYER_PARTITION"] = partition
        if hasattr(envs, "disable_envs_cache"):
            envs.disable_envs_cache()
        return [list(get_pp_indices(num_layers, rank, pp_size)) for rank in range(pp_size)]
    finally:
        if old is None:
            os.environ.pop("VLLM_PP_LAYER_PARTITION", None)
        else:
            os.environ["VLLM_PP_LAYER_PARTITION"] = old


def op_kv_transfer_config(config: dict[str, Any]) -> dict[str, Any]:
    """vLLM's KVTransferConfig from the JSON the operator puts in --kv-transfer-config, and the connector
    class the factory's registry resolves for it."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    ktc = KVTransferConfig(**config)
    cls = KVConnectorFactory.get_connector_class_by_name(ktc.kv_connector)
    return {
        "engine_id": ktc.engine_id,
        "kv_role": ktc.kv_role,
        "kv_connector": ktc.kv_connector,
        "kv_connector_extra_config": ktc.kv_connector_extra_config,
        "connector_class": f"{cls.__module__}.{cls.__qualname__}",
        "supports_hma": KVConnectorFactory.supports_hma_config(ktc),
        "registry": sorted(KVConnectorFactory._registry),
    }


def op_listener_start(payloads: dict[str, bytes], host: str, port: int) -> int:
    """vLLM's real side-channel server (NixlBaseConnectorScheduler._nixl_handshake_listener) in a thread.
    payloads: {"pp,tp": encoded NixlHandshakePayload}. Returns a handle for listener_stop."""
    table = {tuple(int(x) for x in key.split(",")): value for key, value in payloads.items()}
    thread, stop = peer.start_listener(table, host, port)
    handle = len(_LISTENERS) + 1
    _LISTENERS[handle] = (thread, stop, table)
    return handle


def op_listener_alive(handle: int) -> bool:
    return _LISTENERS[handle][0].is_alive()


def op_listener_stop(handle: int) -> bool:
    thread, stop, _ = _LISTENERS.pop(handle)
    was_alive = thread.is_alive()
    stop.set()
    thread.join(timeout=5)
    return was_alive


def op_handshake(
    host: str,
    port: int,
    compat_hash: str,
    remote_tp_size: int,
    expected_engine_id: str,
    remote_pp_size: int = 1,
    tp_rank: int = 0,
    tp_size: int = 1,
    notif_agents_only: bool = False,
    enforce_compat_hash: bool = True,
    block_size: int = 16,
    physical_blocks_per_logical: int = 1,
) -> dict[str, Any]:
    """vLLM's real `_nixl_handshake` client on a minimal NixlPushConnectorWorker whose kernel block size and
    kernel blocks per logical block are the given ones (0.34's push checks them); the NIXL agent calls are
    recorded (NIXL is not installed in the vLLM venv)."""
    worker = peer.handshake_worker(
        compat_hash,
        tp_rank=tp_rank,
        tp_size=tp_size,
        enforce_compat_hash=enforce_compat_hash,
        block_size=block_size,
        physical_blocks_per_logical=physical_blocks_per_logical,
    )
    agents, clock_offset = worker._nixl_handshake(
        host,
        port,
        remote_tp_size,
        expected_engine_id,
        remote_pp_size=remote_pp_size,
        notif_agents_only=notif_agents_only,
    )
    return {
        "agents": {f"{pp},{tp}": name for (pp, tp), name in agents.items()},
        "clock_offset": clock_offset,
        "added_notif_only": [to_json(blob) for blob in worker.nixl_wrapper.added],
        "added_full": [
            {"metadata": to_json(m), "remote_tp_rank": r, "remote_tp_size": s, "remote_dcp_size": d}
            for m, r, s, d in worker.added_full
        ],
    }


def op_pair_regions(
    data: bytes,
    local_members: list[list[str]],
    group_by_layer: dict[str, int],
    block_lens: list[int],
    pp_size: int = 1,
) -> dict[str, Any]:
    """vLLM's own `_pair_regions` (0.34 and later) pairing a peer's encoded metadata with a worker whose regions
    hold `local_members` (cache group of each layer `group_by_layer`, one block length per region, no MLA, no
    packed rows, no Mamba): the pairs it returns, or its refusal. The worker is made with object.__new__ and
    only the attributes `_pair_regions` reads; the metadata is decoded by vLLM's typed decoder."""
    import types

    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import NixlPushConnectorWorker

    if not hasattr(NixlPushConnectorWorker, "_pair_regions"):
        raise NotImplementedError(f"vLLM {vllm.__version__} pairs regions without _pair_regions")
    worker = object.__new__(NixlPushConnectorWorker)
    worker._set_region_layers(local_members)
    worker.kv_cache_config = types.SimpleNamespace(transfer_group_index_by_layer=group_by_layer)
    worker.pp_size = pp_size
    worker.block_len_per_layer = block_lens
    worker._region_is_mla = []
    worker._packed_member_layouts = {}
    worker._has_mamba = False
    meta = msgspec.msgpack.Decoder(M.NixlAgentMetadata).decode(data)
    return to_json(dataclasses.asdict(worker._pair_regions(meta)))


def op_kernel_blocks(backend: str, block_sizes: list[int]) -> dict[str, Any]:
    """What vLLM's attention backend `backend` declares (`get_supported_kernel_block_sizes()`, without a KV
    spec) and the kernel block size vLLM's `select_common_block_size` picks for each logical block size
    (None where it finds none)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.worker.utils import select_common_block_size

    cls = AttentionBackendEnum[backend].get_class()
    declared = [
        size if isinstance(size, int) else {"multiple_of": size.base}
        for size in cls.get_supported_kernel_block_sizes()
    ]
    picked: dict[str, int | None] = {}
    for block_size in block_sizes:
        try:
            picked[str(block_size)] = select_common_block_size(block_size, [cls])
        except ValueError:
            picked[str(block_size)] = None
    return {"declared": declared, "picked": picked}


def op_push_round_trip(
    prefill_argv: list[str],
    decode_argv: list[str],
    request_id: str,
    num_tokens: int,
    prefill_host: str,
    prefill_port: int,
) -> dict[str, Any]:
    """vLLM's NixlPushConnectorScheduler on both sides: the prefill's request_finished kv_transfer_params, and
    the registration the decoder's update_state_after_alloc builds from them."""
    from vllm.v1.request import RequestStatus

    pcfg, dcfg = peer.build_vllm_config(prefill_argv), peer.build_vllm_config(decode_argv)
    prefill = peer.push_scheduler(pcfg, host=prefill_host, port=prefill_port)
    request = peer.make_request(
        request_id, num_tokens, {"do_remote_decode": True, "do_remote_prefill": False}
    )
    request.num_computed_tokens = num_tokens
    request.status = RequestStatus.FINISHED_LENGTH_CAPPED
    blocks = num_tokens // 16 + 1
    _, params = prefill.request_finished(
        request, (list(range(1, 1 + blocks)), list(range(201, 201 + blocks)))
    )
    decoder = peer.push_scheduler(dcfg, host="127.0.0.2", port=prefill_port)
    request = peer.make_request(request_id, num_tokens, params, max_tokens=16)
    matched, _ = decoder.get_num_new_matched_tokens(request, 0)
    decoder.update_state_after_alloc(
        request,
        peer.make_blocks(list(range(100, 100 + blocks)), list(range(500, 500 + blocks))),
        matched,
    )
    return {
        "prefill_engine_id": prefill.engine_id,
        "decode_engine_id": decoder.engine_id,
        "kv_transfer_params": to_json(params),
        "registration": to_json(decoder._push_pending_registrations[request.request_id]),
    }


def op_push_prefill_finished(
    prefill_argv: list[str],
    request_id: str,
    num_tokens: int,
    prefill_host: str,
    prefill_port: int,
    kv_transfer_params: dict[str, Any],
    status: str = "FINISHED_LENGTH_CAPPED",
) -> dict[str, Any]:
    """vLLM's prefill NixlPushConnectorScheduler.request_finished for a request that arrived with
    `kv_transfer_params` (a router's prefill leg) and finished in `status`: what the prefill's response
    carries (`kv_transfer_params` None: the response carries none)."""
    from vllm.v1.request import RequestStatus

    prefill = peer.push_scheduler(peer.build_vllm_config(prefill_argv), host=prefill_host, port=prefill_port)
    request = peer.make_request(request_id, num_tokens, kv_transfer_params)
    request.num_computed_tokens = num_tokens
    request.status = RequestStatus[status]
    blocks = num_tokens // 16 + 1
    delay_free, params = prefill.request_finished(
        request, (list(range(1, 1 + blocks)), list(range(201, 201 + blocks)))
    )
    return {"engine_id": prefill.engine_id, "delay_free_blocks": delay_free, "kv_transfer_params": params}


def op_push_decode_registration(
    decode_argv: list[str], request_id: str, num_tokens: int, kv_transfer_params: dict[str, Any]
) -> dict[str, Any]:
    """vLLM's decoder NixlPushConnectorScheduler consuming a decode leg's `kv_transfer_params` (as a router
    sent them): the tokens it will wait for and the registration update_state_after_alloc stages for its
    worker to send to every prefill worker."""
    decoder = peer.push_scheduler(peer.build_vllm_config(decode_argv), host="127.0.0.2", port=5601)
    request = peer.make_request(request_id, num_tokens, kv_transfer_params, max_tokens=16)
    matched, is_async = decoder.get_num_new_matched_tokens(request, 0)
    blocks = num_tokens // 16 + 1
    decoder.update_state_after_alloc(
        request,
        peer.make_blocks(list(range(100, 100 + blocks)), list(range(500, 500 + blocks))),
        matched,
    )
    return {
        "matched": matched,
        "async_load": is_async,
        "decode_engine_id": decoder.engine_id,
        "registration": to_json(decoder._push_pending_registrations.get(request.request_id)),
        "waits_for_kv": request.request_id in decoder._reqs_need_recv,
    }


OPS = {name[3:]: fn for name, fn in globals().items() if name.startswith("op_")}


def main() -> None:
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            request = json.loads(line)
            result = OPS[request["op"]](**from_json(request.get("args", {})))
            reply = {"ok": True, "result": to_json(result)}
        except Exception as exc:  # every failure goes back to the test, which decides what it means
            reply = {
                "ok": False,
                "type": type(exc).__name__,
                "error": str(exc),
                "traceback": traceback.format_exc(limit=6),
            }
        _PROTOCOL.write(json.dumps(reply) + "\n")
    for handle in list(_LISTENERS):
        op_listener_stop(handle)


if __name__ == "__main__":
    main()
