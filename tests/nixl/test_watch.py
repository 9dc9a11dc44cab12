"""The watching sidecar's round against real side channels serving real NIXL agent metadata.

The pod's engine (in production vLLM running `NixlPushConnector`) is stood in for by a worker built as
`test_peer_check` builds them: a real `LocalKV` registered with a real NIXL agent, its handshake payload
served on a real side channel at the address the sidecar's configuration names. The watching sidecar's
config is its own (its own environment and topology file), so the engine can differ from the spec.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_peer_check import DECODE_POD, HEAD_POD, HOST, PREFILL_POD, config, peer_of, topology, worker
from test_peer_check import engine as prefill_engine

from disagg.rig.local import free_port
from disagg.worker.contracts.pod_contract import ROLE_LABEL, SIDE_CHANNEL_PORT_NAME, SIDECAR_CONTAINER
from disagg.worker.kv import wire
from disagg.worker.reporting.peer_check import check_peer
from disagg.worker.reporting.watch import check_decode_peer, check_own_engine, watch_round
from disagg.worker.sidecar.config import SidecarConfig


def pod_of(cfg: SidecarConfig, name: str) -> dict[str, Any]:
    """The Pod object of a worker, as the API server serves it to `list_pods`."""
    return {
        "metadata": {"name": name, "labels": {ROLE_LABEL: cfg.role}},
        "spec": {
            "containers": [
                {
                    "name": SIDECAR_CONTAINER,
                    "ports": [{"name": SIDE_CHANNEL_PORT_NAME, "containerPort": cfg.side_channel_port}],
                }
            ]
        },
        "status": {"podIP": cfg.side_channel_host},
    }


def other_hash(cfg: SidecarConfig, **changes: Any) -> str:
    assert cfg.compat_factors is not None
    hashed: str = wire.compat_hash({**cfg.compat_factors, **changes})
    return hashed


def test_a_decode_pod_with_a_healthy_engine_and_prefill_stage_is_ready(tmp_path: Path) -> None:
    port = str(free_port())
    engine = config(tmp_path, "decode", DECODE_POD, topology(), DISAGG_SIDE_CHANNEL_PORT=port)
    watcher = config(tmp_path, "decode", DECODE_POD, topology(), DISAGG_SIDE_CHANNEL_PORT=port)
    head = config(tmp_path, "prefill", HEAD_POD, topology())
    stage = config(tmp_path, "prefill", PREFILL_POD, topology())
    with worker(engine), prefill_engine(head, stage):
        own = check_own_engine(watcher)
        outcome = watch_round(watcher, DECODE_POD, [pod_of(head, HEAD_POD), pod_of(stage, PREFILL_POD)])
    assert [(rank.pp_rank, rank.tp_rank, rank.metadata.engine_id) for rank in own] == [(0, 0, DECODE_POD)]
    assert (outcome.status, outcome.reason) == ("True", "HandshakesSucceeded")
    assert f"prefill stage 1 (pod {PREFILL_POD})" in outcome.message
    # The Pod's peer report: its engine as the side channel answers for it, and what each stage advertised.
    report = outcome.report
    assert report is not None
    assert (report.engine_id, report.kv_hash) == (DECODE_POD, engine.compat_hash)
    assert [(v.pod, v.engine_id, v.ok, v.reason, v.kv_hash) for v in report.peers] == [
        (HEAD_POD, head.engine_id, True, "HandshakesSucceeded", head.compat_hash),
        (PREFILL_POD, stage.engine_id, True, "HandshakesSucceeded", stage.compat_hash),
    ]


def test_a_prefill_stage_with_a_matching_decoder_is_ready(tmp_path: Path) -> None:
    port = str(free_port())
    engine = config(tmp_path, "prefill", PREFILL_POD, topology(), DISAGG_SIDE_CHANNEL_PORT=port)
    watcher = config(tmp_path, "prefill", PREFILL_POD, topology(), DISAGG_SIDE_CHANNEL_PORT=port)
    decode = config(tmp_path, "decode", DECODE_POD, topology())
    with worker(engine), worker(decode):
        outcome = watch_round(watcher, PREFILL_POD, [pod_of(decode, DECODE_POD)])
    assert (outcome.status, outcome.reason) == ("True", "HandshakesSucceeded")
    assert f"decode pod {DECODE_POD}" in outcome.message


@pytest.mark.parametrize(
    ("decode_doc", "reason"),
    [
        (
            topology(model={"layerNameTemplate": "model.language_model.layers.{i}.self_attn.attn"}),
            "MissingLayers",
        ),
        (topology(blockSize=32), "BlockSizeMismatch"),
        (topology(model={"name": None, "dtype": None, "headSize": 32}), "RegionGeometryMismatch"),
    ],
)
def test_the_prefill_stage_refuses_a_decoder_as_the_transfer_sidecar_would(
    tmp_path: Path, decode_doc: dict[str, Any], reason: str
) -> None:
    """From the engine's advertised metadata, the watch check gives the reason the connector's plan gives
    from a registered `LocalKV`; the condition is False with it, naming the decoder."""
    doc = topology(model={"name": None, "dtype": None}) if reason == "RegionGeometryMismatch" else topology()
    port = str(free_port())
    engine = config(tmp_path, "prefill", PREFILL_POD, doc, DISAGG_SIDE_CHANNEL_PORT=port)
    watcher = config(tmp_path, "prefill", PREFILL_POD, doc, DISAGG_SIDE_CHANNEL_PORT=port)
    decode = config(tmp_path, "decode", DECODE_POD, decode_doc)
    with worker(engine) as (local, _), worker(decode):
        target = peer_of(decode, DECODE_POD)
        planned = check_peer(engine, local, target)
        watched = check_decode_peer(watcher, check_own_engine(watcher), target)
        outcome = watch_round(watcher, PREFILL_POD, [pod_of(decode, DECODE_POD)])
    assert planned is not None and watched is not None
    assert watched.reason == planned.reason == reason
    assert (outcome.status, outcome.reason) == ("False", reason)
    assert f"decode pod {DECODE_POD} at {HOST}:{decode.side_channel_port}" in outcome.message
    assert outcome.report is not None
    assert [(v.pod, v.engine_id, v.ok, v.reason) for v in outcome.report.peers] == [
        (DECODE_POD, DECODE_POD, False, reason)
    ]


def test_an_engine_on_another_version_than_the_spec_makes_the_pod_unready(tmp_path: Path) -> None:
    port = str(free_port())
    watcher = config(tmp_path, "decode", DECODE_POD, topology(), DISAGG_SIDE_CHANNEL_PORT=port)
    stray = other_hash(watcher, vllm_version="0.32.0")
    engine = config(
        tmp_path,
        "decode",
        DECODE_POD,
        topology(compatibilityHashes={"decode": stray}),
        DISAGG_SIDE_CHANNEL_PORT=port,
    )
    stage = config(tmp_path, "prefill", PREFILL_POD, topology())
    with worker(engine), worker(stage):
        outcome = watch_round(watcher, DECODE_POD, [pod_of(stage, PREFILL_POD)])
    assert (outcome.status, outcome.reason) == ("False", "CompatibilityHashMismatch")
    assert f"this pod's own engine {DECODE_POD}" in outcome.message
    assert stray in outcome.message
    assert [result.error.reason for result in outcome.refusals if result.error] == [
        "CompatibilityHashMismatch"
    ]
    # Its live engine still vouches for the stage it accepts, with the hash it really advertises: pairing
    # then finds the stage's side disagreeing, whatever the spec predicted.
    assert outcome.report is not None
    assert (outcome.report.engine_id, outcome.report.kv_hash) == (DECODE_POD, stray)


def test_an_engine_on_connector_version_11_is_a_version_mismatch(tmp_path: Path) -> None:
    port = str(free_port())
    watcher = config(tmp_path, "prefill", PREFILL_POD, topology(), DISAGG_SIDE_CHANNEL_PORT=port)
    v11 = other_hash(watcher, nixl_connector_version=11)
    doc = topology(compatibilityHashes={"prefill": v11})
    with worker(config(tmp_path, "prefill", PREFILL_POD, doc, DISAGG_SIDE_CHANNEL_PORT=port)):
        outcome = watch_round(watcher, PREFILL_POD, [])
    assert (outcome.status, outcome.reason) == ("False", "ConnectorVersionMismatch")
    assert "this pod's own engine tiny-prefill-0" in outcome.message


def test_an_engine_answering_as_another_engine_is_refused(tmp_path: Path) -> None:
    port = str(free_port())
    watcher = config(tmp_path, "decode", DECODE_POD, topology(), DISAGG_SIDE_CHANNEL_PORT=port)
    engine = config(
        tmp_path, "decode", DECODE_POD, topology(), DISAGG_SIDE_CHANNEL_PORT=port, DISAGG_ENGINE_ID="other"
    )
    with worker(engine):
        outcome = watch_round(watcher, DECODE_POD, [])
    assert (outcome.status, outcome.reason) == ("False", "EngineIdMismatch")


def test_an_engine_that_does_not_answer_is_unreachable_and_named(tmp_path: Path) -> None:
    watcher = config(tmp_path, "decode", DECODE_POD, topology())
    stage = config(tmp_path, "prefill", PREFILL_POD, topology())
    with worker(stage):
        outcome = watch_round(watcher, DECODE_POD, [pod_of(stage, PREFILL_POD)], timeout_s=0.5)
    assert (outcome.status, outcome.reason) == ("False", "PeerUnreachable")
    assert f"{HOST}:{watcher.side_channel_port}" in outcome.message
    assert f"this pod's own engine {DECODE_POD}" in outcome.message
    assert outcome.report is not None and outcome.report.peers == (), "nothing is vouched for"


def test_a_healthy_engine_without_peers_waits_for_them(tmp_path: Path) -> None:
    port = str(free_port())
    engine = config(tmp_path, "decode", DECODE_POD, topology(), DISAGG_SIDE_CHANNEL_PORT=port)
    watcher = config(tmp_path, "decode", DECODE_POD, topology(), DISAGG_SIDE_CHANNEL_PORT=port)
    with worker(engine):
        outcome = watch_round(watcher, DECODE_POD, [])
    assert (outcome.status, outcome.reason) == ("Unknown", "NoPeers")


def test_a_decoder_on_another_dtype_is_refused_for_its_dtype_not_its_version(tmp_path: Path) -> None:
    """The issue's refusal: the same release on both sides, the decoder's engine in float32 where the spec
    (and the prefill stage) say float16. The prefill's watcher names the dtype from the block_lens both
    side channels serve, never the version."""
    port = str(free_port())
    engine = config(tmp_path, "prefill", PREFILL_POD, topology(), DISAGG_SIDE_CHANNEL_PORT=port)
    watcher = config(tmp_path, "prefill", PREFILL_POD, topology(), DISAGG_SIDE_CHANNEL_PORT=port)
    decode = config(tmp_path, "decode", DECODE_POD, topology(model={"dtype": "float32", "dtypeBytes": 4}))
    with worker(engine), worker(decode):
        outcome = watch_round(watcher, PREFILL_POD, [pod_of(decode, DECODE_POD)])
    assert (outcome.status, outcome.reason) == ("False", "CompatibilityHashMismatch")
    assert "the engines differ in the KV dtype" in outcome.message
    assert "128 KV bytes per token here, 256 there" in outcome.message
    assert "what bfloat16 or float16 here against float32 there" in outcome.message
    assert "vLLM version" not in outcome.message
