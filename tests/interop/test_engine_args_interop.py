"""The engine arguments and environment the operator generates are ones vLLM runs: every pod's argv parses
with `vllm serve`'s parser and builds a VllmConfig, and every VLLM_* variable is one vllm.envs knows."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from _engine_argv import OWNER, engine_pods, example_spec, judged, kv_transfer_config
from _vllm_peer import RELEASES, PeerFactory, VllmPeer
from test_hash_interop import DEEPSEEK, GEMMA, LLAMA

from disagg.operator.builders import ENGINE_CONTAINER, Installation, build

SPECS: dict[str, dict[str, Any]] = {
    "pp2-hybrid": GEMMA,
    "tp2-dense-pp1": {**LLAMA, "prefill": {"pipelineParallelSize": 1, "tensorParallelSize": 2}},
    "pp2-tp1-mla": {**DEEPSEEK, "prefill": {"tensorParallelSize": 1}, "decode": {"tensorParallelSize": 1}},
}
SUFFIX = re.compile(r"-[0-9a-f]{8}")


@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_generated_argv_builds_a_vllm_config(vllm_peer: VllmPeer, tmp_path: Path, name: str) -> None:
    spec = example_spec(SPECS[name])
    pods = engine_pods(spec, tmp_path)
    for pod in pods:
        parsed = vllm_peer.call("parse_argv", argv=pod.argv)
        role = spec.prefill if pod.role == "prefill" else spec.decode
        assert parsed["headless"] == (pod.role == "prefill" and not pod.pod.endswith("-0")), pod.pod
        built = vllm_peer.call("config_hash", argv=pod.argv)
        assert built["tensor_parallel_size"] == role.tensor_parallel_size
        assert built["pipeline_parallel_size"] == role.pipeline_parallel_size
        assert parsed["block_size"] == role.block_size
        # vLLM's CPU platform forces block size 16 on MLA models (its CPU MLA kernel); a GPU keeps the flag's.
        if spec.model.attention_kind.value != "MLA":
            assert built["block_size"] == role.block_size
        assert built["attention_backend"] == spec.engine.attention_backend
        assert built["kv_role"] == ("kv_producer" if pod.role == "prefill" else "kv_consumer")
        # The pinned engine id: the stable prefix (the sidecar's engine id) plus a per-start suffix.
        prefix = pod.pod.rsplit("-", 1)[0] if pod.role == "prefill" else pod.pod
        assert built["engine_id"].startswith(prefix) and SUFFIX.fullmatch(built["engine_id"][len(prefix) :])
        assert kv_transfer_config(pod.argv)["engine_id"] == built["engine_id"]


def test_the_engine_id_is_new_on_every_start(vllm_peer: VllmPeer, tmp_path: Path) -> None:
    spec = example_spec(GEMMA)
    first = {p.pod: kv_transfer_config(p.argv)["engine_id"] for p in engine_pods(spec, tmp_path)}
    again = {p.pod: kv_transfer_config(p.argv)["engine_id"] for p in engine_pods(spec, tmp_path)}
    assert first.keys() == again.keys()
    assert all(first[pod] != again[pod] for pod in first)
    # vLLM takes it as given (it draws a uuid only when none is set).
    decode = next(p for p in engine_pods(spec, tmp_path) if p.role == "decode")
    config = vllm_peer.call("kv_transfer_config", config=kv_transfer_config(decode.argv))
    assert config["engine_id"] == kv_transfer_config(decode.argv)["engine_id"]
    assert config["connector_class"].endswith(".NixlPushConnector") and config["supports_hma"]
    assert config["kv_connector_extra_config"] == {"backends": ["UCX"], "kv_lease_duration": 120}


@pytest.mark.parametrize("version", RELEASES)
def test_every_vllm_variable_the_operator_sets_is_known_to_the_release(
    vllm_peers: PeerFactory, version: str
) -> None:
    known = set(vllm_peers(version).call("env_names"))
    for name, patch in SPECS.items():
        spec = example_spec({**patch, "engine": {**patch.get("engine", {}), "version": version}})
        report = judged(spec)
        assert report.plan is not None
        for obj in build(spec, OWNER, report.plan, report.hashes, Installation(worker_image="w:1")):
            if obj["kind"] not in ("StatefulSet", "Deployment"):
                continue
            for container in obj["spec"]["template"]["spec"]["containers"]:
                names = {item["name"] for item in container.get("env", [])}
                unknown = sorted(n for n in names if n.startswith("VLLM_") and n not in known)
                assert unknown == [], (name, container["name"], obj["metadata"]["name"])
                if container["name"] == ENGINE_CONTAINER:
                    assert {"VLLM_NIXL_SIDE_CHANNEL_HOST", "VLLM_NIXL_SIDE_CHANNEL_PORT"} <= names
