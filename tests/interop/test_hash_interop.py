"""The compatibility hash the operator predicts is the one vLLM computes: vLLM builds its own VllmConfig from
the argv each generated engine pod runs and hashes it with compute_nixl_compatibility_hash."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from _engine_argv import engine_pods, example_document, example_spec, judged
from _vllm_peer import RELEASES, PeerFactory, VllmPeer

from disagg.operator.cli.main import main
from disagg.operator.policies.compat import role_factors

# Three model families, with the public config.json values hack/vllm/peer.py writes into the offline HF cache.
GEMMA: dict[str, Any] = {
    "model": {
        "name": "google/gemma-3-1b-it",
        "numLayers": 26,
        "numKvHeads": 1,
        "headSize": 256,
        "layerPattern": {"fullEvery": 6},
    },
}
LLAMA: dict[str, Any] = {
    "model": {
        "name": "meta-llama/Llama-3.1-8B-Instruct",
        "numLayers": 32,
        "numKvHeads": 8,
        "headSize": 128,
        "layerPattern": None,
    },
}
# MLA: vLLM hashes the config's num_key_value_heads (16), not the single latent "head", and the latent width
# (kv_lora_rank 512 + rope 64) as the head size.
DEEPSEEK: dict[str, Any] = {
    "model": {
        "name": "deepseek-ai/DeepSeek-V2-Lite",
        "numLayers": 27,
        "numKvHeads": 16,
        "headSize": 576,
        "attentionKind": "MLA",
        "layerPattern": None,
    },
    "engine": {"attentionBackend": "FLASHMLA"},
}
MODELS = {"gemma3-hybrid": GEMMA, "llama-dense": LLAMA, "deepseek-mla": DEEPSEEK}


def vllm_hash(peer: VllmPeer, argv: list[str]) -> dict[str, Any]:
    result: dict[str, Any] = peer.call("config_hash", argv=argv)
    return result


@pytest.mark.parametrize("version", ["0.33.0", "0.34.0"])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_the_predicted_hash_is_vllm_own(
    vllm_peers: PeerFactory, tmp_path: Path, model: str, version: str
) -> None:
    vllm_peer = vllm_peers(version)
    engine = {**MODELS[model].get("engine", {}), "version": version, "image": f"vllm/vllm-openai:v{version}"}
    spec = example_spec({**MODELS[model], "engine": engine})
    report = judged(spec)
    pods = engine_pods(spec, tmp_path)
    assert [p.role for p in pods] == ["prefill", "prefill", "decode"]
    for pod in pods:
        computed = vllm_hash(vllm_peer, pod.argv)
        predicted = role_factors(spec, pod.role)
        assert computed["factors"] == predicted, pod.pod
        assert computed["hash"] == report.hashes[pod.role], pod.pod


@pytest.mark.parametrize("version", RELEASES)
def test_each_release_hashes_what_the_operator_predicts(
    vllm_peers: PeerFactory, tmp_path: Path, version: str
) -> None:
    peer = vllm_peers(version)
    spec = example_spec({**GEMMA, "engine": {"version": version, "image": f"vllm/vllm-openai:v{version}"}})
    report = judged(spec)
    decode = next(p for p in engine_pods(spec, tmp_path) if p.role == "decode")
    computed = vllm_hash(peer, decode.argv)
    assert computed["factors"]["nixl_connector_version"] == peer.connector_version
    assert computed["factors"] == role_factors(spec, "decode")
    assert computed["hash"] == report.hashes["decode"]


def test_disagg_check_prints_the_hash_vllm_computes(
    vllm_peer: VllmPeer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "gemma.yaml"
    path.write_text(yaml.safe_dump(example_document(GEMMA)))
    assert main(["check", str(path)]) == 0
    printed = capsys.readouterr().out
    decode = next(p for p in engine_pods(example_spec(GEMMA), tmp_path) if p.role == "decode")
    computed = vllm_hash(vllm_peer, decode.argv)
    assert f"compatibility hash vLLM computes: {computed['hash']} (prefill and decode)" in printed
    assert "vLLM 0.33.0 (NIXL connector version 15)" in printed
